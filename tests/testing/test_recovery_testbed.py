"""Recovery from an out-of-memory step under a real cap, on the two-process test bed.

tests/integrations/test_recovery.py makes chosen calls fail on purpose, in one process. Here the
device's allocator refuses for real: the measured process's BFC allocator is capped
(``TF_CPU_BFC_MEM_LIMIT_IN_MB``) and its kernels are TensorFlow's own, which raise
``ResourceExhaustedError`` past the cap as a GPU does (oneDNN's conv backprop aborts the process
instead: tflms.testing.testbed.device_environ). A plan predicted within its budget runs out of
memory, its writes are undone, and the same batch runs again with a plan for less memory; the
weights end as an uncapped plain run's, bit for bit (the same kernels, one fresh process each:
TensorFlow's CPU kernels gave the same weights in two processes here, DESIGN.md §7).
"""

import numpy as np
import pytest

from tflms import testbed

from conftest import TESTS

pytestmark = pytest.mark.integration

MIB = 2**20


def _job(target: str, kwargs: dict, cap: str | None = None) -> dict:
    r = testbed.run_measured(f"testbed_jobs:{target}", kwargs, cap=cap, timeout=1800, pythonpath=[str(TESTS)])
    if cap is not None and r.status == "oom" and r.raised is None and r.oom is not None:
        # The allocator refused a request and the process died in the kernel that made it, with no
        # Python error to recover from: Eigen's CPU kernels do not all raise ResourceExhaustedError
        # as a GPU's do (measured 2026-11-28: 3 of 7 runs of the function path). Not a recovery failure.
        pytest.xfail(f"the measured process died in a kernel after the allocator's out-of-memory report: {r.oom}")
    assert r.ok, (r.status, r.raised, r.returncode, r.error[-3000:])
    return r.value


def _oom_replans(value: dict) -> list[dict]:
    """The replans made because a call ran out of memory (not those of a learned margin)."""
    return [r for r in value["replans"] if r["failed_peak"] is not None]


@pytest.mark.slow
@pytest.mark.measured
@pytest.mark.parametrize("path", ["function", "fit"])
def test_a_plan_over_the_real_cap_recovers_and_trains_to_the_uncapped_plain_weights(path):
    """ResNet50 96² batch 48, Adam, planned for 900 MiB, under a real 600 MiB cap (the weights and
    Adam's state hold 285 MiB of it): the first step runs out of memory, is undone and runs again
    with a plan for less memory; after 3 steps every weight and optimizer variable equals an
    uncapped plain run's (``tf.function`` of the same step, or plain ``fit``), bit for bit.

    Whether a plan fits is the allocator's call, and Eigen's convolution gradients take scratch
    the simulator does not model. Measured here (2026-11-28, 2-CPU AMD EPYC, the cap claimed in one
    region): ``tflms.function`` recovered and trained bit-identically (the plan for 900 MiB, 671 MiB
    predicted, ran out of memory; plans down to 455 MiB predicted trained at 517-545 MiB per step).
    ``fit`` (another graph: 690 MiB predicted first, 450 MiB the least any plan reaches) trained in
    1 of 3 processes (the 450 MiB plan at 522-559 MiB per step); in the others a plan that had
    trained one step ran out of memory on the next, and so did every plan after it and the plain
    step. So where the recovery ends in its error, what must hold is what it promises then: one
    error naming the ways tried, and every variable as it was before the
    failed call (xfail, not pass)."""
    cap = 600 * MIB
    lms = _job("resnet_steps", {"batch": 48, "mode": path, "budget": "900MiB"}, cap="600MiB")
    oom = _oom_replans(lms)
    assert oom, lms["replans"]
    first = oom[0]
    assert first["old_budget"] == 900 * MIB and first["failed_peak"] <= 900 * MIB, first
    # Each plan made after an out-of-memory error predicts less than the one that failed.
    assert all(b["failed_peak"] < a["failed_peak"] for a, b in zip(oom, oom[1:])), oom
    if "error" in lms:
        assert "ran out of device memory in every way tried" in lms["error"], lms["error"]
        # The plans the failing call tried (a call that recovered before may have made others), then the plain step.
        assert 1 <= lms["error"].count("a plan of") <= len(oom), (lms["error"], oom)
        assert "the plain step (predicted" in lms["error"], lms["error"]
        if not lms["losses"]:  # the first step failed: every variable as before it
            assert lms["state"] == lms["initial"]
        pytest.xfail(f"every plan ran out of memory under the cap in this process: {lms['error'][:600]}")
    plain = _job("resnet_steps", {"batch": 48, "mode": "plain" if path == "function" else "plain_fit"})
    assert lms["initial"] == plain["initial"]
    assert lms["plans"][-1]["predicted"] < oom[-1]["failed_peak"], (lms["plans"], oom)
    assert max(lms["peaks"]) <= cap, lms["peaks"]  # the allocator enforces it: the steps ran within it
    assert max(plain["peaks"]) > cap, plain["peaks"]  # the plain step needs more than the cap
    assert lms["losses"] == plain["losses"]
    assert lms["weights"] == plain["weights"]
    assert lms["state"] == plain["state"]  # the optimizer's variables too


@pytest.mark.slow
@pytest.mark.measured
def test_the_two_input_model_trains_with_lms_under_its_plain_steps_measured_peak():
    """The two-input model of issue 57 (a 128² image and a vector, its own ``train_step``, numpy
    data, batch 32), ``fit`` + ``LMSCallback`` given the test bed's device and host and nothing
    else, under a real cap of 1.02 x the plain step's measured peak (measured here, uncapped, in a
    process of its own): it trains, with its plan, a plan made after one ran out of memory, or the
    plain step (the recovery's last resort), within the cap."""
    plain = _job("twoinput_fit", {"lms": False})
    cap = int(1.02 * plain["peak"]) // MIB * MIB
    lms = _job("twoinput_fit", {"lms": True}, cap=f"{cap // MIB}MiB")
    assert len(lms["losses"]) == len(plain["losses"]) == 3
    assert np.all(np.isfinite(lms["losses"])), lms["losses"]
    # The same kernels on the same data: the losses follow the plain ones (tests/testing/test_testbed.py's tolerance).
    np.testing.assert_allclose(lms["losses"], plain["losses"], rtol=1e-3)
    assert max(lms["peaks"]) <= cap, (lms["peaks"], cap)
    assert lms["plans"], lms
