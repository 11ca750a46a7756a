"""The gpu tier: a rewritten step on a real GPU (``/GPU:0``, host ``/CPU:0``).

Skipped without a GPU; with ``TFLMS_TEST_GPU=1`` (``make test-gpu``) a missing GPU is a
failure instead (tests/conftest.py). The peak is the allocator's own
(``tf.config.experimental.get_memory_info``), not the simulator's.
"""

import numpy as np
import pytest
import tensorflow as tf

import tflms
from tflms import _tf_internal as tfi
from tflms.testing.zoo import build

pytestmark = pytest.mark.gpu

GPU = "/device:GPU:0"
HOST = "/device:CPU:0"


def _train(lms: bool, steps: int = 3):
    """Losses and the real peak (bytes above what was allocated before) of ``steps`` steps.

    The plain step runs with Grappler's layout optimizer off, as ``tflms.function`` runs the
    rewritten one (its argument ``layout_optimizer``): with it on, the GPU's convolutions run in
    another layout, with other kernels, and the losses compared could differ for that reason
    (on a CPU asked to convert, the two layouts gave other losses in a probe of 2026-11-27;
    tests/test_behaviour.py compares each way with its own plain step)."""
    model, x, y, train_step = build("cnn", batch=64, size=64, seed=0)  # the same initial state both times
    with tf.device(GPU), tfi.memory_optimization(None, layout_off=not lms):
        x, y = tf.identity(x), tf.identity(y)
        step = tflms.function(train_step, device=GPU, host=HOST) if lms else tf.function(train_step)
        step.get_concrete_function(x, y)  # trace (and rewrite) before measuring
        tf.config.experimental.reset_memory_stats("GPU:0")
        base = tf.config.experimental.get_memory_info("GPU:0")["current"]
        losses = [float(step(x, y)) for _ in range(steps)]
        peak = tf.config.experimental.get_memory_info("GPU:0")["peak"] - base
    plan = step.get_plan(x, y) if lms else None
    return np.array(losses), peak, plan


@pytest.mark.measured
def test_rewritten_step_on_the_gpu_trains_like_plain_with_a_lower_real_peak():
    plain_losses, plain_peak, _ = _train(lms=False)
    lms_losses, lms_peak, plan = _train(lms=True)
    assert plan.swaps and plan.peak_bytes_after < plan.peak_bytes_before
    # swapout_window='auto' fences the swap-outs on a GPU (see tflms.config.GPU_SWAPOUT_WINDOW).
    assert plan.options["swapout_window"] == tflms.config.GPU_SWAPOUT_WINDOW and plan.fences
    # Swapping moves tensors, it does not change them (op determinism is on: tests/conftest.py).
    np.testing.assert_allclose(lms_losses, plain_losses, rtol=1e-5)
    assert plain_losses[-1] < plain_losses[0]  # it trained
    assert lms_peak < plain_peak, (lms_peak, plain_peak, plan.summary())


@pytest.mark.measured
def test_demo_on_the_gpu_runs_the_plain_step_out_of_memory_and_trains_with_tflms():
    """``tflms demo`` on a GPU: the same three runs as on the test bed (tests/test_cli.py), with
    GPU 0's memory, measured by TensorFlow's GPU allocator and capped for real."""
    import re
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "tflms", "demo", "--steps", "2"], capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    out = r.stdout
    assert "demo on GPU 0" in out and "ResNet50 96x96, batch 32" in out, out
    plain = re.search(r"1\. plain step, no cap: +measured peak ([\d,]+) MiB", out)
    cap = re.search(r"real memory cap for the next runs: ([\d,]+) MiB; tflms budget: ([\d,]+) MiB", out)
    assert plain and cap, out
    assert re.search(r"2\. plain step, capped: +OUT OF MEMORY", out), out
    lms = re.search(r"3\. tflms step, capped: +TRAINED, measured peak ([\d,]+) MiB", out)
    assert lms, out
    measured_plain, cap_mib, budget, measured_lms = (
        int(m.replace(",", "")) for m in (plain.group(1), *cap.groups(), lms.group(1))
    )
    assert measured_lms <= cap_mib < measured_plain, out
    assert measured_lms <= 1.10 * budget, out
