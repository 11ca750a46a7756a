"""``offload="optimizer"`` on the real-memory test bed: the Adam state on the host worker frees real
device memory, and a model whose weights and Adam state overflow a cap trains under it.

One process cannot show this (two logical CPUs share one allocator: ``DESIGN.md`` §2b); the
numerics and the graph's structure are checked there (``tests/integrations/test_offload.py``).
"""

import pytest

from tflms import testbed

from conftest import TESTS

pytestmark = pytest.mark.integration

#: The GPT of tflms.testing.zoo with 8 blocks (41.7 MB of weights; its plain Adam step measured
#: 179-181 MiB here, 2026-11-28, and 89-98 MiB with the optimizer offloaded; 178 MiB with the Adam
#: state on the host but its update left on the device) at batch 2, sequence 64.
KWARGS = {"layers": 8, "batch": 2, "seq": 64, "steps": 3}
CAP = "160MiB"
#: A measured peak is at least this share of the simulator's requested-bytes peak on any CPU: the
#: allocator's rounding and rests, which the prediction emulates, appear or not with the order the
#: CPU's threads allocate in (tests/testing/test_testbed.py, ``BELOW_REQUESTED``).
BELOW_REQUESTED = 0.9


@pytest.mark.measured
def test_gpt_whose_adam_state_overflows_the_cap_trains_with_the_optimizer_offloaded():
    jobs = [str(TESTS)]
    plain = testbed.run_measured("testbed_jobs:offload_gpt", KWARGS, cap=CAP, timeout=900, pythonpath=jobs)
    assert plain.status == "oom", (plain.status, plain.value, plain.error[-2000:])
    off = testbed.run_measured(
        "testbed_jobs:offload_gpt", {**KWARGS, "offload": True}, cap=CAP, timeout=900, pythonpath=jobs
    )
    assert off.ok, off.error
    reference = testbed.run_measured("testbed_jobs:offload_gpt", KWARGS, timeout=900, pythonpath=jobs)
    assert reference.ok, reference.error
    o, r = off.value, reference.value
    # The same losses as the plain step without a cap, bit for bit (same CPU kernels on both sides).
    assert o["losses"] == r["losses"]
    assert o["losses"][-1] < o["losses"][0]
    # The plain step needs more than the cap; the offloaded one about half of the plain step's peak
    # (measured 89-99 MiB against 180 MiB; per step 86-103 MiB, as the host pulls the gradients).
    assert r["peak"] > 160 * 2**20 > o["peak"]
    assert o["peak"] < 0.7 * r["peak"], (o["peaks"], r["peaks"])
    # Measured against predicted (1.08 when this was written; the simulator sends each gradient and
    # swap-out at once, which the test bed's shared cores do not). Requested: 0.91 of predicted.
    low, high = BELOW_REQUESTED * o["requested"], 1.25 * o["predicted"]
    assert low <= o["peak"] <= high, (o["peaks"], o["requested"], o["predicted"])


#: A GPT of 12 blocks (54.6 MB of weights, 13.6 M parameters) at batch 2, sequence 64, under a cap
#: that neither its plain step nor its step with the optimizer offloaded fits, and that its step
#: with the weights offloaded fits with room to spare: this fraction of the optimizer-offloaded
#: step's peak, measured uncapped in the same test. Measured here (2026-11-28, 2-CPU AMD EPYC, the
#: cap claimed in one region): uncapped, the plain step peaked at 221-223 MiB, the optimizer-offloaded
#: one at 108-111 MiB and the weights-offloaded one at 66-70 MiB (66 MiB predicted).
WEIGHTS_KWARGS = {"layers": 12, "batch": 2, "seq": 64, "steps": 3}
WEIGHTS_CAP_FRACTION = 0.85


@pytest.mark.measured
def test_gpt_that_overflows_the_cap_with_the_optimizer_offloaded_trains_with_the_weights_offloaded():
    jobs = [str(TESTS)]

    def run(offload, cap):
        kwargs = {**WEIGHTS_KWARGS, "offload": offload}
        return testbed.run_measured("testbed_jobs:offload_gpt", kwargs, cap=cap, timeout=900, pythonpath=jobs)

    reference, uncapped_optimizer = run(False, None), run("optimizer", None)
    assert reference.ok and uncapped_optimizer.ok, (reference.error, uncapped_optimizer.error)
    cap = int(WEIGHTS_CAP_FRACTION * min(uncapped_optimizer.value["peaks"])) // 2**20 * 2**20
    plain, optimizer, weights = run(False, cap), run("optimizer", cap), run("weights", cap)
    assert plain.status == "oom", (plain.status, plain.error[-2000:])
    assert optimizer.status == "oom", (optimizer.status, optimizer.error[-2000:])
    assert weights.ok, weights.error
    w, r = weights.value, reference.value
    # The same losses as the plain step without a cap, bit for bit.
    assert w["losses"] == r["losses"] and w["losses"][-1] < w["losses"][0]
    # The weights alone are more than half the cap; the step with them offloaded holds about a third of
    # the plain step's peak: activations, a few layers' weights and the gradients in flight.
    assert w["weight_bytes"] > 0.5 * cap > 0.5 * w["peak"]
    assert w["peak"] < 0.4 * r["peak"], (w["peaks"], r["peaks"])
    # Measured against predicted (1.00 at 8, 32 and 64 blocks when this was written). Requested: 0.96
    # of predicted.
    low, high = BELOW_REQUESTED * w["requested"], 1.15 * w["predicted"]
    assert low <= w["peak"] <= high, (w["peaks"], w["requested"], w["predicted"])
