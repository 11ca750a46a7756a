"""The real-memory test bed: two processes, the measured one as device (BFC), the other as host.

Memory claims are checked here, by measurement: within one process two logical CPUs share
buffers and no swap can free anything (see DESIGN.md §2b).
"""

import functools
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import tensorflow as tf

import tflms
from tflms import LMSConfig, testbed
from tflms.testing.measure import measure

from conftest import DEVICE, SMALL, TESTS

pytestmark = pytest.mark.integration

# TensorFlow's CPU kernels are not bit-reproducible here for these models: two plain runs of
# ResNet50 96² b32 in one process (same weights, op determinism on) differed from step 2 on,
# and across processes too. So the first step's loss must match exactly (forward pass of the
# same weights), later ones within this relative tolerance. Exact equality of the rewrite is
# checked in one process on the zoo (tests/test_zoo.py), where the plain step is reproducible.
LOSS_RTOL = 1e-3


def _check_losses(plain, lms):
    assert lms["losses"][0] == plain["losses"][0]
    for a, b in zip(lms["losses"], plain["losses"]):
        assert abs(a - b) <= LOSS_RTOL * abs(b), (lms["losses"], plain["losses"])
    assert plain["losses"][-1] < plain["losses"][0]  # it trained


#: How far a measured peak may lie from the simulator's, on any CPU. Above: the prediction emulates
#: the BFC allocator's chunks for the simulator's order of the ops; the executor runs another order
#: and its allocations split other chunks (plain steps measured up to 1.17 of their prediction, step
#: by step: benchmarks/results/simulator_accuracy.json). Below: the bytes the step requests at its
#: peak are what any run holds at once, the allocator's rounding and unsplit rests aside, unless the
#: executor's order overlaps fewer of them; whether the emulated rests appear depends on the order
#: the CPU's threads allocate in (test_gpt_plain_step_measures_within_its_prediction's GPT measured 1.00 of its
#: prediction on one CPU, 0.87 on another, where it measured its requested peak).
ABOVE_PREDICTED = 1.2
BELOW_REQUESTED = 0.9


def _check_measured_against_predicted(v: dict) -> None:
    """``v``'s steady-state measured ``peak`` within the bounds above of its ``predicted`` and
    ``requested`` peaks, and at least the simulator's ``floor``, if ``v`` has one."""
    low, high = BELOW_REQUESTED * v["requested"], ABOVE_PREDICTED * v["predicted"]
    assert low <= v["peak"] <= high, (v["peaks"], v["requested"], v["predicted"])
    assert v["peak"] >= v.get("floor", 0), (v["peaks"], v["floor"])


# ----------------------------------------------------------------- lifecycle and errors
@pytest.mark.measured
def test_host_worker_starts_serves_and_stops():
    # Started without waiting (as run_measured's measured process does, to load TensorFlow
    # meanwhile): the server listens once wait() has returned. (start() waits by default:
    # the next two tests.)
    with testbed.HostWorker().start(wait=False) as worker:
        assert worker.running
        host, port = worker.wait().address.split(":")
        with socket.create_connection((host, int(port)), timeout=5):
            pass
    assert not worker.running
    with pytest.raises(testbed.TestBedError, match="not been started"):
        _ = testbed.HostWorker().address
    with pytest.raises(testbed.TestBedError, match="not been started"):
        testbed.HostWorker().wait()


@pytest.mark.measured
def test_host_worker_on_a_taken_port_fails_clearly():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(testbed.TestBedError, match=rf"exited with code \d+ before listening on localhost:{port}"):
            testbed.HostWorker(port=port, timeout=60).start()


@pytest.mark.measured
def test_host_worker_dies_with_its_parent(tmp_path):
    script = textwrap.dedent(
        """
        import os, sys, time
        from tflms import testbed
        w = testbed.HostWorker().start()
        print(w._proc.pid, flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    worker_pid = int(parent.stdout.readline())
    os.kill(worker_pid, 0)  # alive
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(worker_pid, 0)
        except ProcessLookupError:
            return
        # A zombie (dead, not yet reaped by init) counts as gone.
        with open(f"/proc/{worker_pid}/stat") as f:
            if f.read().split(")")[-1].split()[0] == "Z":
                return
        time.sleep(0.2)
    pytest.fail(f"host worker {worker_pid} still alive 20 s after its parent was killed")


@pytest.mark.measured
def test_memory_needs_the_bfc_allocator():
    assert not testbed.is_measured_process()
    with pytest.raises(testbed.TestBedError, match="TF_CPU_ALLOCATOR_USE_BFC=true"):
        testbed.memory()
    env = testbed.device_environ("1GiB", base={"TF_CPU_BFC_MEM_LIMIT_IN_MB": "5", "TF_ENABLE_ONEDNN_OPTS": "1"})
    # TensorFlow's own kernels, whatever the caller's process runs (tests/conftest.py: oneDNN), so
    # that an allocation past the cap raises as on a GPU; the choice travels to the processes it starts.
    assert env == {
        "TF_CPU_ALLOCATOR_USE_BFC": "true",
        "TF_CPU_BFC_MEM_LIMIT_IN_MB": "1024",
        "TF_ENABLE_ONEDNN_OPTS": "0",
        "TFLMS_TESTBED_ONEDNN": "0",
    }
    for opted_in in (
        testbed.device_environ(base={}, onednn=True),
        testbed.device_environ(base={"TFLMS_TESTBED_ONEDNN": "1"}),
    ):
        assert opted_in["TF_ENABLE_ONEDNN_OPTS"] == opted_in["TFLMS_TESTBED_ONEDNN"] == "1", opted_in
    assert testbed.device_environ(base={"TFLMS_TESTBED_ONEDNN": "1"}, onednn=False)["TF_ENABLE_ONEDNN_OPTS"] == "0"
    with pytest.raises(ValueError, match="cap"):
        testbed.device_environ(1000)


@pytest.mark.measured
def test_a_measured_gpu_process_measures_gpu_0_or_says_it_sees_none(monkeypatch):
    env = testbed.device_environ("1GiB", base={"TF_CPU_ALLOCATOR_USE_BFC": "true", "TFLMS_MEASURED_GPU": "5"}, gpu=True)
    assert env == {"TFLMS_MEASURED_GPU": "1024"}  # the CPU keeps TensorFlow's allocator
    assert testbed.device_environ(base={}, gpu=True) == {"TFLMS_MEASURED_GPU": "0"}  # no cap: memory growth
    assert testbed.devices() == (testbed.DEVICE, testbed.HOST)
    monkeypatch.setenv("TFLMS_MEASURED_GPU", "0")
    assert testbed.is_measured_process()
    assert testbed.devices() == (testbed.GPU_DEVICE, testbed.GPU_HOST)
    monkeypatch.delenv("TFLMS_MEASURED_GPU")
    r = measure("cnn", 64, size=64, steps=2, cap="1GiB", gpu=True, timeout=300)
    if tf.config.list_physical_devices("GPU"):  # a GPU: measured on it (tests/test_gpu.py's CNN), under the cap
        assert r.ok and 0 < r.value["lms"]["peak"] < r.value["plain"]["peak"] <= 2**30, r
    else:
        assert r.status == "error" and "TensorFlow sees no GPU in this process" in r.error, r


@pytest.mark.measured
def test_run_measured_reports_errors_without_raising():
    bad = testbed.run_measured("tflms.no_such_module:f", timeout=120)
    assert bad.status == "error" and "no_such_module" in bad.error
    with pytest.raises(ValueError, match="target"):
        testbed.run_measured("no colon")


@pytest.mark.measured
def test_a_cap_above_two_gib_is_claimed_in_one_region():
    """A shape's dimensions are 32-bit: the claim of a 3 GiB cap is one request all the same."""
    r = testbed.run_measured("tflms.testing.testbed:memory", cap="3GiB", timeout=300)
    assert r.ok, (r.status, r.error[-2000:])
    assert r.value["current"] < 64 * 2**20 and r.value["peak"] == r.value["current"], r.value  # freed, peak reset


@pytest.mark.measured
def test_measured_process_yields_the_cores_to_its_host_worker():
    """connect() lowers every thread of the measured process, and every thread it starts
    later, by DEVICE_NICE; the host worker, started before, keeps its priority."""
    r = testbed.run_measured("testbed_jobs:priorities", timeout=300, pythonpath=[str(TESTS)])
    assert r.ok, r.error
    base = os.getpriority(os.PRIO_PROCESS, 0)  # the measured process inherits this one's
    expected = min(19, base + testbed.DEVICE_NICE)
    assert testbed.DEVICE_NICE > 0
    assert len(r.value["threads"]) > 2 and set(r.value["threads"]) == {expected}, r.value
    assert r.value["new_thread"] == expected
    assert r.value["workers"] == [base], r.value
    for bad in (-1, 20, 2.5, True):
        with pytest.raises(ValueError, match=rf"nice must be an int from 0 to 19.*Received: nice={bad!r}"):
            testbed.connect(testbed.HostWorker(), nice=bad)


@pytest.mark.measured
def test_device_strings_keep_job_replica_and_task():
    cfg = LMSConfig(device=testbed.DEVICE, host=testbed.HOST)
    assert cfg.device == "/job:localhost/replica:0/task:0/device:CPU:0"
    assert cfg.host == "/job:worker/replica:0/task:0/device:CPU:0"
    assert LMSConfig(host="/job:worker/task:1/device:cpu:0").host == "/job:worker/replica:0/task:1/device:CPU:0"
    with pytest.raises(ValueError, match="device and host must differ"):
        LMSConfig(device="/device:CPU:0", host="/job:localhost/replica:0/task:0/device:CPU:0")


@pytest.mark.measured
def test_a_host_in_another_process_is_honoured_or_refused_never_replaced():
    import zoo

    setup = zoo.mlp()
    import tensorflow as tf

    cf = tf.function(setup.step_fn()).get_concrete_function(setup.x, setup.y)
    with pytest.raises(ValueError, match=r"host '/job:worker/replica:0/task:0/device:CPU:0' does not exist.*connect"):
        tflms.optimize(cf, device=DEVICE, host=testbed.HOST)


# ------------------------------------------------------------------ real memory, measured
def _measured(model, batch, **kwargs):
    r = measure(model, batch, timeout=900, **kwargs)
    assert r.ok, r.error
    return r.value


@pytest.mark.slow
@pytest.mark.measured
def test_resnet50_host_gated_swaps_free_real_memory_device_gated_do_not():
    """ResNet50 96², batch 16, Adam: the rewritten step's measured peak against the plain
    step's, and the negative control that pins the TensorFlow fact behind it: the same
    plan with device-side swap-ins frees nothing (the receive has no inputs, so the
    tensor comes straight back after the swap-out)."""
    # The swaps alone (policy "none"): the TensorFlow fact pinned here is about swap-ins.
    v = _measured("resnet50", 16, modes=["plain", "lms", "lms_device_gated"], steps=2, options={"policy": "none"})
    plain, lms, gated = v["plain"], v["lms"], v["lms_device_gated"]
    _check_losses(plain, lms)
    _check_losses(plain, gated)
    # Steady-state peaks (the warm-up step excluded), oneDNN kernels, 2-CPU AMD EPYC: tflms / plain
    # 0.68-0.69, device-gated / plain 0.99-1.01 (2026-11-23, two runs). Weights and Adam slots alone
    # are ~270 MiB of each peak.
    assert lms["peak"] <= 0.85 * plain["peak"], (lms["peak"], plain["peak"])
    assert gated["peak"] >= 0.9 * plain["peak"], (gated["peak"], plain["peak"])


@pytest.mark.measured
def test_updates_ordered_after_the_reads_of_their_variable_copy_nothing():
    """``order_updates=True`` against ``False`` on the CNN's plan, three profiled steps each: with
    the orders no Adam update allocates (TensorFlow copies a variable only while a value read from it
    is held); without them some do, in at least one step, which pins that TensorFlow fact. Measured
    here (2026-11-27): no copy with the orders in 3 processes; 2-4 copies (5-509 KiB) per profiled
    step without, in every one of 9, which ones varying from process to process; then a CI run whose
    one profiled step without the orders copied nothing (whether a read is still held when the
    update runs is a matter of timing), hence three steps. Before the orders went on a gate in front
    of the optimizer's IdentityN (Grappler's dependency optimizer drops a control edge on the update
    as redundant, then removes the IdentityN), the ordered steps copied 1-3 variables too."""
    r = testbed.run_measured(
        "testbed_jobs:update_copies", {"model": "cnn", "batch": 32}, timeout=900, pythonpath=[str(TESTS)]
    )
    assert r.ok, r.error
    ordered, copying = r.value["ordered"], r.value["copying"]
    assert ordered["losses"] == copying["losses"]
    assert ordered["n_orders"] > copying["n_orders"]
    assert ordered["copies"] == [[]] * 3, ordered["copies"]
    assert any(copying["copies"]), "no update copied its variable without the orders: has TensorFlow changed?"


@pytest.mark.measured
def test_left_out_tiles_allocate_nothing_of_an_activations_size():
    """drop_tiles on the test bed's real allocator, the CNN at batch 32 (five BatchNorms): with the
    tiles kept, each BatchNorm gradient's two ``Tile`` ops allocate a full activation's bytes (1-16
    MiB here); left out, none of them allocates, and the losses are the same. Measured here
    (2026-11-27, one process): kept, the ten allocated 1, 1, 2, 2, 8, 8 and four times 16 MiB;
    left out, nothing, and the ops made again allocated nothing either (TensorFlow forwarded
    their inputs' buffers); the test holds them to what the ops they replace allocated."""
    r = testbed.run_measured(
        "testbed_jobs:tile_allocations",
        {"model": "cnn", "batch": 32},
        timeout=900,
        pythonpath=[str(TESTS)],
    )
    assert r.ok, r.error
    dropped, kept, sizes = r.value["dropped"], r.value["kept"], r.value["tile_bytes"]
    assert dropped["losses"] == kept["losses"]
    assert len(dropped["tiles"]) == 10 and kept["tiles"] == []
    assert all("/moments/Tile" in t for t in dropped["tiles"])
    full = {op for op, nbytes in kept["by_tiles"] if nbytes == sizes[op] >= 2**20}
    assert full == set(dropped["tiles"]), kept["by_tiles"]
    assert not [a for a in dropped["by_tiles"] if a[0] in dropped["tiles"]], dropped["by_tiles"]
    # The ops made again read the per-channel value instead of its copy: they ask for no more than
    # the ops they replace did with the tiles kept.
    assert r.value["remade"] and not dropped["by_originals"] and not kept["by_remade"]
    made_again = sum(nbytes for _, nbytes in dropped["by_remade"])
    assert made_again <= sum(nbytes for _, nbytes in kept["by_originals"]), (dropped["by_remade"], kept["by_originals"])


# Steady-state peaks (largest per-step peak after one warm-up step), tflms / plain, oneDNN, 2-CPU
# AMD EPYC, 2026-11-23: transformer 0.48-0.69 over six runs; the CNN 0.75-0.88, because its peak is
# in the first block's backward (64x64x32 gradients) where swapping forward activations saves
# little, and its per-step peaks vary by up to 25 % (the BFC allocator's free list differs from step
# to step: at one plain peak two 16 MiB requests held 26 and 23 MiB chunks). The simulator-accuracy
# runs of 2026-11-24 put the CNN at 0.71-1.09 per run, and a CI run of 2026-11-24 measured 114.15
# against 114.06 MiB plain (1.001), so the CNN is held to 1.1 x plain. The first step is not
# counted: the rewritten step's first peak measured up to 1.8x its later ones (see tflms.testing.measure.measure_step).
def _plain_requested(model: str, batch: int, predicted: int) -> int:
    """The simulator's requested-bytes peak of ``model``'s plain step at ``batch``, traced here as
    tflms.testing.measure traces it (the same graph: its predicted peak is ``predicted``)."""
    from tflms.testing.zoo import build

    _, x, y, step = build(model, batch)
    sim = tflms.Simulator(tflms.GraphModel.from_func_graph(tf.function(step).get_concrete_function(x, y).graph))
    assert sim.peak() == predicted, (sim.peak(), predicted)
    return sim.requested_peak()


@functools.cache
def _transformer_measured():
    """The transformer block at batch 8, plain, swaps and swaps with recompute, in one measured
    process: for the next two tests (a fresh measured process costs about 20 s)."""
    return _measured("transformer", 8, modes=["plain", "lms", "lms_recompute"], steps=4)


@pytest.mark.slow
@pytest.mark.measured
@pytest.mark.parametrize("model,batch,ratio", [("cnn", 32, 1.1), ("transformer", 8, 0.85)])
def test_rewritten_step_measures_less_than_plain(model, batch, ratio):
    v = _transformer_measured() if model == "transformer" else _measured(model, batch, steps=4)
    plain, lms = v["plain"], v["lms"]
    _check_losses(plain, lms)
    assert lms["n_swaps"] > 0
    assert lms["peak"] < ratio * plain["peak"], (lms["peak"], plain["peak"])
    if model == "transformer":
        # The plain step against the simulator, which models Grappler's constant push-down (the
        # scaled softmax computed in the forward pass): 210.5 MiB predicted, 196 MiB requested.
        # Without the push-down the simulator predicted 174 MiB, under what any run measures.
        _check_measured_against_predicted({**plain, "requested": _plain_requested(model, batch, plain["predicted"])})


@pytest.mark.measured
def test_gpt_plain_step_measures_within_its_prediction():
    """The GPT of tflms.testing.measure (vocabulary 8000, width 256, 4 causal blocks) at batch 8, traced as
    a user traces it (op determinism off: TensorFlow's fused sparse cross-entropy, which writes its
    backprop into the 62.5 MiB logits, as the attention's Softmax writes into its scores; rule 3 of
    tflms.emulate.simulator). Asserted, as holds on any CPU: the measured peak is at least the
    simulator's floor (the variables and the largest working set of one op, 155 MiB: no run holds
    less) and 0.9 of the requested-bytes peak (458 MiB), and at most 1.2 times the predicted peak
    (523 MiB; see ``ABOVE_PREDICTED``). tests/emulate/test_gpt_prediction.py pins the prediction
    without the test bed."""
    jobs = [str(TESTS)]
    r = testbed.run_measured("testbed_jobs:gpt_steps", {"batch": 8, "steps": 3}, timeout=900, pythonpath=jobs)
    assert r.ok, r.error
    v = r.value
    assert v["losses"][-1] < v["losses"][0]  # it trained
    assert v["floor"] < v["requested"] <= v["predicted"]
    _check_measured_against_predicted(v)


@pytest.mark.measured
def test_gpt_logits_find_no_chunk_under_a_cap_while_most_of_the_pool_is_free():
    """The TensorFlow fact behind tflms.plan.planner.check_placement: a tensor needs one contiguous
    chunk, and the allocator's regions (grown by doubling, never returned) fragment. The GPT at
    batch 16 with its ``budget='320MiB'`` plan (276 MiB predicted, within the budget) under a 320 MiB
    cap: the 125 MiB logits find no chunk although the bytes in use plus the logits are well under
    the cap. Measured here (2026-11-28), two shapes from process to process: 98 MiB in use, 222 MiB
    free, the largest free chunk 108 MiB (regions of 2, 8, 8, 16, 32, 64, 128 and 62 MiB); or 134
    MiB in use, a 258 MiB pool that could not grow its next region within the cap. The default plan
    (248 MiB predicted) trained under 320 MiB (274 MiB measured)."""
    jobs = [str(TESTS)]
    # The swaps alone (policy "none"), as when this was measured: the default passes plan otherwise.
    kwargs = {"batch": 16, "options": {"budget": "320MiB", "policy": "none"}}
    # With the pool grown by regions, as a GPU with memory growth has it (the test bed claims its cap in one).
    r = testbed.run_measured("testbed_jobs:gpt_steps", kwargs, cap="320MiB", timeout=900, pythonpath=jobs, growth=True)
    assert r.status == "oom", (r.status, r.value, r.error[-2000:])
    oom = r.oom
    assert oom is not None and oom["requested"] == 16 * 256 * 8000 * 4, oom  # the logits
    assert oom["op"].endswith("Tensordot/MatMul"), oom
    # Live bytes plus the request fit the cap with room to spare: the allocator's layout refused it.
    assert oom["in_use"] + oom["requested"] < 0.9 * 320 * 2**20, oom
    assert oom["largest_free"] < oom["requested"], oom


@pytest.mark.slow
@pytest.mark.measured
def test_recompute_frees_as_much_real_memory_with_less_link_traffic():
    """recompute=True (issue 8): the transformer's GELU and layer-norm products are recomputed
    instead of swapped. Measured here (2-CPU AMD EPYC, 2026-11-23, three fresh processes): plain
    213-216 MiB, swaps only 92-104 MiB, with recompute 90-98 MiB (predicted 94 MiB both), 134 -> 90
    MiB swapped out. benchmarks/results/recompute.json has two later runs, with the tflms steps at
    MANUAL (2026-11-24): 92-102 MiB swaps only, 95-97 MiB with recompute."""
    v = _transformer_measured()
    plain, lms, rec = v["plain"], v["lms"], v["lms_recompute"]
    _check_losses(plain, rec)
    assert rec["n_recomputes"] > 0 and rec["swapped_bytes"] < lms["swapped_bytes"]
    assert rec["link_seconds"] < lms["link_seconds"]
    assert rec["peak"] <= 0.85 * plain["peak"], (rec["peak"], plain["peak"])
    # As for the swaps-only plan (see the next test), transfer time is not simulated. Below: the
    # plan's requested bytes are 0.85 of its predicted peak (BELOW_REQUESTED of that is 0.77).
    assert 0.75 <= rec["peak"] / rec["predicted"] <= 1.8, (rec["peak"], rec["predicted"])


@pytest.mark.measured
def test_fenced_swap_outs_train_across_processes_within_the_prediction():
    """swapout_window on the test bed: the fences are control edges from the host process to
    the measured one. The 8-block encoder at batch 16 trains with the plain step's losses, and
    every step, the first included, measures near the prediction. Measured here (2026-11-24,
    two processes): fenced 205-242 MiB per step against 229 MiB predicted; unfenced 201-251.
    2026-11-25, after the simulator's executor and allocator changes: fenced 248-265 MiB per
    step in three processes and 269-293 in one of a full measured tier, against 225.6 MiB
    predicted (236.5 in that one; not explained), 1.10-1.24; the simulator of 2026-11-24
    predicted 244.3 for the same plan then. A profiled unfenced step (peak_anatomy.py) peaked
    at 255 MiB with 227 MiB requested; the simulator's allocator emulation, run on that
    step's own allocations, gave 256: the miss is the order of the allocations (rounding
    and unsplit rests of 28 MiB measured, 5 predicted), not the emulated allocator.
    At batch 32 the fences remove spikes of up to 2x (benchmarks/results/fences.json)."""
    v = _measured("encoder", 16, modes=["plain", "lms_fenced"], steps=3)
    plain, fenced = v["plain"], v["lms_fenced"]
    # Random labels: the encoder's loss rises over these first Adam steps, so "it trained" is
    # that the loss changed from step to step; the fenced losses follow the plain ones.
    assert len(set(plain["losses"])) == len(plain["losses"])
    np.testing.assert_allclose(fenced["losses"], plain["losses"], rtol=LOSS_RTOL)
    # A fence per swap after the first four, but none on a sum (tflms.plan.planner.UNFENCED_TYPES):
    # the layer norms' AddV2 outputs are swapped unfenced.
    assert 0 < fenced["n_fences"] < fenced["n_swaps"] - 4, (fenced["n_fences"], fenced["n_swaps"])
    assert max(fenced["peaks"]) <= 1.3 * fenced["predicted"], (fenced["peaks"], fenced["predicted"])
    assert fenced["peak"] <= 0.25 * plain["peak"], (fenced["peak"], plain["peak"])


@pytest.mark.slow
@pytest.mark.measured
def test_tflms_function_frees_memory_and_reports_its_measured_peak():
    """The decorator path on the test bed, and its report next to the prediction."""
    tests_dir = str(TESTS)
    r = testbed.run_measured(
        "testbed_jobs:decorated_step_reports_memory",
        {"model": "transformer", "batch": 8, "steps": 3},
        timeout=900,
        pythonpath=[tests_dir],
    )
    assert r.ok, r.error
    plain, lms, report = r.value["plain"], r.value["lms"], r.value["report"]
    _check_losses(plain, lms)
    assert lms["peak"] <= 0.85 * plain["peak"], (lms["peak"], plain["peak"])
    assert report["device"] == testbed.DEVICE
    measured, predicted = report["measured_peak_bytes"], report["predicted_peak_bytes"]
    assert report["predicted_plain_peak_bytes"] > predicted
    # The report covers the same steady steps (reset_peak, then the steps): it is their peak.
    assert measured == lms["peak"], (measured, lms["peak"])
    # The simulator ignores transfer time: a swapped-out buffer stays on the device until the
    # gRPC link (~1 GiB/s) has sent it, and this step moves more than its compute hides. Its
    # steady peak measured 89-147 MiB against 92 MiB predicted (0.97-1.6) over nine runs here.
    # Below: the plan's requested bytes are 0.84 of its predicted peak (BELOW_REQUESTED of that is 0.76).
    assert 0.75 <= measured / predicted <= 1.8, (measured, predicted)
    assert measured < plain["peak"]


@pytest.mark.measured
def test_peak_anatomy_names_what_the_measured_peak_holds():
    """benchmarks/peak_anatomy.py's measurement: the profiler's allocator events, live at the
    peak, add up to the allocator's bytes in use and belong to the traced step's ops. Measured
    here (2-CPU AMD EPYC, 2026-11-23): CNN b32 plain, unprofiled 132 MiB, profiled 137 MiB, at a
    backward op, 59 MiB forward and 75 MiB backward buffers (predicted 54 and 57)."""
    # On oneDNN's kernels, which this anatomy was measured on: Eigen's convolution gradients (the
    # test bed's default) allocate scratch buffers the simulator does not model, and the recorded
    # order's requested bytes then fall 24 % short of the live chunks' (measured 2026-11-28).
    r = testbed.run_measured(
        "tflms.testing.measure:anatomy_step",
        {"model": "cnn", "batch": 32, "mode": "plain"},
        timeout=900,
        onednn=True,
    )
    assert r.ok, r.error
    prof, pred = r.value["profiled"], r.value["predicted"]
    held = sum(prof["by_phase"].values())
    # What the allocator held before the profiled step is the in-use count minus the live chunks:
    # frees without a matching record would leave the live set too large and this too small,
    # lost allocations the other way. It must be about the variables and Adam slots (1.6 MiB), plus
    # a few MiB the runtime keeps (measured 3.3-3.5 MiB here; once, in a CI run of 2026-11-24,
    # 1.49 MiB: 132 KiB under the variables, so one small chunk whose free was not recorded, or a
    # variable held elsewhere). A lost free of an activation (MiBs here) still fails this.
    low = pred["variables"] - 2**20
    assert low <= prof["variables"] <= pred["variables"] + 8 * 2**20, (prof, pred["variables"])
    # Without swaps the profiler does not change what the step holds much (no link to wait for);
    # the allocator's steady-state waste varies from step to step (profiled / unprofiled: 1.17 in
    # the benchmark's run, 0.79 in a CI run of 2026-11-24: 104 vs 132 MiB).
    assert abs(prof["in_use"] / r.value["measured_peak"] - 1) <= 0.25, (prof["in_use"], r.value["measured_peak"])
    # The peak is in the backward pass, holding forward activations, as the simulator says. The
    # allocation that reaches it can be an optimizer op's that starts while the last backward ops
    # still run (a CI run of 2026-11-24: an update op), with the same buffers live.
    assert pred["op_phase"] == "backward" and prof["op_phase"] in ("backward", "update"), prof["op_phase"]
    assert prof["by_phase"].get("forward", 0) > 0 and prof["by_phase"].get("backward", 0) > 0
    assert prof["by_phase"].get("other", 0) <= 0.1 * held, prof["by_phase"]
    assert r.value["predicted_at_measured_op"] is not None
    # Run in the order the profiled step started the ops, the simulator's buffers (requested
    # bytes) are what the live chunks' ops asked for at the measured peak: 104 vs 104 MiB in the
    # benchmark's run, 104 vs 112 in an earlier profiled run. Its own order predicts 112; a wrong
    # recorded order (say, forward ops late) would leave the forward activations out of that peak.
    rec = r.value["recorded_order"]
    assert rec["ops_recorded"] >= 0.4 * rec["ops"], rec
    assert abs(rec["requested"] / prof["requested"] - 1) <= 0.12, (rec, prof["requested"])
    # The allocator emulation replays the same allocations: it reads the same peak of bytes in
    # use, and its chunks hold at least what the live chunks' ops requested at the measured peak.
    replayed = r.value["replayed"]
    assert replayed["measured"] == prof["in_use"] and replayed["out_of_memory"] is None, replayed
    assert replayed["peak"] >= prof["requested"], (replayed, prof["requested"])


@pytest.mark.measured
def test_peak_anatomy_of_a_plan_with_recomputes_simulates_the_step_as_planned():
    """With recompute=True the anatomy's simulator runs the step with its clones, as the planner
    does (without them it cannot place the swap-ins that feed clones): its predicted peak is the
    plan's, made in another fresh process."""
    args = {"model": "transformer", "batch": 8}
    r = testbed.run_measured(
        "tflms.testing.measure:anatomy_step", {**args, "options": {"policy": ("default", "recompute")}}, timeout=900
    )
    assert r.ok, r.error
    planned = testbed.run_measured(
        "testbed_jobs:planned_peak", {**args, "policy": ("default", "recompute")}, timeout=900, pythonpath=[str(TESTS)]
    )
    assert planned.ok, planned.error
    assert r.value["predicted"]["peak"] == planned.value
    assert r.value["profiled"]["in_use"] > 0 and r.value["recorded_order"]["ops_recorded"] > 0


@pytest.mark.measured
def test_memory_report_without_a_measuring_allocator_says_none():
    import zoo

    setup = zoo.mlp()
    step = tflms.function(setup.step_fn(), device=DEVICE, **SMALL)
    assert step.get_plan(setup.x, setup.y).swaps
    with __import__("tensorflow").device(DEVICE):
        step(setup.x, setup.y)
    report = step.memory_report(setup.x, setup.y)
    assert report["measured_peak_bytes"] is None and report["device"] == DEVICE
    assert report["predicted_peak_bytes"] == step.get_plan(setup.x, setup.y).peak_bytes_after
