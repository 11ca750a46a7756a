"""Autotuning to a memory budget on hand-built graphs (simulator; no TensorFlow)."""

import dataclasses

import numpy as np
import pytest

import tflms
from tflms import BudgetError, Knobs, LMSConfig, Simulator, make_plan
from tflms.config import parse_bytes
from tflms.plan.planner import candidate_swaps

from graphs import chain_model

pytestmark = pytest.mark.unit

HOST = "/device:CPU:0"


@pytest.mark.parametrize(
    "text, expected",
    [("16GiB", 16 * 2**30), ("1.5 GiB", 3 * 2**29), ("500MB", 500 * 10**6), ("64k", 65536), ("123", 123), (7, 7)],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "GiB", "12 parsecs", "-5GiB", 0, -1, True, 1.5, "0B"])
def test_bad_budget_names_the_argument(bad):
    with pytest.raises(ValueError, match="budget=") as err:
        LMSConfig(budget=bad)
    assert "Received" in str(err.value)


def test_prefix_peaks_match_fresh_simulations():
    model = chain_model(n_fwd=10, variable_bytes=64)
    swaps = candidate_swaps(model, LMSConfig(knobs=Knobs(swapout_threshold=2, swapin_ahead=2, min_bytes=0)))
    assert len(swaps) >= 5
    sim = Simulator(model)
    expected = [tflms.simulate(model, swaps[:n]).peak_bytes for n in range(len(swaps) + 1)]
    assert list(sim.prefix_peaks(swaps)) == expected


def _budgets(model):
    sim = Simulator(model, HOST)
    plain = sim.peak()
    with pytest.raises(BudgetError) as err:
        make_plan(model, LMSConfig(budget=1, knobs=Knobs(min_bytes=0)))
    best = err.value.best_peak_bytes
    assert best < plain
    return plain, best


def test_budgets_on_a_hand_built_chain():
    model = chain_model(n_fwd=12, variable_bytes=1000)
    plain, best = _budgets(model)
    for budget in (plain + 1, plain, (plain + best) // 2, best):
        plan = make_plan(model, LMSConfig(budget=budget, knobs=Knobs(min_bytes=0)))
        assert plan.peak_bytes_after <= budget
        assert plan.options["budget"] == budget
        # The chosen knobs are recorded and reproduce the plan without a budget.
        again = make_plan(model, LMSConfig.from_dict({**plan.options, "budget": None}))
        assert again.swaps == plan.swaps
    assert make_plan(model, LMSConfig(budget=plain, knobs=Knobs(min_bytes=0))).swaps == ()
    with pytest.raises(BudgetError) as err:
        make_plan(model, LMSConfig(budget=best - 1, knobs=Knobs(min_bytes=0)))
    assert err.value.best_peak_bytes == best and err.value.plain_peak_bytes == plain
    assert f"budget={best - 1}" in str(err.value)
    assert isinstance(err.value, ValueError)


def test_tighter_budgets_move_more_bytes():
    model = chain_model(n_fwd=12)
    plain, best = _budgets(model)
    moved = []
    for budget in np.linspace(plain - 1, best, 5).astype(int):
        plan = make_plan(model, LMSConfig(budget=int(budget), knobs=Knobs(min_bytes=0)))
        moved.append(sum(s.bytes * (1 + len(s.swap_ins)) for s in plan.swaps))
    assert moved == sorted(moved) and moved[0] < moved[-1]


def test_config_replace_keeps_validation():
    with pytest.raises(ValueError, match="budget="):
        dataclasses.replace(LMSConfig(), budget="nope")


def test_batch_size_result_prints_the_budget_in_both_units():
    si = tflms.BatchSizeResult(budget=16 * 10**9, without_lms=10, with_lms=30, limit=1024)
    binary = tflms.BatchSizeResult(budget=16 * 2**30, without_lms=10, with_lms=30, limit=1024)
    assert str(si).startswith("largest batch within 14.9 GiB = 16.0 GB (simulator prediction): 10 without LMS")
    assert str(binary).startswith("largest batch within 16.0 GiB = 17.2 GB (simulator prediction)")
    assert str(tflms.BatchSizeResult(budget=500, without_lms=0, with_lms=0, limit=8)).startswith(
        "largest batch within 500 B (simulator prediction): 0 without LMS, 0 with LMS"
    )


def _fragmenting_model():
    """Buffers of 1, 3, 6, 12, 24 and 48 MiB, each freed right after its op (see
    ``test_a_peak_within_the_limit_can_still_leave_a_large_tensor_no_chunk``): 64 MiB predicted,
    and under 100 MiB the 48 MiB buffer finds no chunk. A backward op makes it a training step,
    with nothing to swap."""
    from graphs import f32, op

    mib = 1 << 20
    ops = [op("x", "Placeholder", outputs=[f32(64)]), op("gradient_tape/g", "Neg", ["x:0"], [f32(64)])]
    ops += [op(f"op{n}", "Relu", outputs=[f32(n * mib // 4)]) for n in (1, 3, 6, 12, 24, 48)]
    return tflms.GraphModel.from_ops(ops, name="fragmenting")


def test_a_budget_whose_largest_tensor_finds_no_chunk_warns():
    """The predicted peak (64 MiB) fits 100 MiB with less room than the 48 MiB tensor, and the
    allocations do not fit (:meth:`Simulator.unplaced`): the plan says so in a warning; under
    128 MiB, with room for it and every buffer placed, it does not."""
    assert Simulator(_fragmenting_model()).unplaced(limit=100 << 20) == 48 << 20
    import warnings

    model = _fragmenting_model()
    assert Simulator(model).peak() <= 100 << 20
    with pytest.warns(tflms.LMSWarning, match=r"less room than the step's largest tensor \(48.0 MiB\)"):
        plan = make_plan(model, LMSConfig(budget="100MiB"))
    assert plan.swaps == () and "fits the budget" in plan.reason
    with warnings.catch_warnings():
        warnings.simplefilter("error", tflms.LMSWarning)
        assert make_plan(model, LMSConfig(budget="128MiB")).swaps == ()


def test_on_budget_miss_best_warns_and_plans_with_the_lowest_plan():
    model = chain_model(n_fwd=12, variable_bytes=1000)
    plain, best = _budgets(model)
    with pytest.raises(BudgetError):
        make_plan(model, LMSConfig(budget=best - 1, knobs=Knobs(min_bytes=0)))
    with pytest.warns(tflms.LMSWarning, match=r"best plan's predicted peak is .*on_budget_miss='best'") as caught:
        plan = make_plan(model, LMSConfig(budget=best - 1, knobs=Knobs(min_bytes=0), on_budget_miss="best"))
    assert len(caught) == 1
    # The lowest plan of the search, as a budget it meets would give it, recorded as used.
    assert plan.peak_bytes_after == best < plain
    lowest = make_plan(model, LMSConfig(budget=best, knobs=Knobs(min_bytes=0)))
    assert plan.swaps == lowest.swaps and plan.orders == lowest.orders
    assert plan.options["on_budget_miss"] == "best" and plan.options["budget"] == best - 1
    # Where a plan fits, on_budget_miss changes nothing, not even the plan's options or fingerprint.
    assert make_plan(model, LMSConfig(budget=best, knobs=Knobs(min_bytes=0), on_budget_miss="best")) == lowest
    assert make_plan(model, LMSConfig(budget=plain, knobs=Knobs(min_bytes=0), on_budget_miss="best")).options == (
        make_plan(model, LMSConfig(budget=plain, knobs=Knobs(min_bytes=0))).options
    )
