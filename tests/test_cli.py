"""The tflms command line, run as a user would (a subprocess each)."""

import json
import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}


def tflms(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "tflms", *args], capture_output=True, text=True, timeout=timeout, env=ENV
    )


def test_demo_trains_resnet50_beyond_the_budget_with_lms():
    r = tflms("demo", "--image-size", "64", "--steps", "2", "--budget", "600MiB")
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert "device memory budget: 600.0 MiB (--budget)" in out
    assert "(the smallest power of two whose plain step exceeds the budget)" in out
    before, after = out.split("predicted device peak (simulator): ")[1].split(" (")[0].split(" -> ")
    assert before.endswith(" MiB") and after.endswith(" MiB")
    assert float(before.split()[0]) > 600 >= float(after.split()[0])
    assert "tflms plan for train_step" in out
    assert "step time (median after the first)" in out and "images/s" in out


def test_plan_writes_json_that_fits_the_budget(tmp_path):
    path = tmp_path / "plan.json"
    r = tflms(
        "plan",
        "MobileNetV3Small",
        "--batch",
        "32",
        "--input-shape",
        "64,64,3",
        "--budget",
        "60MiB",
        "--json",
        str(path),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    plan = json.loads(path.read_text())
    assert plan["options"]["budget"] == 60 * 2**20
    assert plan["peak_bytes_after"] <= 60 * 2**20 < plan["peak_bytes_before"]
    assert len(plan["swaps"]) == plan["options"]["n_tensors"] >= 1
    assert "tflms plan for train_step" in r.stdout


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["plan", "NoSuchNet", "--batch", "4"], 1, "unknown MODEL 'NoSuchNet'"),
        (["plan", "nosuchpkg.mod:make", "--batch", "4"], 1, "cannot load MODEL factory"),
        (["plan", "MobileNetV3Small", "--batch", "4", "--budget", "12 parsecs"], 2, "budget="),
        (["plan", "MobileNetV3Small", "--batch", "4", "--input-shape", "a,b"], 2, "expected dimensions"),
        (["plan", "MobileNetV3Small", "--batch", "0"], 2, "--batch must be >= 1"),
        (
            ["plan", "MobileNetV3Small", "--batch", "4", "--input-shape", "32,32,3", "--budget", "1MiB"],
            1,
            "No swap plan found fits budget=",
        ),
    ],
)
def test_bad_input_gives_one_clear_line(args, code, message):
    r = tflms(*args)
    assert r.returncode == code, (r.returncode, r.stderr[-2000:])
    last = [line for line in r.stderr.splitlines() if line.strip()][-1]
    assert message in last
    assert "Traceback" not in r.stderr
