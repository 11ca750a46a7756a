"""Plans of a real Keras step with the planner's fast paths and without them: the same, byte for byte.

The fast paths (``tests/emulate/test_fast_paths.py`` checks each on hand-built graphs) are
turned off here one by one, so that each falls back to the computation it replaces: the fused
ops' reach searched per fused op, the executor's view of an ordered step made afresh, the
push-down's full pass, networkx's own DAG copy. Each model is built from the traced graph
afresh, so that no cache of one run serves the other.
"""

import json

import pytest
import tensorflow as tf

import tflms
from tflms.emulate import fusion, grappler, simulator
from tflms.ir import graph as graph_module
from tflms.testing.zoo import build

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def resnet_step():
    built = build("resnet50", batch=4, size=32)  # the model stays referenced: the step's variables
    _, x, y, train_step = built
    yield tf.function(train_step).get_concrete_function(x, y)
    del built


def _reference(monkeypatch):
    monkeypatch.setattr(fusion, "_reach_masks", lambda successors, sources: None)
    monkeypatch.setattr(simulator, "seed_ready_structure", lambda parent, child, edges: None)
    monkeypatch.setattr(grappler, "_has_nested_family", lambda model: True)
    monkeypatch.setattr(graph_module, "copy_dag", lambda dag: dag.copy())


def _plans(step, configs):
    return [json.loads(tflms.make_plan(tflms.GraphModel.from_func_graph(step.graph), c).to_json()) for c in configs]


def test_plans_with_and_without_the_fast_paths_are_the_same(resnet_step, monkeypatch):
    plain = tflms.Simulator(tflms.GraphModel.from_func_graph(resnet_step.graph)).peak()
    # The default options without a budget (the memory-aware schedule), and budgets that the
    # autotuner meets with swaps alone, with ordering edges, and not at all ('best').
    configs = [tflms.LMSConfig()] + [
        tflms.LMSConfig(budget=int(plain * f), on_budget_miss="best") for f in (0.8, 0.6, 0.45)
    ]
    fast = _plans(resnet_step, configs)
    with monkeypatch.context() as m:
        _reference(m)
        reference = _plans(resnet_step, configs)
    assert fast == reference
    # Every plan swaps, and the budgets tune different plans. (This step gets no ordering edge:
    # the schedule's search runs and keeps none; tests/emulate/test_fast_paths.py checks the
    # ordered simulator's fast path on its own.)
    assert all(p["swaps"] for p in fast) and len({json.dumps(p["swaps"]) for p in fast}) > 1
