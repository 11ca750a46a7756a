"""``devices=[...]``: placed steps on three logical CPUs (two devices and the host), in a process of
their own (``tests/placement_job.py``; the suite's ``conftest.py`` makes two logical CPUs).

For the zoo's CNN, transformer, 3D U-Net and ResNet50 (small): 3 Adam steps of the placed step give
bit-identical losses and weights (and optimizer state) to the plain single-device step; every placed
op that TensorFlow ran (the partition graphs of the first call) ran on the device the plan says, and
both devices ran ops; rewriting twice changes nothing. One process cannot show memory effects
(``DESIGN.md`` §2b): the peaks here are the plan's predictions.
"""

import json
import subprocess
import sys

import pytest
import tensorflow as tf

import tflms
from tflms.testing.zoo import build

from conftest import DEVICE, HOST, TESTS

pytestmark = pytest.mark.integration

JOB = TESTS / "placement_job.py"
HOST_JOB = TESTS / "placement_host_job.py"


def _job(*models: str, job=JOB) -> dict[str, dict]:
    r = subprocess.run([sys.executable, str(job), *models], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    results = [json.loads(line[len("RESULT ") :]) for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    return {res["model"]: res for res in results}


@pytest.fixture(scope="module")
def small_models() -> dict[str, dict]:
    return _job("cnn", "transformer", "unet3d", "fit:cnn")


def _check(res: dict) -> None:
    assert res["placed_losses"] == res["plain_losses"], res
    assert res["weights_differ"] == [] and res["n_state"] > 0
    assert res["n_misplaced"] == 0, res["misplaced"]
    assert res["graph_misplaced"] == []
    # Both devices ran ops placed on them (Grappler folds constants, removes Identity and Reshape
    # ops and fuses some convolutions: those are not in the graphs that ran).
    for device, n in res["n_placed"].items():
        assert n > 0 and res["ran"][device] >= 50, (device, res["ran"], res["n_placed"])
    assert res["again_same"] and res["replaced"] == 0
    assert max(res["peaks"]) < res["plain_peak"]


@pytest.mark.parametrize("name", ["cnn", "transformer", "unet3d"])
def test_placed_step_is_bit_identical_and_runs_where_the_plan_says(small_models, name):
    _check(small_models[name])


def test_unet3d_with_its_concatenates_on_the_host_is_bit_identical_and_runs_where_the_plan_says():
    res = _job("unet3d", job=HOST_JOB)["unet3d"]
    assert res["placed_losses"] == res["plain_losses"], res
    assert res["weights_differ"] == [] and res["n_state"] > 0
    # Both skip Concatenates (ConcatV2) and the Slice ops of their gradients are the host's stage ...
    assert sorted(res["asked"]) == res["host_ops"] and len(res["host_ops"]) == 6
    assert res["host_types"] == ["ConcatV2", "Slice"]
    assert [d for d, _, _ in res["stages"]] == ["/device:CPU:1", "/device:CPU:2", HOST]
    # ... and ran there, every placed op ran where the plan says, and each device ran its share.
    assert set(res["host_ran"]) == set(res["host_ops"])
    assert all(d.endswith("device:CPU:0") for devices in res["host_ran"].values() for d in devices)
    assert res["n_misplaced"] == 0, res["misplaced"]
    assert res["ran"][HOST] == 6 and min(res["ran"]["/device:CPU:1"], res["ran"]["/device:CPU:2"]) >= 50, res["ran"]


def test_unet3d_placed_with_swaps_per_device_is_bit_identical_and_swaps_where_the_plan_says():
    # A budget below the placement's largest predicted device peak: swaps planned on each device's model.
    res = _job("swap:unet3d", job=HOST_JOB)["swap:unet3d"]
    assert res["placed_losses"] == res["plain_losses"], res
    assert res["weights_differ"] == [] and res["n_state"] > 0
    assert sorted(res["swapped"]) == ["/device:CPU:1", "/device:CPU:2"] and all(res["swapped"].values())
    # A tensor made on another device (the host's Concatenate) swapped for the device that reads it.
    assert res["swapped_from_elsewhere"], res["swapped"]
    n_swaps = sum(len(v) for v in res["swapped"].values())
    assert res["swap_ops"] == {kind: [n_swaps, n_swaps] for kind in ("out", "in", "landing")}, res["swap_ops"]
    assert res["swap_misplaced"] == [] and res["n_misplaced"] == 0, (res["swap_misplaced"], res["misplaced"])
    assert res["peak_bytes_after"] < max(peak for d, _, peak in res["stages"] if d != HOST)
    assert "then swaps planned per device" in res["reason"]


def test_lms_callback_with_devices_fits_bit_identically(small_models):
    res = small_models["fit:cnn"]
    assert res["placed_history"] == res["plain_history"] and res["weights_differ"] == []
    assert res["n_stages"] == 2 and res["devices"] == ["/device:CPU:1", "/device:CPU:2"]


@pytest.mark.slow
def test_placed_resnet50_is_bit_identical_and_runs_where_the_plan_says():
    _check(_job("resnet50")["resnet50"])


def test_devices_that_do_not_exist_are_refused():
    model, x, y, step = build("cnn", batch=2, size=16)
    with pytest.raises(ValueError, match=r"devices lists '/device:CPU:7', which does not exist here") as err:
        tflms.function(step, devices=[DEVICE, "/device:CPU:7"], host=HOST).get_plan(x, y)
    assert "Received: devices=['/device:CPU:1', '/device:CPU:7']" in str(err.value)


def test_devices_refuse_xla():
    model, x, y, step = build("cnn", batch=2, size=16)
    with pytest.raises(ValueError, match="devices cannot place a step compiled with XLA") as err:
        tflms.function(tf.function(step, jit_compile=True), devices=[DEVICE, "/device:CPU:7"])
    assert "Received: devices=" in str(err.value)
    cf = tf.function(step, jit_compile=True).get_concrete_function(x, y)
    with pytest.raises(ValueError, match="devices cannot place a step compiled with XLA"):
        tflms.optimize(cf, devices=[DEVICE, "/device:CPU:7"])


def test_lms_callback_takes_devices():
    cb = tflms.LMSCallback(devices=[DEVICE, "/device:GPU:0"])
    assert cb.config.devices == (DEVICE, "/device:GPU:0")
    assert tflms.LMSCallback(devices=[DEVICE, "/device:GPU:0"], horovod=True).horovod  # each rank places its own
