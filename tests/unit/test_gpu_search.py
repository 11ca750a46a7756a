"""benchmarks/gpu.py's search arithmetic, which runs before any GPU is touched: its doctests,
and the second round of a search (between the largest batch that trained and the smallest
that did not, or above it when every batch tried trained)."""

import doctest
import importlib.util
import re
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("gpu_bench", Path(__file__).parents[2] / "benchmarks" / "gpu.py")
gpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu)


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
    assert {gpu.OPTION_FLAGS[f] for f in "gsor"} == {"swap_gradients", "split_sums", "order_updates", "recompute"}
    for bad in ("plain/g", "budget/g/g", "budget/x", "budget/g2"):
        with pytest.raises(gpu.argparse.ArgumentTypeError, match=re.escape(repr(bad))):
            gpu.parse_variant(bad)
