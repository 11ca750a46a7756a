"""Autotuning to a memory budget and the largest batch that fits one (simulator)."""

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

import tflms
from tflms import BudgetError, LMSConfig, Simulator, make_plan
from tflms.config import parse_bytes
from tflms.planner import candidate_swaps

import zoo
from conftest import DEVICE, HOST
from graphs import chain_model
from helpers import check_structure


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
    swaps = candidate_swaps(model, LMSConfig(swapout_threshold=2, swapin_ahead=2, min_bytes=0))
    assert len(swaps) >= 5
    sim = Simulator(model)
    expected = [tflms.simulate(model, swaps[:n]).peak_bytes for n in range(len(swaps) + 1)]
    assert list(sim.prefix_peaks(swaps)) == expected


def _budgets(model):
    sim = Simulator(model, HOST)
    plain = sim.peak()
    with pytest.raises(BudgetError) as err:
        make_plan(model, LMSConfig(budget=1))
    best = err.value.best_peak_bytes
    assert best < plain
    return plain, best


def test_budgets_on_a_hand_built_chain():
    model = chain_model(n_fwd=12, variable_bytes=1000)
    plain, best = _budgets(model)
    for budget in (plain + 1, plain, (plain + best) // 2, best):
        plan = make_plan(model, LMSConfig(budget=budget, min_bytes=0))
        assert plan.peak_bytes_after <= budget
        assert plan.options["budget"] == budget
        # The chosen knobs are recorded and reproduce the plan without a budget.
        again = make_plan(model, LMSConfig.from_dict({**plan.options, "budget": None}))
        assert again.swaps == plan.swaps
    assert make_plan(model, LMSConfig(budget=plain, min_bytes=0)).swaps == ()
    with pytest.raises(BudgetError) as err:
        make_plan(model, LMSConfig(budget=best - 1, min_bytes=0))
    assert err.value.best_peak_bytes == best and err.value.plain_peak_bytes == plain
    assert f"budget={best - 1}" in str(err.value)
    assert isinstance(err.value, ValueError)


def test_tighter_budgets_move_more_bytes():
    model = chain_model(n_fwd=12)
    plain, best = _budgets(model)
    moved = []
    for budget in np.linspace(plain - 1, best, 5).astype(int):
        plan = make_plan(model, LMSConfig(budget=int(budget), min_bytes=0))
        moved.append(sum(s.bytes * (1 + len(s.swap_ins)) for s in plan.swaps))
    assert moved == sorted(moved) and moved[0] < moved[-1]


@pytest.fixture(scope="module")
def resnet_model():
    setup = zoo.resnet50(batch=16, size=128)
    cf = tf.function(setup.step_fn()).get_concrete_function(setup.x, setup.y)
    return tflms.GraphModel.from_func_graph(cf.graph), setup


def test_resnet50_budgets_fit_and_the_impossible_one_reports_the_best(resnet_model):
    model, _ = resnet_model
    plain, best = _budgets(model)
    assert best < 0.8 * plain
    for frac in (0.9, 0.6, 0.3, 0.0):
        budget = int(best + frac * (plain - best))
        plan = make_plan(model, LMSConfig(budget=budget))
        assert plan.peak_bytes_after <= budget, frac
        assert plan.peak_bytes_before == plain
        assert len(plan.swaps) == plan.options["n_tensors"] >= 1
    with pytest.raises(BudgetError) as err:
        make_plan(model, LMSConfig(budget=best - 1))
    assert err.value.best_peak_bytes == best


def test_budget_through_tflms_function_trains_identically():
    setup = zoo.cnn()
    fn = setup.step_fn()
    cf = tf.function(fn).get_concrete_function(setup.x, setup.y)
    plain_peak = Simulator(tflms.GraphModel.from_func_graph(cf.graph), HOST).peak()
    budget = int(0.85 * plain_peak)
    lms = tflms.function(fn, device=DEVICE, budget=budget)
    losses, variables = zoo.run_steps(setup, lms, n=2)
    ref_losses, ref_vars = zoo.run_steps(setup, tf.function(fn), n=2)
    np.testing.assert_array_equal(losses, ref_losses)
    for a, b in zip(variables, ref_vars):
        np.testing.assert_array_equal(a, b)
    plan = lms.get_plan(setup.x, setup.y)
    assert plan.peak_bytes_after <= budget < plan.peak_bytes_before
    check_structure(lms.get_concrete_function(setup.x, setup.y), plan, DEVICE, HOST)
    with pytest.raises(BudgetError):
        tflms.function(fn, device=DEVICE, budget=1000).get_plan(setup.x, setup.y)


def test_max_batch_size_of_a_compiled_keras_model():
    keras.utils.set_random_seed(0)
    L = keras.layers
    model = keras.Sequential(
        [keras.Input((32, 32, 3))]
        + [layer for f in (32, 64, 64) for layer in (L.Conv2D(f, 3, padding="same"), L.BatchNormalization(), L.ReLU())]
        + [L.GlobalAveragePooling2D(), L.Dense(10)]
    )
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    budget = 64 * 2**20
    result = tflms.max_batch_size(model, budget, limit=4096)
    assert 1 <= result.without_lms < result.with_lms <= 4096
    assert "simulator" in str(result) and f"{result.without_lms} without LMS" in str(result)
    step = tflms.autotune.keras_train_step(model)

    def peak(batch):
        return Simulator(tflms.GraphModel.from_func_graph(step.graph, batch_size=batch), HOST).peak()

    assert peak(result.without_lms) <= budget < peak(result.without_lms + 1)
    # With LMS, the autotuner fits the largest batch and not the next one.
    model_at = tflms.GraphModel.from_func_graph(step.graph, batch_size=result.with_lms)
    assert make_plan(model_at, LMSConfig(budget=budget)).peak_bytes_after <= budget
    model_after = tflms.GraphModel.from_func_graph(step.graph, batch_size=result.with_lms + 1)
    with pytest.raises(BudgetError):
        make_plan(model_after, LMSConfig(budget=budget))
    with pytest.raises(ValueError, match="budget="):
        tflms.max_batch_size(model, "lots")
    with pytest.raises(TypeError, match="step must be"):
        tflms.max_batch_size(42, budget)


def test_config_replace_keeps_validation():
    with pytest.raises(ValueError, match="budget="):
        dataclasses.replace(LMSConfig(), budget="nope")
