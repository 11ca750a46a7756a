"""One run of the two-device test bed (``tests/testing/test_placement_testbed.py``), in a measured
process started with ``tflms.testbed.device_environ(cap)``: this process's CPU is device 0 and a
:class:`tflms.testing.device_worker.DeviceWorker` (the same cap) device 1.

``python tests/placement_testbed_job.py MODE BATCH CAP_MIB`` with MODE ``plain`` (the step on device
0 alone) or ``placed`` (``devices=[device 0, device 1]``); CAP_MIB 0 for no cap. Prints ``RESULT``
and a JSON object: the losses of 3 Adam steps of the zoo's CNN (64 px) and, per step after the
first, the measured peak of each device (bytes, each read from its own allocator), and the plan's
predicted peaks. An out-of-memory in either process ends the run without a ``RESULT`` line, or with
``status: "oom"`` where TensorFlow raised it.
"""

from __future__ import annotations

import json
import sys

import tensorflow as tf

import tflms
from tflms.testing import testbed
from tflms.testing.device_worker import DeviceWorker
from tflms.testing.zoo import build

STEPS = 3


def main(mode: str, batch: int, cap_mib: int) -> dict:
    tf.config.experimental.enable_op_determinism()
    cap = f"{cap_mib}MiB" if cap_mib else None
    out: dict = {"mode": mode, "batch": batch, "cap_mib": cap_mib, "losses": [], "peaks": []}
    with DeviceWorker(cap=cap) as dev1:
        dev1.connect()
        devices = [testbed.DEVICE, dev1.device]
        with tf.device(testbed.DEVICE):
            model, x, y, step = build("cnn", batch=batch, size=64)
        if mode == "plain":
            fn = tf.function(step)
        else:
            fn = tflms.function(step, devices=devices, host=testbed.HOST)
            plan = fn.get_plan(x, y)
            out["predicted"] = [st.peak_bytes for st in plan.placement]
            out["predicted_plain"] = plan.peak_bytes_before
        try:
            for _ in range(STEPS):
                testbed.reset_peak()
                dev1.reset_peak()
                with tf.device(testbed.DEVICE):
                    loss = fn(x, y)
                out["losses"].append(float(loss.numpy()))
                out["peaks"].append([testbed.memory()["peak"], dev1.peak()])
        except tf.errors.ResourceExhaustedError as err:
            out["status"] = "oom"
            out["error"] = str(err)[:300]
            return out
        out["status"] = "ok" if dev1.alive else "worker died"
    return out


if __name__ == "__main__":
    result = main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    print("RESULT " + json.dumps(result), flush=True)
