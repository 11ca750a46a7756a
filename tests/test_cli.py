"""The tflms command line, run as a user would (a subprocess each)."""

import json
import os
import subprocess
import sys

import pytest

# Tiers per test: the command line as the docs show it (the demo, the console script) is "docs".

# No GPU in the subprocesses: `tflms demo` takes its test-bed path (the one these tests check)
# on a GPU machine too, and `tflms plan` only simulates.
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": "-1"}


def tflms(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "tflms", *args], capture_output=True, text=True, timeout=timeout, env=ENV
    )


@pytest.mark.docs
@pytest.mark.slow
@pytest.mark.measured
def test_demo_shows_a_real_out_of_memory_plain_and_real_training_with_tflms():
    """``tflms demo`` on a machine without GPU: the test bed, a real cap, both measured peaks.

    It is also the suite's real-cap test (a plain step that runs out of memory under a
    cap, the tflms step trains under it) and its budget test: the plan autotuned through
    ``tflms.optimize(..., budget=...)`` measures at most 110 % of its budget."""
    import re

    # At batch 16 no plan reaches the default budget (0.85 x 520 = 442 MiB; the lowest predicts
    # 455 MiB): --budget sets it.
    # Two measured ResNet50 processes: on a loaded machine the run takes minutes, not the 300 s of a CLI call.
    r = tflms(
        "demo", "--image-size", "96", "--batch", "16", "--steps", "1", "--cap", "520MiB", "--budget", "468MiB",
        timeout=1200,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert "two-process test bed" in out and "ResNet50 96x96, batch 16" in out
    assert "Adam; each run trains 1 step of warm-up, then measures 1 step." in out
    plain = re.search(r"1\. plain step, no cap: +measured peak ([\d,]+) MiB, predicted ([\d,]+) MiB", out)
    assert plain, out
    assert "real memory cap for the next runs: 520 MiB; tflms budget: 468 MiB (90% of the cap), serialize=True" in out
    assert re.search(r"2\. plain step, capped: +OUT OF MEMORY", out), out
    # What the allocator logged (tflms.testbed.allocator_oom_report): no free chunk held the
    # request, and its regions could not grow by it under the cap.
    held = re.search(
        r"the allocator held ([\d,.]+) MiB in use and ([\d,.]+) MiB free \(largest free chunk ([\d,.]+) MiB\) "
        r"and could not place ([\d,.]+) MiB",
        out,
    )
    assert held, out
    in_use, free, largest, request = (float(g.replace(",", "")) for g in held.groups())
    # Each figure is rounded to 0.1 MiB: the regions (in use + free) are within the cap, and
    # they could not grow by the request.
    assert largest <= request + 0.1 and in_use + free <= 520.1 < in_use + free + request + 0.2, held.group(0)
    lms = re.search(r"3\. tflms step, capped: +TRAINED, measured peak ([\d,]+) MiB, predicted ([\d,]+) MiB", out)
    assert lms, out
    assert re.search(r"losses [\d.]+ \(warm-up\), then [\d.]+, step time", out), out  # 1 + 1 steps
    measured_plain, measured_lms = (int(m.group(1).replace(",", "")) for m in (plain, lms))
    assert measured_lms <= 520 < measured_plain
    assert measured_lms <= 1.10 * 468, measured_lms  # the budget, measured (cap 520 MiB, budget 468 MiB)
    saved = re.search(r"tflms needs (\d+)% less device memory than the plain step", out)
    assert saved and abs(int(saved.group(1)) - 100 * (1 - measured_lms / measured_plain)) <= 1.5, out


@pytest.mark.integration
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
        "75MiB",
        "--swapout-window",
        "2",
        "--no-serialize",
        "--policy",
        "none",
        "--json",
        str(path),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    plan = json.loads(path.read_text())
    assert plan["options"]["budget"] == 75 * 2**20
    assert plan["options"]["serialize"] is False and plan["orders"] == []
    assert plan["peak_bytes_after"] <= 75 * 2**20 < plan["peak_bytes_before"]
    assert len(plan["swaps"]) == plan["options"]["n_tensors"] >= 3
    # One fence per swap after the first two in execution order (no two swapped tensors share
    # a producer here), but none on a sum (tflms.plan.planner.UNFENCED_TYPES: Grappler's AddOpsRewrite).
    from tflms.plan.planner import UNFENCED_TYPES

    types = {s["producer"]: s["producer_type"] for s in plan["swaps"]}
    unsummed = sum(t not in UNFENCED_TYPES for t in types.values())
    assert plan["options"]["swapout_window"] == 2 and len(types) == len(plan["swaps"]) > unsummed
    assert all(types[f["op"]] not in UNFENCED_TYPES for f in plan["fences"])
    assert unsummed - 2 <= len(plan["fences"]) <= min(unsummed, len(plan["swaps"]) - 2)
    assert {f["tensor"] for f in plan["fences"]} < {s["tensor"] for s in plan["swaps"]}
    assert f"swap-out fences: {len(plan['fences'])}" in r.stdout
    assert "tflms plan for train_step" in r.stdout


@pytest.mark.integration
def test_plan_serializes_by_default_and_writes_its_orders(tmp_path):
    path = tmp_path / "plan.json"
    args = ("--batch", "64", "--input-shape", "96,96,3", "--classes", "10", "--json", str(path))
    r = tflms("plan", "MobileNetV3Small", *args, "--policy", "none")  # the schedule's orders alone
    assert r.returncode == 0, r.stderr[-2000:]
    plan = json.loads(path.read_text())
    assert plan["options"]["serialize"] is True and plan["format_version"] == 7
    assert len(plan["orders"]) >= 1 and all(set(o) == {"op", "after"} for o in plan["orders"])
    assert all(o["op"].startswith("gradient_tape/") for o in plan["orders"])  # backward ops only
    n = len(plan["orders"])
    assert f"memory-aware schedule: {n} ordering edge{'s' * (n != 1)} (" in r.stdout


@pytest.mark.integration
def test_plan_splits_sums_and_swaps_gradients_when_asked(tmp_path):
    from tflms.plan.passes.sums import term_order

    path = tmp_path / "plan.json"
    args = ("--batch", "32", "--input-shape", "64,64,3", "--classes", "10", "--no-serialize", "--json", str(path))
    r = tflms("plan", "MobileNetV3Small", *args, "--policy", "split_sums,swap_gradients")
    assert r.returncode == 0, r.stderr[-2000:]
    plan = json.loads(path.read_text())
    assert plan["options"]["policy"] == ["split_sums", "swap_gradients"]
    n = len(plan["sums"])
    assert n >= 1 and all(len(x["terms"]) >= 3 and x["terms"] == term_order(x["terms"]) for x in plan["sums"])
    assert f"sums added as their terms arrive: {n} AddN ops" in r.stdout


@pytest.mark.integration
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
            "no swap plan brings the predicted device peak within the budget '1MiB' (1.0 MiB = 1.0 MB = 1,048,576 "
            "bytes): the best plan's peak is ",
        ),
        (["plan", "MobileNetV3Small", "--batch", "4", "--max-batch"], 1, "--max-batch needs --budget"),
        (
            ["plan", "MobileNetV3Small", "--batch", "4", "--swapout-window", "0"],
            1,
            "swapout_window must be 'auto', an integer >= 1 or None. Received: swapout_window=0",
        ),
        (
            ["demo", "--cap", "500MiB", "--budget", "600MiB"],  # before any measurement
            1,
            "--budget must be at most the real memory cap of the device (500 MiB): a plan for more memory than "
            "the cap runs out of memory. Received: --budget='600MiB'.",
        ),
    ],
)
def test_bad_input_gives_one_clear_line(args, code, message):
    r = tflms(*args)
    assert r.returncode == code, (r.returncode, r.stderr[-2000:])
    last = [line for line in r.stderr.splitlines() if line.strip()][-1]
    assert message in last
    assert "Traceback" not in r.stderr


@pytest.mark.integration
def test_on_budget_miss_best_plans_with_the_lowest_plan_and_warns(tmp_path):
    """The budget that test_bad_input_gives_one_clear_line refuses, with --on-budget-miss best: a
    warning with the lowest predicted peak, then that plan (its JSON records the choice)."""
    path = tmp_path / "plan.json"
    args = ["plan", "MobileNetV3Small", "--batch", "4", "--input-shape", "32,32,3", "--budget", "1MiB"]
    r = tflms(*args, "--on-budget-miss", "best", "--json", str(path))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "on_budget_miss='best': planning with the lowest plan the search found" in r.stderr
    plan = json.loads(path.read_text())
    assert plan["options"]["on_budget_miss"] == "best"
    assert plan["peak_bytes_after"] > 2**20  # it does not fit: the user was told


# -- your own model: tflms plan package.module:factory ----------------------------------

FACTORIES = """
import keras

L = keras.layers


def unet():
    # A tiny U-Net-like segmentation model: per-pixel class scores, per-pixel sparse loss.
    inp = keras.Input((32, 32, 3))
    c1 = L.Conv2D(8, 3, padding="same", activation="relu")(inp)
    c2 = L.Conv2D(16, 3, padding="same", activation="relu")(L.MaxPooling2D()(c1))
    up = L.UpSampling2D()(c2)
    out = L.Conv2D(5, 1)(L.Concatenate()([up, c1]))
    model = keras.Model(inp, out)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def two_inputs():
    image, meta = keras.Input((16, 16, 3)), keras.Input((8,), name="meta")
    h = L.GlobalAveragePooling2D()(L.Conv2D(8, 3, activation="relu")(image))
    out = L.Dense(4)(L.Concatenate()([h, L.Dense(8)(meta)]))
    model = keras.Model([image, meta], out)
    model.compile("sgd", "mse")
    return model


def uncompiled():
    return keras.Sequential([keras.Input((4,)), L.Dense(2)])


def broken():
    raise RuntimeError("the data set is not mounted")


def ids(y_true, y_pred):  # a loss on class ids whose name does not say "sparse"
    return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)


def sequence():
    # Token ids of any length (KerasHub's models take such inputs): the sequence length is unknown.
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    model = keras.Model(tokens, L.Dense(6)(L.Embedding(50, 8)(tokens)))
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def own_loss():
    model = keras.Sequential([keras.Input((12,)), L.Dense(32, activation="relu"), L.Dense(6)])
    model.compile("adam", ids)
    return model
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """(work dir holding mymodels.py, a console-script launcher in another dir)."""
    root = tmp_path_factory.mktemp("project")
    work, bin_dir = root / "work", root / "bin"
    work.mkdir()
    bin_dir.mkdir()
    (work / "mymodels.py").write_text(FACTORIES)
    # What pip writes for the console_scripts entry point: sys.path[0] is this script's folder.
    launcher = bin_dir / "tflms"
    launcher.write_text("import sys\nfrom tflms.cli import main\nsys.exit(main())\n")
    return work, launcher


def console(project, *args, timeout=300):
    """Run the console script from the folder that holds mymodels.py."""
    work, launcher = project
    env = {k: v for k, v in ENV.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, str(launcher), *args], cwd=work, capture_output=True, text=True, timeout=timeout, env=env
    )


def last_line(r):
    return [line for line in r.stderr.splitlines() if line.strip()][-1]


@pytest.mark.docs
def test_console_script_plans_a_segmentation_factory_from_the_current_directory(project):
    work, _ = project
    r = console(project, "plan", "mymodels:unet", "--batch", "8", "--json", "unet.json", "--rows", "3")
    assert r.returncode == 0, r.stderr[-2000:]
    # Labels derived from the output (None, 32, 32, 5) and the sparse loss: per-pixel class ids.
    assert "mymodels:unet: inputs (None, 32, 32, 3) float32; labels (None, 32, 32) int32; batch 8" in r.stdout
    plan = json.loads((work / "unet.json").read_text())
    assert plan["n_ops"] > 100 and plan["peak_bytes_before"] > 8 * 32 * 32 * 16 * 4  # c1 and c2 of 8 images at least
    assert "Traceback" not in r.stderr


@pytest.mark.docs
def test_console_script_plans_a_two_input_model_and_prints_budgets_in_both_units(project):
    work, _ = project
    r = console(project, "plan", "mymodels:two_inputs", "--batch", "4", "--budget", "16 GB", "--max-batch",
                "--json", "two.json")  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "inputs (None, 16, 16, 3) float32, (None, 8) float32; labels (None, 4) float32" in r.stdout
    assert "budget: '16 GB' (14.9 GiB = 16.0 GB)" in r.stdout
    assert "largest batch within 14.9 GiB = 16.0 GB (simulator prediction)" in r.stdout
    assert "(one op's working set)" in r.stdout.split("largest batch within")[1]
    assert "bytes" not in r.stdout.split("budget:")[1].splitlines()[0]
    assert json.loads((work / "two.json").read_text())["options"]["budget"] == 16 * 10**9
    r = console(project, "plan", "mymodels:two_inputs", "--batch", "4", "--budget", "16G", "--json", "two.json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "budget: '16G' (16.0 GiB = 17.2 GB)" in r.stdout
    assert json.loads((work / "two.json").read_text())["options"]["budget"] == 16 * 2**30


@pytest.mark.integration
def test_labels_that_cannot_be_derived_fail_in_one_line_and_the_options_fix_them(project):
    r = console(project, "plan", "mymodels:own_loss", "--batch", "4")
    assert r.returncode == 1
    line = last_line(r)
    assert line.startswith("tflms: error: Tracing the training step of the Keras model") and "Traceback" not in r.stderr
    assert "labels (None, 6) float32" in line and "label_shape" in line
    r = console(project, "plan", "mymodels:own_loss", "--batch", "4", "--label-shape", "()", "--label-dtype", "int32")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "labels (None,) int32" in r.stdout


@pytest.mark.integration
@pytest.mark.parametrize(
    "args, message",
    [
        (["mymodels:uncompiled"], "tflms: error: The Keras model 'sequential' is not compiled: compile it first"),
        (["mymodels:broken"], "MODEL factory 'mymodels:broken' raised RuntimeError: the data set is not mounted"),
        (["mymodels:nothing"], "cannot load MODEL factory 'mymodels:nothing' (searched the current directory"),
        (["nosuchmodule:unet"], "No module named 'nosuchmodule'"),
        (["mymodels:unet", "--input-shape", "64,64,3"], "--input-shape apply to keras.applications models only"),
        (["mymodels:unet", "--label-dtype", "int33"], "Received: label_dtype='int33'"),
        (
            ["mymodels:sequence", "--max-batch", "--budget", "1GiB"],
            "cannot plan MODEL 'mymodels:sequence': input 'tokens' has an unknown dimension 1 (shape [?, ?]); the "
            "labels have an unknown dimension 1 (shape [?, ?])",
        ),
    ],
)
def test_factory_errors_are_one_line(project, args, message):
    r = console(project, "plan", *args, "--batch", "2")
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert message in last_line(r)
    assert "Traceback" not in r.stderr


# -- what the demo says, and TensorFlow's load-time log lines ---------------------------

BANNER = "oneDNN custom operations are on"


@pytest.mark.integration
def test_the_demo_says_how_many_steps_each_run_trains_and_prints_a_loss_for_each(monkeypatch, capsys):
    """The header names the warm-up and the measured steps, and the loss line labels the
    warm-up's loss: as many losses as steps trained. The measurements are replaced here (the
    real ones take minutes: ``test_demo_shows_a_real_out_of_memory_plain_and_real_training_with_tflms``);
    each fake run trains as many steps as the demo asks ``measure`` for."""
    import argparse

    from tflms.testbed import MeasuredResult
    from tflms.testing import demo, measure

    asked = []

    def fake_measure(model, batch, *, modes, cap=None, options=None, size, steps, warmup=1, gpu):  # measure_step: 1
        asked.append({"modes": modes, "steps": steps, "warmup": warmup})
        n = warmup + steps
        entry = {
            "peak": 400 * 2**20 if cap else 600 * 2**20,
            "predicted": 500 * 2**20,
            "losses": [7.0 - 0.25 * k for k in range(n)],
            "step_seconds": [2.0] * n,
        }
        if modes == ["plain"] and cap:
            return MeasuredResult("oom", returncode=1, error="ResourceExhaustedError")
        if modes == ["lms"]:
            entry.update(n_swaps=12, swapped_bytes=50 * 2**20, n_orders=3)
        return MeasuredResult("ok", value={modes[0]: entry})

    monkeypatch.setattr(measure, "measure", fake_measure)
    args = argparse.Namespace(batch=16, image_size=64, steps=3, cap=None, budget=None)
    assert demo.run_demo(args) == 0
    out = capsys.readouterr().out
    assert "ResNet50 64x64, batch 16, Adam; each run trains 1 step of warm-up, then measures 3 steps." in out
    assert "losses 7.0000 (warm-up), then 6.7500, 6.5000, 6.2500, step time" in out
    assert "steps per run" not in out
    assert [a["steps"] for a in asked] == [3, 3, 3] and [a["warmup"] for a in asked] == [demo.WARMUP] * 3 == [1] * 3


FAKE_TENSORFLOW = """
import os, sys
notice = b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\\n"
banner = b"] oneDNN custom operations are on. You may see slightly different numerical results.\\n"
os.write(2, notice + b"I0000 00:00:1795826966.133185   27641 port.cc:153" + banner)
os.write(2, b"E0000 00:00:1795826966.200000   27641 loader.cc:7] a real error\\n")
print("a Python warning", file=sys.stderr, flush=True)
os.write(2, notice + b"I0000 00:00:1795826970.100000   27641 port.cc:153" + banner)
if os.environ.get("FAKE_TF_ABORT"):
    os.abort()
"""


@pytest.mark.integration
@pytest.mark.parametrize(
    "level, expected",
    [
        ("2", ["E0000 00:00:1795826966.200000   27641 loader.cc:7] a real error", "a Python warning", "imported"]),
        (
            "0",
            [
                "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
                f"I0000 00:00:1795826966.133185   27641 port.cc:153] {BANNER}. You may see slightly different "
                "numerical results.",
                "E0000 00:00:1795826966.200000   27641 loader.cc:7] a real error",
                "a Python warning",
                "imported",
            ],
        ),
        ("3", ["a Python warning", "imported"]),
    ],
)
def test_tensorflows_load_time_log_lines_follow_the_log_level_and_come_once(tmp_path, level, expected):
    """``tflms.cli.import_tensorflow`` on a stand-in ``tensorflow`` package that writes to file
    descriptor 2 as TensorFlow 2.21 does on import (the banner from two libraries, each after absl's
    notice): the lines ``TF_CPP_MIN_LOG_LEVEL`` hides, and the repeat, are left out; errors and
    everything that is not a hidden log line come through, in order."""
    (tmp_path / "tensorflow").mkdir()
    (tmp_path / "tensorflow" / "__init__.py").write_text(FAKE_TENSORFLOW)
    env = {**ENV, "TF_CPP_MIN_LOG_LEVEL": level, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    code = (
        "import sys; from tflms.cli import import_tensorflow; import_tensorflow(); print('imported', file=sys.stderr)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == expected


@pytest.mark.integration
def test_what_was_written_before_a_crash_during_the_import_still_shows(tmp_path):
    (tmp_path / "tensorflow").mkdir()
    (tmp_path / "tensorflow" / "__init__.py").write_text(FAKE_TENSORFLOW)
    env = {**ENV, "TF_CPP_MIN_LOG_LEVEL": "2", "FAKE_TF_ABORT": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *sys.path])
    code = "from tflms.cli import import_tensorflow; import_tensorflow()"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode != 0
    assert "loader.cc:7] a real error" in r.stderr and "a Python warning" in r.stderr and BANNER not in r.stderr


@pytest.mark.integration
@pytest.mark.parametrize("level, banners", [(None, 0), ("0", 1)])
def test_the_command_line_prints_tensorflows_onednn_banner_at_most_once(level, banners):
    """The real TensorFlow, through ``python -m tflms`` (a command that imports it and fails fast,
    before any measurement): with the log level the command line sets (2, where the caller sets
    none) the INFO banner is not shown; with ``TF_CPP_MIN_LOG_LEVEL=0`` it is shown once, not once
    per library that logs it. The error is still the last line."""
    env = {k: v for k, v in ENV.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    if level is not None:
        env["TF_CPP_MIN_LOG_LEVEL"] = level
    assert env.get("TF_ENABLE_ONEDNN_OPTS") == "1"  # tests/conftest.py: oneDNN on, so TensorFlow logs the banner
    r = subprocess.run(
        [sys.executable, "-m", "tflms", "demo", "--cap", "500MiB", "--budget", "600MiB"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 1, r.stderr[-2000:]
    assert r.stderr.count(BANNER) == banners, r.stderr
    assert r.stderr.count("before absl::InitializeLog()") == banners, r.stderr
    last = [line for line in r.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("tflms: error: --budget must be at most the real memory cap"), r.stderr


@pytest.mark.integration
def test_plan_with_the_optimizer_offloaded_fits_a_budget_the_plain_step_cannot(tmp_path):
    """MobileNetV3Small 64², batch 16, Adam: no plan fits 40 MiB with the optimizer's state on the
    device; with it on the host (``--offload optimizer``) one does."""
    args = ("plan", "MobileNetV3Small", "--batch", "16", "--input-shape", "64,64,3", "--classes", "10")
    path = tmp_path / "plan.json"
    plain = tflms(*args, "--budget", "40MiB")
    assert plain.returncode == 1 and "no swap plan brings the predicted device peak within" in plain.stderr
    r = tflms(*args, "--budget", "40MiB", "--offload", "optimizer", "--json", str(path))
    assert r.returncode == 0, r.stderr[-2000:]
    plan = json.loads(path.read_text())
    assert plan["options"]["offload"] == "optimizer"
    assert plan["peak_bytes_after"] <= 40 * 2**20 < plan["peak_bytes_before"]
