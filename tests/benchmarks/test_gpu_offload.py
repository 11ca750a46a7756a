"""benchmarks/gpu_offload.py's smoke mode: the script a GPU session runs, checked on the CPU."""

import json

import pytest

from conftest import load_benchmark

pytestmark = pytest.mark.integration

FIELDS = {"mode", "cap_mib", "status", "step_ms", "samples_per_s", "measured_peak_mib", "predicted_peak_mib",
          "host_update_ms", "host_update_span_ms", "losses", "parameters"}  # fmt: skip


@pytest.fixture(scope="module")
def script():
    return load_benchmark("gpu_offload")


def test_smoke_mode_trains_both_ways_to_the_same_losses(script, tmp_path):
    out = tmp_path / "gpu_offload.json"
    assert script.main(["--smoke", "--steps", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {"date", "gpu", "tensorflow", "tflms", "model", "runs", "max_loss_diff"} <= set(data)
    plain, offload = data["runs"]
    assert (plain["mode"], offload["mode"]) == ("plain", "offload")
    for r in (plain, offload):
        assert FIELDS <= set(r) and r["status"] == "ok", r
        assert r["step_ms"] > 0 and r["predicted_peak_mib"] > 0 and r["measured_peak_mib"] is None  # no GPU
    assert data["model"]["parameters"] == plain["parameters"] > 10**6
    # The host's update, profiled: the ops tflms placed on the host ran, and took time.
    assert plain["host_update_ms"] is None and offload["host_update_ms"] > 0
    assert offload["host_update_span_ms"] >= offload["host_update_ms"] / 16
    # The Adam state leaves the device in the prediction; the same kernels give the same losses on a CPU.
    assert offload["predicted_peak_mib"] < plain["predicted_peak_mib"]
    assert data["max_loss_diff"] == 0.0 and len(offload["losses"]) == len(plain["losses"]) + 1
