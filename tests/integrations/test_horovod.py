"""tflms.integrations.horovod: real ``horovodrun --gloo -np 2`` jobs on the CPU.

The workers live in tests/horovod_jobs/. These tests skip only when Horovod is
not installed *and* the environment variable ``CI`` is unset; in CI a missing
Horovod fails them (build it with ``python -m tflms.tools.build_horovod``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tflms
import tflms.integrations.horovod as lms_hvd

from conftest import REPO, TESTS

pytestmark = pytest.mark.distributed

JOBS = TESTS / "horovod_jobs"
BIN = Path(sys.executable).parent
HOROVODRUN = BIN / "horovodrun"
TIMEOUT_S = 150
STEPS = 3

sys.path.insert(0, str(JOBS))
import jobkit  # noqa: E402


def _horovod_missing() -> str | None:
    try:
        found = importlib.util.find_spec("horovod") is not None and importlib.util.find_spec("horovod.tensorflow")
    except Exception as err:  # noqa: BLE001 - a broken install counts as missing
        return f"horovod is broken ({err!r})"
    if not found:
        return "horovod.tensorflow is not importable"
    if not HOROVODRUN.exists():
        return f"{HOROVODRUN} does not exist"
    return None


@pytest.fixture(scope="module")
def horovod_available() -> None:
    missing = _horovod_missing()
    if missing is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI is set but {missing}: build it with `python -m tflms.tools.build_horovod`.", pytrace=False)
    pytest.skip(f"{missing} (and CI is not set); build it with `python -m tflms.tools.build_horovod`")


def horovodrun(script: Path, *args: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """``horovodrun --gloo -np 2 -H localhost:2 python script args``; killed (whole group) after ``timeout``."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.pop("HOROVOD_RANK", None)
    cmd = [str(HOROVODRUN), "--gloo", "-np", "2", "-H", "localhost:2", sys.executable, str(script), *args]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"horovodrun did not finish within {timeout} s (hang). Output tail:\n{out[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def _load(path: Path) -> list[np.ndarray]:
    with np.load(path) as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]


@pytest.fixture(scope="module")
def job(horovod_available, tmp_path_factory):
    """One 2-rank run of horovod_jobs/train_job.py: its out dir and both rank reports."""
    out = tmp_path_factory.mktemp("horovod_train")
    run = horovodrun(JOBS / "train_job.py", "--out", str(out), "--steps", str(STEPS))
    assert run.returncode == 0, run.stdout[-6000:]
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return out, reports


KINDS = ("tflms", "grouped", "workaround", "offload", "placed")


@pytest.fixture(scope="module")
def reference(job):
    """Single process (this one), plain tf.function, on the concatenated 2-rank batch."""
    out, _ = job
    initial = _load(out / "initial.npz")
    batches = jobkit.global_batches(STEPS, 2)
    losses, state = jobkit.reference_run(initial, batches)
    return initial, batches, losses, state


@pytest.mark.parametrize("kind", KINDS)
def test_ranks_end_identical_and_match_single_process(job, reference, kind):
    out, reports = job
    initial, batches, ref_losses, ref_state = reference
    rank0, rank1 = _load(out / f"{kind}_rank0.npz"), _load(out / f"{kind}_rank1.npz")
    assert len(rank0) == len(rank1) == len(ref_state) == len(initial)
    for a, b in zip(rank0, rank1):
        np.testing.assert_array_equal(a, b)  # the same averaged update, bit for bit
    for got, want in zip(rank0, ref_state):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # The comparison can fail: training moved the weights far beyond the tolerance ...
    moved = max(float(np.max(np.abs(g - i))) for g, i in zip(rank0, initial) if g.dtype.kind == "f")
    assert moved > 1e-2
    # ... and training on rank 0's half of each batch alone lands elsewhere.
    _, alone = jobkit.reference_run(
        initial, [(x[: jobkit.PER_RANK_BATCH], y[: jobkit.PER_RANK_BATCH]) for x, y in batches]
    )
    assert max(float(np.max(np.abs(g - a))) for g, a in zip(rank0, alone) if g.dtype.kind == "f") > 1e-3
    # Each rank's loss is on its half; their mean is the single-process loss.
    mean = np.mean([r[kind]["losses"] for r in reports], axis=0)
    np.testing.assert_allclose(mean, ref_losses, rtol=1e-6)


def test_offload_averages_gradients_on_the_host(job):
    """``offload="optimizer"``: the allreduce runs on the host, beside the update (the ranks' numbers: above)."""
    _, reports = job
    for r in reports:
        structure = r["offload"]["structure"]
        assert structure["horovod_ops"] and structure["horovod_devices"] == [jobkit.HOST]
        assert r["tflms"]["structure"]["horovod_devices"] != [jobkit.HOST]  # without it, on the device


def test_each_rank_places_its_step_on_its_own_two_devices(job):
    """``devices=``: every rank runs its step across its two devices (the ranks' numbers: above), and
    trains the same bits as the one-device step."""
    out, reports = job
    for r in reports:
        devices = r["placed"]["structure"]["op_devices"]
        assert set(jobkit.PLACED) <= set(devices) and jobkit.HOST not in devices
    for a, b in zip(_load(out / "placed_rank0.npz"), _load(out / "tflms_rank0.npz")):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", ["grouped", "workaround"])
def test_every_tape_gives_the_same_update(job, kind):
    out, _ = job
    for a, b in zip(_load(out / "tflms_rank0.npz"), _load(out / f"{kind}_rank0.npz")):
        np.testing.assert_array_equal(a, b)


def test_broadcast_of_keras_variables(job):
    _, (r0, r1) = job
    # Rank 1 built its model from another seed; the broadcast gave it rank 0's state.
    assert r0["digest_before_broadcast"] != r1["digest_before_broadcast"]
    assert r0["digest_after_broadcast"] == r1["digest_after_broadcast"] == r0["digest_before_broadcast"]


@pytest.mark.parametrize("kind", KINDS)
def test_plan_is_identical_on_every_rank(job, kind):
    _, (r0, r1) = job
    assert r0[kind]["plan_json_sha256"] == r1[kind]["plan_json_sha256"]
    assert r0[kind]["fingerprint"] == r1[kind]["fingerprint"]
    assert r0[kind]["structure"] == r1[kind]["structure"]
    if kind == "placed":  # a placement swaps nothing (test_each_rank_places_its_step_on_its_own_two_devices)
        assert r0[kind]["n_swaps"] == r0[kind]["structure"]["n_swap_out"] == 0
        return
    assert r0[kind]["n_swaps"] >= 3 and r0[kind]["n_swap_ins"] >= 3
    # The rewritten graphs hold exactly the planned swap ops on both ranks.
    assert r0[kind]["structure"]["n_swap_out"] == r0[kind]["n_swaps"]
    assert r0[kind]["structure"]["n_swap_in"] == r0[kind]["n_swap_ins"]
    # Each rank's device was given explicitly (/device:CPU:1): its swap ops sit on the default host.
    assert r0[kind]["structure"]["swap_out_devices"] == r0[kind]["structure"]["swap_in_devices"] == ["/device:CPU:0"]


def test_plan_mismatch_raises_on_every_rank(job):
    _, (r0, r1) = job
    for rank, report in enumerate((r0, r1)):
        message = report["mismatch_error"]
        assert message is not None, f"rank {rank} did not detect differing plans"
        assert "plans differ across Horovod ranks" in message and f"on rank {rank}" in message


def test_collectives_are_never_swapped_nor_triggers(job):
    _, reports = job
    for report in reports:
        # Gradient averaging in the training steps: Horovod ops at the top level
        # (tflms tape) or inside the StatelessIf bodies (Horovod's own tape).
        tflms_step, workaround_step = report["tflms"]["structure"], report["workaround"]["structure"]
        grouped_step = report["grouped"]["structure"]
        assert tflms_step["horovod_ops"] == ["HorovodGroupedAllreduce"]  # 8 MiB groups: one for this CNN
        # 1 KiB groups over 10 gradients, from the last: only conv1's kernel (864 B) and bias (32 B) share one.
        assert grouped_step["horovod_ops"] == ["HorovodGroupedAllreduce"] * 9
        assert workaround_step["horovod_ops"] == [] and workaround_step["control_flow_ops"]
        c = report["collective"]
        # A step with a Horovod allreduce in the forward pass and its gradient allreduce in the backward pass.
        assert c["horovod_phases"].count("forward") == 1 and c["horovod_phases"].count("backward") == 1
        # Without the exclusion the planner would swap the collective's output and trigger on one ...
        assert "HorovodAllreduce" in c["unguarded_producer_types"]
        assert "HorovodAllreduce" in c["unguarded_trigger_types"]
        # ... with it, neither the plan nor the rewritten graph does, yet the rest is swapped.
        for structure in (c["structure"], tflms_step, grouped_step, workaround_step):
            assert structure["n_swap_out"] >= 3
            assert not [t for t in structure["swap_out_input_types"] if t.startswith("Horovod")]
            assert not [t for t in structure["swap_in_trigger_types"] if t.startswith("Horovod")]
        assert not [t for t in c["plan_producer_types"] + c["plan_trigger_types"] if t.startswith("Horovod")]
        assert c["n_swaps"] == c["structure"]["n_swap_out"]
        assert all(np.isfinite(c["losses"]))


def test_rank_helpers_and_average_logs(job):
    _, reports = job
    for r, report in enumerate(reports):
        assert (report["rank"], report["size"], report["local_rank"], report["local_size"]) == (r, 2, r, 2)
        assert report["is_root"] is (r == 0)
        # loss: (1 + 2) / 2; acc: (0 + 0.25) / 2; t (a 0-d tensor): (0 + 2) / 2; strings untouched.
        assert report["average_logs"] == {"loss": 1.5, "acc": 0.125, "t": 1.0, "tag": "x"}


@pytest.mark.parametrize("mode", ["raise", "exit"])
def test_a_crashing_rank_fails_the_job_without_hanging(horovod_available, tmp_path, mode):
    run = horovodrun(
        JOBS / "train_job.py",
        *("--out", str(tmp_path), "--steps", "4", "--kinds", "tflms", "--no-extras"),
        *("--crash-rank", "1", "--crash-step", "2", "--crash-mode", mode),
        timeout=120,
    )
    assert run.returncode != 0
    assert "[1]<stderr>:" in run.stdout
    marker = "tflms-test: rank 1 fails on purpose at step 2"
    assert marker in run.stdout, run.stdout[-4000:]
    if mode == "raise":
        assert f"RuntimeError: {marker}" in run.stdout
    # Rank 0 stopped in the collective of step 2 instead of finishing.
    assert not (tmp_path / "rank0.json").exists() and not (tmp_path / "tflms_rank0.npz").exists()


def test_benchmark_script_prints_throughput_on_rank_0_only(horovod_available, tmp_path):
    out = tmp_path / "bench.json"
    run = horovodrun(
        REPO / "benchmarks" / "horovod_train.py",
        *("--model", "MobileNetV3Small", "--image-size", "32", "--batch", "2", "--steps", "2"),
        *("--swapout-threshold", "5", "--swapin-ahead", "2", "--min-bytes", "4096", "--json", str(out)),
    )
    assert run.returncode == 0, run.stdout[-6000:]
    lines = run.stdout.splitlines()
    throughput = [line for line in lines if "images/s" in line]
    assert throughput and all(line.startswith("[0]<stdout>:") for line in throughput), throughput
    assert any("throughput rank 0:" in line for line in throughput)
    assert any("throughput rank 1:" in line for line in throughput)
    assert any("throughput total:" in line for line in throughput)
    result = json.loads(out.read_text())
    assert result["ranks"] == 2 and len(result["images_per_s_per_rank"]) == 2
    assert all(v > 0 for v in result["images_per_s_per_rank"])
    assert result["images_per_s_total"] == pytest.approx(sum(result["images_per_s_per_rank"]))
    lms = result["lms"]
    assert lms["device"] == "/device:CPU:1" and lms["swaps"] > 0
    assert lms["options"]["swapout_threshold"] == 5 and lms["options"]["swapin_ahead"] == 2
    assert len(result["losses_rank0"]) == 3 and all(np.isfinite(result["losses_rank0"]))


# ------------------------------------------ a GPT with an Embedding, CPU split by init
EMBEDDING_CASES = ("fit_dense", "fit_sparse", "loop_dense", "loop_sparse")


@pytest.fixture(scope="module")
def embedding_job(horovod_available, tmp_path_factory):
    """One 2-rank run of horovod_jobs/embedding_job.py: its out dir and both rank reports."""
    out = tmp_path_factory.mktemp("horovod_embedding")
    run = horovodrun(JOBS / "embedding_job.py", "--out", str(out), timeout=300)
    assert run.returncode == 0, run.stdout[-6000:]
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("case", EMBEDDING_CASES)
def test_embedding_gradients_are_averaged(embedding_job, case):
    """fit with HorovodLMSCallback and a custom loop with DistributedGradientTape, sparse gradients
    densified (default) or allgathered: both ranks end equal to one process on the whole batches."""
    import embedding_job as ej

    out, reports = embedding_job
    for report in reports:
        # The case that broke hvd.grouped_allreduce: the Embedding's IndexedSlices after a dense gradient.
        kinds = report["gradient_kinds"]
        assert kinds[:2] == ["dense", "sparse"] and kinds.count("sparse") == 1
        assert report["tflms_file"] == str(REPO / "tflms" / "__init__.py")  # the ranks ran this checkout
        assert report[case]["warnings"] == []
    initial = _load(out / f"{case}_initial.npz")
    rank0, rank1 = _load(out / f"{case}_rank0.npz"), _load(out / f"{case}_rank1.npz")
    assert len(rank0) == len(rank1) == len(initial)
    for a, b in zip(rank0, rank1):
        np.testing.assert_array_equal(a, b)  # the same averaged update, bit for bit
    batches = ej.global_batches(2)
    with tf.device("/device:CPU:1"):
        want = ej.reference_run(initial, batches)
    for got, w in zip(rank0, want, strict=True):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
    # The comparison can fail: training moved the weights (the token embedding's too) far beyond
    # the tolerance, and rank 0's half of each batch alone lands elsewhere.
    moved = [float(np.max(np.abs(g - i))) for g, i in zip(rank0, initial) if g.dtype.kind == "f"]
    assert min(moved[1], max(moved)) > 1e-2  # index 1: the token embedding
    with tf.device("/device:CPU:1"):
        alone = ej.reference_run(initial, [ej.shard(b, 0) for b in batches])
    assert max(float(np.max(np.abs(g - a))) for g, a in zip(rank0, alone) if g.dtype.kind == "f") > 1e-3
    # Dense: one grouped allreduce; sparse: the dense gradients' allreduce and the allgathers of the rows.
    ops = reports[0][case]["structure"]["horovod_ops"]
    assert ops == reports[1][case]["structure"]["horovod_ops"]
    if case.endswith("dense"):
        assert ops == ["HorovodGroupedAllreduce"]
    else:
        assert "HorovodGroupedAllreduce" in ops and len([t for t in ops if "Allgather" in t]) == 2, ops


@pytest.mark.parametrize("case", EMBEDDING_CASES)
def test_split_cpu_ranks_swap_to_the_host(embedding_job, case):
    """init(split_cpu=True) and no device: each rank swaps from /device:CPU:1 to /device:CPU:0."""
    _, (r0, r1) = embedding_job
    for report in (r0, r1):
        assert [n.rsplit("/", 1)[-1] for n in report["logical_devices"]] == ["device:CPU:0", "device:CPU:1"]
        assert report["resolved_device"] == report[case]["rewrite_device"] == "/device:CPU:1"
        plan, structure = report[case]["plan"], report[case]["structure"]
        assert plan["n_swaps"] >= 10 and plan["device"] is None and plan["host"] == "/device:CPU:0"
        assert structure["n_swap_out"] == plan["n_swaps"] and structure["n_swap_in"] >= plan["n_swaps"]
        assert structure["swap_out_devices"] == structure["swap_in_devices"] == ["/device:CPU:0"]
        assert not [w for w in report[case]["warnings"] if "no GPU found" in w]
    assert r0[case]["plan"]["fingerprint"] == r1[case]["plan"]["fingerprint"] == r0[case]["plan"]["plan_fingerprint"]


# --------------------------------------------------------- without horovodrun
def test_gradient_groups_are_cut_from_the_last_gradient():
    from tflms.integrations.horovod.gradients import _split_groups

    grads = [tf.zeros((n,)) for n in (10, 10, 300, 10, 10)]  # 40, 40, 1200, 40, 40 bytes
    assert _split_groups([0, 1, 2, 3, 4], grads, None) == [[0, 1, 2, 3, 4]]
    assert _split_groups([0, 1, 2, 3, 4], grads, 80) == [[3, 4], [2], [0, 1]]
    assert _split_groups([0, 1, 2, 3, 4], grads, 1280) == [[2, 3, 4], [0, 1]]
    assert _split_groups([0, 1, 3], grads, 1) == [[3], [1], [0]]
    with pytest.raises(ValueError, match="group_bytes=0"):
        lms_hvd.allreduce_gradients(grads, group_bytes=0)


class _RecordingHorovod:
    """Stands in for an initialised 2-rank ``horovod.tensorflow``: records the groups it is asked to reduce."""

    Average, Sum = "Average", "Sum"

    def __init__(self):
        self.groups = []

    def is_initialized(self):
        return True

    def size(self):
        return 2

    def grouped_allreduce(self, tensors, name=None, op=None):
        self.groups.append(["sparse" if isinstance(t, tf.IndexedSlices) else "dense" for t in tensors])
        return list(tensors)


def test_sparse_gradients_are_densified_or_grouped_alone(monkeypatch):
    """An Embedding's IndexedSlices gradient after a dense one: densified by default; with
    sparse_as_dense=False in a group of its own (hvd.grouped_allreduce mislabels a mixed group)."""
    keras.utils.set_random_seed(0)
    dense, embedding = keras.layers.Dense(4), keras.layers.Embedding(10, 4)
    dense.build((None, 4))
    embedding.build((None, 3))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(dense(embedding(tf.constant([[1, 2, 2]]))) ** 2)
    variables = [dense.kernel, embedding.embeddings, dense.bias]
    grads = tape.gradient(loss, variables)
    assert [type(g).__name__ for g in grads] == ["EagerTensor", "IndexedSlices", "EagerTensor"]
    fake = _RecordingHorovod()
    monkeypatch.delenv("HOROVOD_RANK", raising=False)
    monkeypatch.setitem(sys.modules, "horovod.tensorflow", fake)
    averaged = lms_hvd.allreduce_gradients(grads)
    assert fake.groups == [["dense", "dense", "dense"]]
    np.testing.assert_array_equal(averaged[1].numpy(), tf.convert_to_tensor(grads[1]).numpy())
    fake.groups.clear()
    averaged = lms_hvd.allreduce_gradients(grads, sparse_as_dense=False)
    assert fake.groups == [["dense", "dense"], ["sparse"]] and averaged[1] is grads[1]
    fake.groups.clear()
    tape = lms_hvd.DistributedGradientTape(persistent=True)
    with tape:
        loss = tf.reduce_sum(dense(embedding(tf.constant([[1, 2, 2]]))) ** 2)
    tape.gradient(loss, variables)
    tape = lms_hvd.DistributedGradientTape(tape.tape, sparse_as_dense=False)
    tape.gradient(loss, variables)
    assert fake.groups == [["dense", "dense", "dense"], ["dense", "dense"], ["sparse"]]


def test_bad_sparse_as_dense_and_split_cpu(monkeypatch):
    monkeypatch.delenv("HOROVOD_RANK", raising=False)
    with pytest.raises(TypeError, match="Received: sparse_as_dense='no'"):
        lms_hvd.allreduce_gradients([tf.ones(2)], sparse_as_dense="no")
    with pytest.raises(TypeError, match="Received: sparse_as_dense=None"):
        lms_hvd.DistributedGradientTape(sparse_as_dense=None)
    with pytest.raises(TypeError, match="Received: sparse_as_dense=1"):
        lms_hvd.HorovodLMSCallback(sparse_as_dense=1)
    with pytest.raises(TypeError, match="Received: sparse_as_dense='x'"):
        tflms.LMSCallback(horovod=True, sparse_as_dense="x")
    with pytest.raises(ValueError, match="Received: sparse_as_dense=False with train_step="):
        lms_hvd.HorovodLMSCallback(sparse_as_dense=False, train_step=lms_hvd.averaging_train_step)
    assert lms_hvd.HorovodLMSCallback().sparse_as_dense is True
    assert lms_hvd.HorovodLMSCallback(sparse_as_dense=False).sparse_as_dense is False
    with pytest.raises(TypeError, match="Received: split_cpu='yes'"):
        lms_hvd.init(split_cpu="yes")
    # One process without Horovod: a split CPU is no reason to swap by default (device=None: no device).
    assert lms_hvd.runtime.split_cpu_device() is None and tflms.resolve_device(tflms.LMSConfig()) is None


def _python_without_horovod(code: str) -> subprocess.CompletedProcess:
    """``python -c code`` in a process of its own, the repository importable and no ``HOROVOD_``
    variable set: a plain process, not a rank."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_split_cpu_after_tensorflow_started_is_refused():
    code = (
        "import tensorflow as tf; tf.constant(1.0); import tflms.horovod as h\n"
        "try:\n    h.init(split_cpu=True)\nexcept RuntimeError as e:\n    print(e)\n"
    )
    run = _python_without_horovod(code)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "init(split_cpu=True) must run before TensorFlow initialises its devices" in run.stdout
    assert "Received: split_cpu=True with the devices already initialised (/device:CPU:0)" in run.stdout


def test_importing_tflms_does_not_import_horovod():
    code = (
        "import sys, tflms, tflms.integrations.horovod as h; "
        "assert not [m for m in sys.modules if m.split('.')[0] == 'horovod'], 'horovod imported'; "
        "assert (h.rank(), h.size(), h.local_rank(), h.is_root(), h.is_initialized()) == (0, 1, 0, True, False); "
        "assert not [m for m in sys.modules if m.split('.')[0] == 'horovod'], 'horovod imported by helpers'"
    )
    run = _python_without_horovod(code)
    assert run.returncode == 0, run.stderr[-3000:]


def test_public_names_of_the_package():
    """Every public name is importable from tflms.integrations.horovod (the callback's on first use, with Keras)."""
    import tflms.integrations.horovod.callback
    import tflms.integrations.keras

    for name in lms_hvd.__all__:
        assert getattr(lms_hvd, name) is not None, name
    assert set(lms_hvd.__all__) <= set(dir(lms_hvd))
    assert issubclass(lms_hvd.HorovodLMSCallback, tflms.integrations.keras.LMSCallback)
    assert lms_hvd.HorovodLMSCallback is tflms.integrations.horovod.callback.HorovodLMSCallback
    assert issubclass(lms_hvd.PlanMismatchError, RuntimeError)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = lms_hvd.nope


class _FakeHorovod:
    """Stands in for ``horovod.tensorflow`` in sys.modules (rank 1 of 3, or a broken one)."""

    def __init__(self, initialized):
        self._initialized = initialized

    def is_initialized(self):
        if isinstance(self._initialized, Exception):
            raise self._initialized
        return self._initialized

    def rank(self):
        return 1

    def size(self):
        return 3

    local_rank, local_size = rank, size


def test_horovod_is_detected_in_one_place(monkeypatch):
    """``runtime.loaded`` decides whether Horovod runs here: imported *and* initialised; never imports it."""
    from tflms.integrations.horovod import runtime

    monkeypatch.delenv("HOROVOD_RANK", raising=False)
    monkeypatch.setitem(sys.modules, "horovod.tensorflow", _FakeHorovod(True))
    assert runtime.loaded() is sys.modules["horovod.tensorflow"] and lms_hvd.is_initialized()
    ranks = (lms_hvd.rank(), lms_hvd.size(), lms_hvd.local_rank(), lms_hvd.local_size(), lms_hvd.is_root())
    assert ranks == (1, 3, 1, 3, False)
    for state in (False, RuntimeError("half loaded")):  # not initialised, or a library that cannot say
        monkeypatch.setitem(sys.modules, "horovod.tensorflow", _FakeHorovod(state))
        assert runtime.loaded() is None and not lms_hvd.is_initialized()
        assert (lms_hvd.rank(), lms_hvd.size(), lms_hvd.is_root()) == (0, 1, True)
        monkeypatch.setenv("HOROVOD_RANK", "0")  # ... but under horovodrun that is an error
        with pytest.raises(
            RuntimeError, match=r"tflms.integrations.horovod.size\(\): this process was started by horovodrun"
        ):
            lms_hvd.size()
        monkeypatch.delenv("HOROVOD_RANK")


def test_single_process_fallbacks_and_errors(monkeypatch):
    if lms_hvd.is_initialized():
        pytest.skip("Horovod is initialised in this process")
    monkeypatch.delenv("HOROVOD_RANK", raising=False)
    keras.utils.set_random_seed(0)
    layer = keras.layers.Dense(3)
    layer.build((None, 4))
    kernel = layer.kernel
    assert isinstance(lms_hvd.backing_variable(kernel), tf.Variable)
    assert lms_hvd.backing_variable(kernel) is kernel.value
    plain = tf.Variable(1.0)
    assert lms_hvd.backing_variable(plain) is plain
    with pytest.raises(TypeError, match="Received: variable="):
        lms_hvd.backing_variable(np.ones(3))
    # One process: the tape returns plain gradients in the structure of the sources.
    x = tf.ones((2, 4))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(x) ** 2)
    grads = lms_hvd.DistributedGradientTape(tape, persistent=False).gradient(loss, {"k": kernel, "b": [layer.bias]})
    with tf.GradientTape() as ref_tape:
        ref_loss = tf.reduce_sum(layer(x) ** 2)
    want = ref_tape.gradient(ref_loss, [kernel, layer.bias])
    assert set(grads) == {"k", "b"} and isinstance(grads["b"], list)
    np.testing.assert_array_equal(grads["k"].numpy(), want[0].numpy())
    np.testing.assert_array_equal(grads["b"][0].numpy(), want[1].numpy())
    assert lms_hvd.allreduce_gradients([None, want[0]])[0] is None
    assert lms_hvd.average_logs({"loss": np.float32(2.5), "name": "a"}) == {"loss": 2.5, "name": "a"}
    assert lms_hvd.allgather_scalar(3) == [3.0]
    assert lms_hvd.broadcast_variables([kernel, layer.bias]) is None
    with pytest.raises(ValueError, match="root_rank=1"):
        lms_hvd.broadcast_variables([kernel], root_rank=1)
    with pytest.raises(ValueError, match="op='max'"):
        lms_hvd.allreduce_gradients([want[0]], op="max")
    with pytest.raises(TypeError, match="Received: plan="):
        lms_hvd.assert_same_plan("not a plan")
    # Started by horovodrun but never initialised: refuse instead of acting alone.
    monkeypatch.setenv("HOROVOD_RANK", "1")
    for call in (lms_hvd.rank, lms_hvd.is_root, lambda: lms_hvd.allreduce_gradients([want[0]])):
        with pytest.raises(RuntimeError, match=r"tflms.integrations.horovod.init\(\)"):
            call()
