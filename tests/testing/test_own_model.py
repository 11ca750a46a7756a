"""Measuring your own model on the test bed (tflms.testbed.measure_model) and the statuses of a
measured run (tflms.testbed.run_measured): 'ok', 'oom', 'budget', 'error'.

The page docs/measure-your-own-model.md is executed here: its ```python blocks run as scripts.
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest

import tflms
from tflms import testbed

from conftest import TESTS as TESTS_DIR

pytestmark = pytest.mark.integration

TESTS = str(TESTS_DIR)
ROOT = os.path.dirname(TESTS)
PAGE = os.path.join(ROOT, "docs", "measure-your-own-model.md")
TEARDOWN_LINE = "Failed to remove function remotely"


def _python_blocks(path):
    with open(path) as f:
        return re.findall(r"^```python\n(.*?)^```", f.read(), re.MULTILINE | re.DOTALL)


def _job(fail, **kwargs):
    return testbed.run_measured(
        "testbed_jobs:remote_function_then", {"fail": fail, **kwargs}, timeout=600, pythonpath=[TESTS]
    )


# ------------------------------------------------------------------------ statuses of run_measured
def test_an_error_says_error_and_what_was_raised_without_teardown_lines():
    """A function that ran a step across both processes and then raised: status 'error', the
    exception's type and message reported by the measured process, its traceback in ``error``, and
    none of TensorFlow's "Failed to remove function remotely due to Socket closed" lines, which
    the teardown of the remote context logged after every failed run."""
    r = _job("error")
    assert r.status == "error" and r.returncode == 1, r
    assert r.raised == {
        "type": "builtins.ValueError",
        "message": "failed on purpose after the remote function ran (fail='error')",
    }
    assert "Traceback" in r.error and "ValueError: failed on purpose" in r.error
    assert TEARDOWN_LINE not in r.error, r.error[-2000:]


def test_a_run_out_of_memory_under_a_tiny_cap_says_oom():
    """64 MiB asked for under a 16 MiB cap: 'oom', with the allocator's report and the error raised."""
    r = _job("oom", mib=64)
    assert r.status == "error"  # no cap: the allocation fits, and the function raises after it
    capped = testbed.run_measured(
        "testbed_jobs:remote_function_then", {"fail": "oom", "mib": 64}, cap="16MiB", timeout=600, pythonpath=[TESTS]
    )
    assert capped.status == "oom", capped
    assert capped.raised["type"].endswith("ResourceExhaustedError"), capped.raised
    assert capped.oom is not None and capped.oom["requested"] == 64 * 2**20, capped.oom
    assert TEARDOWN_LINE not in capped.error


def test_a_budget_error_says_budget_with_its_numbers():
    """The autotuner's BudgetError (budget=1024 bytes, which no plan reaches): status 'budget', and
    the error's numbers as data, not a traceback to parse."""
    r = _job("budget")
    assert r.status == "budget", r
    raised = r.raised
    assert raised["type"] == "tflms.errors.BudgetError" and raised["budget"] == 1024, raised
    assert raised["plain_peak_bytes"] >= raised["best_peak_bytes"] > 1024, raised
    assert "budget=1024" in raised["message"]
    assert TEARDOWN_LINE not in r.error


def test_a_callable_target_runs_as_its_module_path_does():
    """run_measured takes a picklable callable too; a lambda is refused in this process, clearly."""
    with pytest.raises(TypeError, match=r"target must be 'package.module:function' or a picklable callable"):
        testbed.run_measured(lambda: 1)
    with pytest.raises(TypeError, match=r"Received: target=3"):
        testbed.run_measured(3)


# ------------------------------------------------------------------------------- measure_model
def test_measure_model_refuses_bad_arguments_before_starting_a_process():
    with pytest.raises(TypeError, match=r"factory must be .* picklable callable.*Received: factory=<function"):
        testbed.measure_model(lambda: None)
    with pytest.raises(ValueError, match=r"Received: factory='no_colon'"):
        testbed.measure_model("no_colon")
    with pytest.raises(ValueError, match=r"ways must be .*Received: ways=\['lms', 'fast'\]"):
        testbed.measure_model("testbed_jobs:keras_mlp", ways=["lms", "fast"])
    with pytest.raises(ValueError, match=r"steps must be an integer >= 1.*steps=0"):
        testbed.measure_model("testbed_jobs:keras_mlp", steps=0)
    with pytest.raises(ValueError, match=r"options must not set host.*Received: options=\{'host'"):
        testbed.measure_model("testbed_jobs:keras_mlp", options={"host": "/device:CPU:0"})
    with pytest.raises(TypeError, match=r"Unknown LMS option\(s\): swap_everything"):
        testbed.measure_model("testbed_jobs:keras_mlp", options={"swap_everything": True})


def test_measure_model_of_a_training_step_plain_and_with_tflms():
    """A factory that returns a training step and its inputs: each way in its own process, one
    warm-up step and two measured ones, the same losses from the same seed (the CNN's steps are
    reproducible across processes here), a plan with swaps for the tflms way."""
    m = testbed.measure_model("testbed_jobs:cnn_step", {"batch": 16, "size": 32}, steps=2, timeout=600)
    plain, lms = m["plain"], m["lms"]
    assert plain.status == lms.status == "ok", (plain.result.error[-2000:], lms.result.error[-2000:])
    for run in (plain, lms):
        assert len(run.peaks) == len(run.held) == len(run.losses) == 3
        assert all(p > h > 0 for p, h in zip(run.peaks, run.held)), (run.peaks, run.held)
        assert run.peak == max(run.peaks[1:]) and run.loaded > 0
    assert lms.losses == plain.losses, (lms.losses, plain.losses)
    assert lms.n_swaps > 0 and lms.predicted > 0 and lms.predicted_plain > 0
    assert plain.predicted is None and plain.n_swaps is None


def test_measure_model_keeps_the_steps_done_and_says_budget_and_error():
    """The tflms way with a budget no plan reaches: 'budget', no step done (the plan is made as the
    first step is traced). A factory whose data run out: 'error', with the steps it did."""
    m = testbed.measure_model(
        "testbed_jobs:keras_mlp", batch_size=64, options={"budget": 1024}, ways=["lms"], timeout=600
    )
    run = m["lms"]
    assert list(m.runs) == ["lms"] and run.status == "budget", run.result.error[-2000:]
    assert run.result.raised["budget"] == 1024 and run.peaks == [] and run.loaded > 0
    m = testbed.measure_model(
        "testbed_jobs:keras_mlp", {"samples": 128, "unknown_size": True}, steps=3, ways=["plain"], timeout=600
    )
    run = m["plain"]  # two batches of unknown number: Keras finds the end in the third epoch, then starts again
    assert run.status == "error" and "fit ran 3 of warmup + steps = 4 steps" in run.result.raised["message"], run
    assert len(run.peaks) == len(run.losses) == 3 and run.peak == max(run.peaks[1:])
    assert "3 steps done: fit ran 3 of" in m.summary()


def test_a_script_without_a_main_block_is_told_so_and_not_run_again(tmp_path):
    """The measured process imports the calling script to find a factory defined there; a script
    that measures at its top level would start a measured process from there, and so on. It gets
    an 'error' that says what to do instead."""
    script = tmp_path / "no_main_block.py"
    script.write_text(
        textwrap.dedent(
            """
            import tflms.testbed
            import testbed_jobs

            def build():
                return testbed_jobs.keras_mlp()

            m = tflms.testbed.measure_model(build, batch_size=64, ways=["plain"], timeout=300)
            print("STATUS", m["plain"].status, m["plain"].result.raised["type"])
            print("MESSAGE", m["plain"].result.raised["message"])
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS])}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("STATUS") == 1 and "STATUS error builtins.RuntimeError" in proc.stdout, proc.stdout
    assert 'Put the script\'s own work under `if __name__ == "__main__":`' in proc.stdout, proc.stdout


# --------------------------------------------------------------------------------- the docs page
def test_the_docs_page_example_runs_and_shows_what_it_says(tmp_path):
    """Each ```python block of docs/measure-your-own-model.md, run as a script: the example
    measures a Keras model under a 76 MiB cap, where the plain step runs out of memory and the
    tflms step trains (measured without the cap: plain 89-98 MiB per step, tflms 33-52 MiB)."""
    blocks = _python_blocks(PAGE)
    assert blocks, f"no ```python block in {PAGE}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    outputs = []
    for i, code in enumerate(blocks):
        script = tmp_path / f"block_{i}.py"
        script.write_text(code)
        proc = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        outputs.append(proc.stdout)
        print(proc.stdout)
    out = outputs[0]
    assert "plain: oom | lms: ok" in out, out
    table = out.splitlines()
    assert table[0].split()[:2] == ["way", "status"] and table[1].split()[:2] == ["plain", "oom"], out
    assert table[2].split()[:2] == ["lms", "ok"], out
    peaks = re.search(r"lms peak per step \(MiB\): \[(.*)\]", out).group(1).split(", ")
    assert len(peaks) == 3 and all(0 < float(p) <= 76 for p in peaks), out


def test_the_public_names_are_exported():
    for name in ("measure_model", "ModelRun", "ModelMeasurement", "STATUSES", "WAYS"):
        assert name in testbed.__all__ and hasattr(testbed, name)
    assert testbed.STATUSES == ("ok", "oom", "budget", "error")
    assert tflms.testbed is testbed
