"""benchmarks/gpu.py's search arithmetic, which runs before any GPU is touched: its doctests,
and the second round of a search (between the largest batch that trained and the smallest
that did not, or above it when every batch tried trained)."""

import doctest
import re

import pytest

from conftest import load_benchmark

pytestmark = pytest.mark.unit

gpu = load_benchmark("gpu")


def test_doctests_of_the_gpu_benchmark():
    result = doctest.testmod(gpu)
    assert result.attempted >= 5 and result.failed == 0, result


def test_second_round_grows_when_every_batch_trained_and_refines_after_a_failure():
    runs = [{"variant": "budget", "batch": b, "ok": True} for b in (48, 64, 96, 128, 160)]
    runs.append({"variant": "plain", "batch": 200, "ok": False})  # another variant's failure
    assert gpu.largest_trained(runs, "budget") == (160, None)
    assert gpu.next_batches(*gpu.largest_trained(runs, "budget"), 4) == [192, 224, 256, 288]
    runs.append({"variant": "budget", "batch": 192, "ok": False})
    assert gpu.next_batches(*gpu.largest_trained(runs, "budget"), 4) == [166, 172, 179, 185]
    assert gpu.next_batches(*gpu.largest_trained(runs, "plain"), 4) == []  # nothing trained


def test_option_modifiers_turn_on_plan_options_once_each_and_not_for_plain():
    assert gpu.parse_variant("budget/g/s/o") == ("budget", {"window": -1, "max_pending": 0, "flags": "gos"})
    assert gpu.parse_variant("tflms/w2/r")[1] == {"window": 2, "max_pending": 0, "flags": "r"}
    assert {gpu.OPTION_FLAGS[f] for f in "gsortl"} == {
        "swap_gradients",
        "split_sums",
        "order_updates",
        "recompute",
        "drop_tiles",
        "layout_optimizer",
    }
    assert gpu.parse_variant("budget/l")[1]["flags"] == "l"
    assert gpu.parse_variant("budget/t/s")[1]["flags"] == "st"
    assert gpu.parse_variant("plain/p8")[1]["max_pending"] == 8
    bad_variants = (
        "plain/g",
        "plain/w2",
        "budget/g/g",
        "budget/w2/w4",
        "budget/x",
        "budget/g2",
        "budget/p",
        "budget/t",
        "plain/l",
    )
    for bad in bad_variants:
        with pytest.raises(gpu.argparse.ArgumentTypeError, match=re.escape(repr(bad))):
            gpu.parse_variant(bad)


def test_an_attempt_that_never_started_on_the_gpu_bounds_nothing():
    runs = [{"variant": "budget", "batch": b, "ok": True} for b in (120, 136)]
    runs += [{"variant": "budget", "batch": 128, "ok": False, "start_failed": True}]
    runs += [{"variant": "budget", "batch": 152, "ok": False, "oom": True}]
    assert gpu.largest_trained(runs, "budget") == (136, 152)
    runs[-1]["start_failed"] = True
    assert gpu.largest_trained(runs, "budget") == (136, None)
    never = gpu.failed_attempt("InternalError: cudaSetDevice() on GPU:0 failed. Status: out of memory", 1, "")
    assert never["start_failed"] and not never["oom"]
    late = gpu.failed_attempt("Aborted", -6, gpu.STARTED)  # died after it started: a failure under its cap
    assert "start_failed" not in late and "planned" not in late


def test_a_timed_out_attempt_keeps_its_partial_output_and_is_not_out_of_memory(monkeypatch):
    def run(cmd, **kwargs):  # what subprocess.run raises: partial output as bytes, even with text=True
        out = f'{gpu.STARTED}\n{gpu.PLANNED}{{"swaps": 5}}\n'.encode()
        raise gpu.subprocess.TimeoutExpired(cmd, kwargs["timeout"], output=out, stderr=b"step 1\n")

    monkeypatch.setattr(gpu.subprocess, "run", run)
    args = gpu.argparse.Namespace(model="ResNet50", image_size=224)
    r = gpu._subprocess(args, [], 7)  # noqa: SLF001
    assert r["timed_out"] and not r["oom"] and "start_failed" not in r and r["planned"] == {"swaps": 5}
    assert r["error"][-1] == "timed out after 7 s"
