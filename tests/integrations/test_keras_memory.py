"""LMSCallback's measured device peak, next to the predicted one, in the epoch logs.

The measurement needs an allocator that reports its memory: a GPU, or a CPU in a
process started with ``TF_CPU_ALLOCATOR_USE_BFC=true`` (a subprocess here). The two
logical CPUs of that process share one allocator, so only the presence and
plausibility of the numbers can be checked, not what swapping saves.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import tensorflow as tf

from tflms.integrations.keras import MEASURED_PEAK_KEY, PREDICTED_PEAK_KEY, LMSCallback

import zoo
from conftest import DEVICE, SMALL

pytestmark = pytest.mark.integration

HOG_BYTES = 64 * 2**20

SCRIPT = textwrap.dedent(
    f"""
    import json

    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

    import keras
    import numpy as np

    import tflms

    keras.utils.set_random_seed(0)
    L = keras.layers
    model = keras.Sequential([keras.Input((64,))] + [L.Dense(512, activation="relu") for _ in range(4)] + [L.Dense(10)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 64)).astype("float32")
    y = rng.integers(0, 10, size=(256,))


    class Hog(keras.callbacks.Callback):
        # After the LMSCallback (which resets the statistics): {HOG_BYTES} bytes on the device in epoch 0 only.
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 0:
                with tf.device("/device:CPU:1"):
                    t = tf.ones(({HOG_BYTES} // 4,), tf.float32)
                float(tf.reduce_sum(t))
                del t


    lms = tflms.LMSCallback(
        device="/device:CPU:1", host="/device:CPU:0", knobs=tflms.Knobs(swapout_threshold=2, min_bytes=4096),
        verbose=1,
    )
    history = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0, callbacks=[lms, Hog()])
    print("RESULT " + json.dumps({{
        "history": history.history,
        "peak_before": lms.plan.peak_bytes_before,
        "peak_after": lms.plan.peak_bytes_after,
        "swaps": len(lms.plan.swaps),
    }}))
    """
)


def _run(env_extra):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **env_extra}
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :]), r.stdout


@pytest.mark.slow
@pytest.mark.measured
def test_measured_and_predicted_peaks_are_epoch_logs_with_the_bfc_allocator():
    result, out = _run({"TF_CPU_ALLOCATOR_USE_BFC": "true"})
    history = result["history"]
    assert result["swaps"] >= 1
    # The predicted entry is the plan's predicted peak, every epoch.
    assert history[PREDICTED_PEAK_KEY] == [result["peak_after"]] * 2
    measured = history[MEASURED_PEAK_KEY]
    assert len(measured) == 2 and all(m > 0 for m in measured)
    # Epoch 0 saw the 64 MiB tensor allocated after the reset; epoch 1 (reset again) did not.
    assert measured[0] >= HOG_BYTES > measured[1]
    # Plausible: within a factor of 2 of the prediction (measured 16.7 MB vs 17.3 MB predicted when written).
    assert 0.5 * result["peak_after"] < measured[1] < 2 * result["peak_before"]
    # verbose=1 shows the measured peak of the first step next to the prediction, in two lines.
    assert "measured peak of the first step:" in out and "predicted device peak (simulator):" in out


@pytest.mark.slow
@pytest.mark.measured
def test_no_measured_entry_without_the_bfc_allocator_on_cpu():
    result, out = _run({"TF_CPU_ALLOCATOR_USE_BFC": ""})
    assert set(result["history"]) == {"loss"}
    assert "predicted device peak (simulator):" in out and "measured peak" not in out


def _fit_with_allocator(monkeypatch, get_memory_info, reset_memory_stats):
    """(history, callback) of 2 epochs of ``LMSCallback`` on zoo's MLP, the BFC allocator asked for
    and TensorFlow's ``get_memory_info`` and ``reset_memory_stats`` replaced by the two given."""
    setup = zoo.mlp()
    setup.model.compile(optimizer=setup.optimizer, loss=setup.loss, jit_compile=False)
    x, y = setup.x.numpy(), setup.y.numpy()
    monkeypatch.setenv("TF_CPU_ALLOCATOR_USE_BFC", "true")
    monkeypatch.setattr(tf.config.experimental, "get_memory_info", get_memory_info)
    monkeypatch.setattr(tf.config.experimental, "reset_memory_stats", reset_memory_stats)
    cb = LMSCallback(device=DEVICE, **SMALL)
    with tf.device(DEVICE):
        history = setup.model.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False, callbacks=[cb])
    return history, cb


@pytest.mark.measured
def test_a_device_that_cannot_report_memory_adds_nothing_and_does_not_fail(monkeypatch):
    def refuse(device):
        raise ValueError(f"memory info is not supported for {device}")

    history, cb = _fit_with_allocator(monkeypatch, refuse, refuse)
    assert set(history.history) == {"loss"} and len(cb.plan.swaps) >= 1


@pytest.mark.measured
def test_entries_come_from_the_allocator_and_the_plan(monkeypatch):
    """In-process, with the allocator's answers replaced: the logs carry exactly those numbers."""
    reads, resets = [], []

    def memory_info(device):
        reads.append(device)
        return {"current": 1, "peak": 1000 * len(reads)}

    history, cb = _fit_with_allocator(monkeypatch, memory_info, resets.append)
    # A reset at each epoch begin, and one before each call of the step on probation (its first 5
    # calls: all 4 here), which reads the peak before it and after the call; the epoch's entry is the
    # largest answer of the epoch, here (the answers grow) its last read, at epoch end.
    assert resets == [DEVICE] * (2 + 4) and set(reads) == {DEVICE}
    measured = history.history[MEASURED_PEAK_KEY]
    assert measured[1] == 1000 * len(reads) and 0 < measured[0] < measured[1] and measured[0] % 1000 == 0
    assert history.history[PREDICTED_PEAK_KEY] == [cb.plan.peak_bytes_after] * 2
