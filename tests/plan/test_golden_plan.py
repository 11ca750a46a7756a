"""The plan of a real Keras training step against a golden JSON.

A change in tracing, the graph model, the simulator or the planner that changes what a
real step's plan swaps, where it brings it back or the peaks it predicts shows up here as
a diff of ``tests/data/golden_plan_cnn.json``. When the change is intended, regenerate the
file and commit it with the change::

    TFLMS_REGEN_GOLDEN=1 .venv/bin/python -m pytest -q tests/plan/test_golden_plan.py

The model names every layer, the model and the optimizer, so the traced op names do not
depend on Keras's name counters (on what else the process built before).
"""

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tflms
from tflms import Knobs, LMSConfig, SwapPlan, make_plan
from tflms.testing.zoo import train_step_of

from conftest import TESTS

pytestmark = pytest.mark.integration

GOLDEN = TESTS / "data" / "golden_plan_cnn.json"
OPTIONS = {"knobs": Knobs(swapout_threshold=20, swapin_ahead=4, swapin_groupby=2, min_bytes=1024), "policy": "none"}
BATCH = 8


def golden_cnn_plan() -> SwapPlan:
    keras.utils.set_random_seed(0)
    L = keras.layers
    layers = [keras.Input((32, 32, 3), name="image")]
    for i, filters in enumerate((16, 32, 32, 64)):
        layers += [
            L.Conv2D(filters, 3, padding="same", name=f"conv{i}"),
            L.BatchNormalization(name=f"bn{i}"),
            L.ReLU(name=f"relu{i}"),
        ]
        if i % 2:
            layers.append(L.MaxPooling2D(name=f"pool{i}"))
    layers += [L.GlobalAveragePooling2D(name="gap"), L.Dense(10, name="logits")]
    model = keras.Sequential(layers, name="golden_cnn")
    optimizer = keras.optimizers.Adam(1e-3, name="adam")
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, name="xent")

    train_step = train_step_of(model, loss_fn, optimizer)

    x = tf.TensorSpec((BATCH, 32, 32, 3), tf.float32)
    y = tf.TensorSpec((BATCH,), tf.int32)
    cf = tf.function(train_step).get_concrete_function(x, y)
    return make_plan(tflms.GraphModel.from_func_graph(cf.graph), LMSConfig(**OPTIONS))


def test_plan_of_a_real_cnn_matches_the_golden_json():
    plan = golden_cnn_plan()
    if os.environ.get("TFLMS_REGEN_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(plan.to_json() + "\n")
    assert GOLDEN.exists(), f"{GOLDEN} is missing: regenerate it with TFLMS_REGEN_GOLDEN=1 (see this module)"
    golden = SwapPlan.from_json(GOLDEN.read_text())
    # A plan worth pinning: several swaps, a lower predicted peak.
    assert len(golden.swaps) >= 3 and golden.peak_bytes_after < golden.peak_bytes_before
    assert json.loads(plan.to_json()) == json.loads(GOLDEN.read_text()), (
        "the CNN's plan differs from tests/data/golden_plan_cnn.json; if the planning change is intended, "
        "regenerate it: TFLMS_REGEN_GOLDEN=1 .venv/bin/python -m pytest -q tests/plan/test_golden_plan.py"
    )
    assert plan == golden and plan.fingerprint() == golden.fingerprint()


def test_the_golden_model_plans_the_same_twice_in_one_process():
    # Built again after other models: the names (and so the plan) do not depend on Keras's counters.
    keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])  # bumps the name counters
    first, second = golden_cnn_plan(), golden_cnn_plan()
    assert first.to_json() == second.to_json()
    assert np.all([s.bytes > 0 for s in first.swaps])
