"""Functions run inside a measured test-bed process by tests/test_testbed.py."""

from __future__ import annotations

from typing import Any


def decorated_step_reports_memory(model: str = "cnn", batch: int = 32) -> dict[str, Any]:
    """A model of tflms.measure.MODELS through ``@tflms.function`` with the test bed's device and host:
    losses of the plain and rewritten steps from the same state, and each one's
    measured peak next to the prediction (``LMSFunction.memory_report``)."""
    import tensorflow as tf

    import tflms
    from tflms import testbed
    from tflms.measure import build

    tf.config.experimental.enable_op_determinism()
    keras_model, x, y, step = build(model, batch)
    state = list(keras_model.variables) + list(step.optimizer.variables)
    initial = [v.numpy() for v in state]
    out: dict[str, Any] = {}
    plain = tf.function(step)
    lms = tflms.function(step, device=testbed.DEVICE, host=testbed.HOST)
    for name, fn in (("plain", plain), ("lms", lms)):
        for v, value in zip(state, initial):
            v.assign(value)
        if name == "lms":
            lms.get_plan(x, y)  # trace and rewrite before the measured steps
        losses = []
        testbed.reset_peak()
        with tf.device(testbed.DEVICE):
            for _ in range(2):
                losses.append(float(fn(x, y)))
        out[name] = {"losses": losses, "peak": testbed.memory()["peak"]}
    lms.reset_peak(x, y)
    with tf.device(testbed.DEVICE):
        lms(x, y)
    out["report"] = lms.memory_report(x, y)
    return out
