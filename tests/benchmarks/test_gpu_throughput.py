"""benchmarks/gpu_throughput.py's smoke mode: the script a GPU session runs, checked on the CPU."""

import json
from pathlib import Path

import pytest

from conftest import load_benchmark

pytestmark = pytest.mark.integration

FIELDS = {"model", "cap_mib", "mode", "batch", "status", "samples_per_s", "step_ms", "predicted_step_ms",
          "measured_peak_mib", "predicted_peak_mib"}  # fmt: skip


@pytest.fixture(scope="module")
def script():
    return load_benchmark("gpu_throughput")


def test_smoke_mode_writes_the_schema_and_the_profiles(script, tmp_path):
    out = tmp_path / "results" / "gpu_throughput.json"
    assert script.main(["--smoke", "--steps", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {"date", "gpu", "tensorflow", "runs", "link"} <= set(data)
    runs = data["runs"]
    assert [(r["model"], r["mode"], r["batch"]) for r in runs] == [
        (m, mode, b) for m in script.SMOKE for mode, b in (("plain", 2), ("tflms", 2), ("tflms", 4), ("tflms", 6))
    ]
    for r in runs:
        assert FIELDS <= set(r) and r["status"] == "ok", r
        assert r["samples_per_s"] > 0 and r["step_ms"] > 0 and r["predicted_step_ms"] > 0
        assert r["predicted_peak_mib"] > 0 and r["measured_peak_mib"] is None  # no GPU: no measured peak
        profile = json.loads((out.parent / Path(r["profile"]).name).read_text())
        assert profile["format"] == "tflms-op-profile" and len(profile["ops"]) == r["profiled_ops"] > 20
    tflms_runs = [r for r in runs if r["mode"] == "tflms"]
    assert all(r["swaps"] > 0 for r in tflms_runs)  # no budget on a CPU: every candidate is swapped
