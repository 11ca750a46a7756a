# ruff: noqa: SLF001  (this module tests the private fast paths themselves)
"""The planner's fast paths against the plain computations they stand for, on hand-built graphs.

Each fast path must give exactly what the computation it replaces gives, so that plans stay
the same: the fused ops' reach (one pass of bit masks instead of a search per fused op), the
executor's view of an ordered step (derived from its parent's instead of made afresh), and
the constant push-down's early exit and its model (rewired in place, not built again).
"""

import random

import networkx as nx
import pytest

from tflms import Knobs, LMSConfig
from tflms.emulate import fusion, order
from tflms.emulate.fusion import _fused_reach, _reach_masks, _successors_with, joins_fused
from tflms.emulate.grappler import _has_nested_family, with_constant_pushdown
from tflms.emulate.simulator import Simulator
from tflms.ir.decisions import Order
from tflms.ir.graph import GraphModel, copy_dag, op_records, reach, with_order_edges
from tflms.plan.autotune import serialized_search

from graphs import chain_model, chained_pushdown_model, f32, op, variable_update_model

pytestmark = pytest.mark.unit


def _searched(successors, sources):
    """The reference: one search per source (what _fused_reach did for every fused op)."""
    found: dict[str, set[str]] = {}
    for p in sources:
        for n in reach(successors, {p}) | {p}:
            found.setdefault(n, set()).add(p)
    return {n: frozenset(ps) for n, ps in found.items()}


def _random_dag(seed: int, n: int = 60, p: float = 0.08) -> nx.DiGraph:
    rng = random.Random(seed)
    dag = nx.DiGraph()
    dag.add_nodes_from(f"n{i}" for i in range(n))
    dag.add_edges_from((f"n{i}", f"n{j}") for i in range(n) for j in range(i + 1, n) if rng.random() < p)
    return dag


@pytest.mark.parametrize("seed", range(20))
def test_reach_masks_give_what_a_search_per_source_gives(seed):
    dag = _random_dag(seed)
    rng = random.Random(seed)
    sources = rng.sample(sorted(dag), 8)
    extra: dict[str, list[str]] = {}
    for _ in range(5):  # edges besides the DAG's, forward in the node order (no cycle), some repeated
        i, j = sorted(rng.sample(range(60), 2))
        extra.setdefault(f"n{i}", []).extend([f"n{j}"] * rng.choice((1, 2)))

    def successors(n):
        return [*dag.successors(n), *extra.get(n, ())]

    masks = _reach_masks(successors, sources)
    assert masks is not None
    decoded = {n: frozenset(sources[k] for k in range(len(sources)) if bits >> k & 1) for n, bits in masks.items()}
    assert decoded == _searched(successors, sources)


def test_reach_masks_refuse_a_cycle_and_the_reach_falls_back_to_the_search():
    dag = nx.DiGraph([("a", "b"), ("b", "c"), ("c", "d")])
    cyclic = {"c": ["a"]}

    def successors(n):
        return [*dag.successors(n), *cyclic.get(n, ())]

    assert _reach_masks(successors, ["a", "d"]) is None
    assert _reach_masks(dag.successors, ["a", "d"]) == {"a": 1, "b": 1, "c": 1, "d": 3}


def _fused_model() -> GraphModel:
    out = [f32(4)]
    return GraphModel.from_ops(
        [
            op("dy", "Fill", outputs=out),
            op("gradients/b", "BiasAddGrad", ["dy:0"], out),
            op("gradients/x", "Neg", ["gradients/b:0"], out),
            op("gradients/y", "Neg", ["dy:0"], out),
            op("gradients/w", "Conv2DBackpropFilter", ["gradients/y:0", "dy:0", "dy:0"], out),
            op("gradients/z", "Neg", ["dy:0"], out),
            op("gradients/b2", "BiasAddGrad", ["gradients/z:0"], out),
            op("gradients/w2", "Conv2DBackpropFilter", ["gradients/x:0", "dy:0", "gradients/z:0"], out),
        ]
    )


@pytest.mark.parametrize(
    "context",
    [(), (("gradients/x", "gradients/z"),), (("gradients/w", "gradients/b2"), ("gradients/b2", "gradients/y"))],
)
def test_the_fused_reach_is_the_search_per_fused_op_with_and_without_a_cycle(context):
    model = _fused_model()
    partners = fusion.fused_partners(model)
    assert sorted(partners) == ["gradients/b", "gradients/b2", "gradients/w", "gradients/w2"]
    expected = _searched(_successors_with(model, context), list(partners))
    got = _fused_reach(model, context)
    assert dict(got) == expected  # the last context closes a cycle: the search itself then
    pairs = [("gradients/x", "gradients/y"), ("gradients/y", "gradients/x"), ("gradients/z", "gradients/w2")]
    for edge in pairs:
        fresh = _fused_model()  # its own cache: the reference path on a model of its own
        original = fusion._reach_masks
        try:
            fusion._reach_masks = lambda successors, sources: None
            reference = joins_fused(fresh, [edge], context)
        finally:
            fusion._reach_masks = original
        assert joins_fused(model, [edge], context) == reference


def _update_feeder_model() -> GraphModel:
    """Forward ops of which two only feed the update (a slot read and its scale), a backward pass
    of two branches, and the update."""
    res = ("resource", (), 0, False)
    g = "gradient_tape/"
    return GraphModel.from_ops(
        [
            op("w", "Placeholder", outputs=[res]),
            op("slot", "Placeholder", outputs=[res]),
            op("x", "Placeholder", outputs=[f32(10)]),
            op("read", "ReadVariableOp", ["w:0"], [f32(10)]),
            op("slot_read", "ReadVariableOp", ["slot:0"], [f32(10)]),
            op("scale", "Mul", ["slot_read:0", "slot_read:0"], [f32(10)]),
            op("y", "MatMul", ["x:0", "read:0"], [f32(10)]),
            op(g + "dy", "Relu", ["y:0"], [f32(10)]),
            op(g + "a", "Mul", [g + "dy:0", "x:0"], [f32(10)]),
            op(g + "b", "Mul", [g + "dy:0", "read:0"], [f32(10)]),
            op(g + "dw", "AddV2", [g + "a:0", g + "b:0"], [f32(10)]),
            op("adam/m", "AssignAddVariableOp", ["slot:0", "scale:0"], []),
            op("adam/update", "AssignSubVariableOp", ["w:0", g + "dw:0"], []),
        ]
    )


@pytest.mark.parametrize(
    "edges, seeded",
    [
        ([("gradient_tape/b", "gradient_tape/a")], True),  # backward to backward: derived
        ([("gradient_tape/a", "gradient_tape/b"), ("gradient_tape/dy", "gradient_tape/b")], True),
        ([("gradient_tape/a", "adam/m")], True),  # into the update, which no feeder waits for
        ([("y", "gradient_tape/a")], False),  # from a forward op: made afresh
        ([("gradient_tape/a", "scale")], False),  # into a feeder: made afresh
    ],
)
def test_an_ordered_steps_executor_view_is_derived_only_where_it_is_the_fresh_one(edges, seeded):
    model = _update_feeder_model()
    assert order._ready_structure(model.dag)[3] == ["slot", "slot_read", "scale"]  # the update's feeders
    orders = [Order(op=v, after=u) for u, v in edges]
    child = with_order_edges(model, orders)
    order.seed_ready_structure(model.dag, child.dag, edges)
    derived = order._READY_STRUCTURES.get(child.dag)
    assert (derived is not None) == seeded
    if derived is not None:
        del order._READY_STRUCTURES[child.dag]
        assert order._ready_structure(child.dag) == derived[1:]  # the view made afresh
        assert order.ready_order(child) == order.ready_order(model, edges)
    elif ("gradient_tape/a", "scale") in edges:  # the feeders change: the parent's view would be wrong
        assert order.ready_order(child) != order.ready_order(model, edges)


def test_an_ordered_simulator_predicts_what_a_simulator_of_the_ordered_step_predicts():
    model = _update_feeder_model()
    orders = [Order(op="gradient_tape/a", after="gradient_tape/b")]
    ordered = Simulator(model)._ordered(orders)
    fresh = Simulator(with_order_edges(model, orders))
    assert ordered.order == fresh.order
    assert ordered.peak() == fresh.peak() and ordered.requested_peak() == fresh.requested_peak()


def test_a_simulator_keeps_what_its_orders_made_and_it_is_what_is_made_afresh():
    """``_ordered`` and ``_ordered_requested_peak`` keep what they made for the same orders (the
    autotuner's step 5 asks again for each plan it finishes): the same orders give the same
    simulator, other orders of the same size their own one, each as a simulator made afresh of
    the ordered step predicts; the requested peak of orders is the ordered step's."""
    model = _update_feeder_model()
    sim = Simulator(model)
    a_after_b = (Order(op="gradient_tape/a", after="gradient_tape/b"),)
    b_after_a = (Order(op="gradient_tape/b", after="gradient_tape/a"),)
    fresh = {orders: Simulator(with_order_edges(model, orders)) for orders in (a_after_b, b_after_a)}
    assert fresh[a_after_b].order != fresh[b_after_a].order
    for _ in range(2):  # made, then kept
        for orders in (a_after_b, b_after_a):
            ordered = sim._ordered(orders)
            assert ordered.order == fresh[orders].order and ordered.peak() == fresh[orders].peak()
            assert sim._ordered_requested_peak(orders) == fresh[orders].requested_peak()
    assert sim._ordered(a_after_b) is sim._ordered(a_after_b) is not sim._ordered(b_after_a)
    kept = list(sim._caches.replays.values())  # the replays the requested peaks ran on
    assert sorted(run.order for run in kept) == sorted(fresh[orders].order for orders in fresh)


def test_the_push_down_exits_early_only_where_nothing_can_be_pushed_down():
    pushed = chained_pushdown_model()
    assert _has_nested_family(pushed) and with_constant_pushdown(pushed)[1]
    for model in (chain_model(), variable_update_model()):
        assert not _has_nested_family(model)
        assert with_constant_pushdown(model) == (model, [])


def _same_model(a: GraphModel, b: GraphModel) -> None:
    """Equal in every field and in the order of every dict, each edge's attributes one dict."""
    assert list(a.dag.nodes(data=True)) == list(b.dag.nodes(data=True))
    for n in a.dag:
        assert list(a.dag.succ[n].items()) == list(b.dag.succ[n].items()), n
        assert list(a.dag.pred[n].items()) == list(b.dag.pred[n].items()), n
        assert all(b.dag.succ[n][v] is b.dag.pred[v][n] for v in b.dag.succ[n])
    assert list(a.tensors.items()) == list(b.tensors.items())
    assert list(a.inputs_of.items()) == list(b.inputs_of.items()) and a.outputs_of == b.outputs_of
    assert (a.name, a.variable_bytes, a.variables) == (b.name, b.variable_bytes, b.variables)


def _pushdown_model() -> GraphModel:
    """Push-downs of a sum and a product, one parent with a control input, a constant and a
    forward tensor read by many ops (their order among its consumers moves), and a gradient
    whose product is read before and after its push-down's parent in graph order."""
    g = "gradient_tape/"
    return GraphModel.from_ops(
        [
            op("c", "Const", outputs=[f32(1)]),
            op("x", "Placeholder", outputs=[f32(8)]),
            op("y", "Softmax", ["x:0"], [f32(8)]),
            op("loss", "Sum", ["y:0"], [f32(1)]),
            op(g + "dx", "Fill", ["loss:0"], [f32(8)]),
            op(g + "early", "Relu", ["y:0"], [f32(8)]),
            op(g + "k", "Mul", [g + "dx:0", "y:0"], [f32(8)]),
            op(g + "p", "Mul", [g + "k:0", "c:0"], [f32(8)], control=[g + "early"]),
            op(g + "s", "AddV2", [g + "dx:0", "y:0"], [f32(8)]),
            op(g + "q", "AddV2", ["c:0", g + "s:0"], [f32(8)], control=["y"]),
            op(g + "late", "Mul", ["y:0", "c:0"], [f32(8)]),
            op(g + "out", "AddN", [g + "p:0", g + "q:0", g + "late:0", g + "early:0"], [f32(8)]),
        ],
        variable_bytes=64,
        name="pushdowns",
    )


@pytest.mark.parametrize("build", [_pushdown_model, chained_pushdown_model])
def test_the_pushed_down_model_is_what_from_ops_builds_of_its_records(build):
    """The push-down rewires its ops' inputs in a copy of the model; ``from_ops`` of the rewired
    records (what it built before) gives the same model, and the model given is left as it was."""
    model = build()
    before = GraphModel.from_ops(op_records(model).values(), model.variable_bytes, model.name, model.variables)
    pushed, pairs = with_constant_pushdown(model)
    assert len(pairs) >= 2
    records = op_records(model)
    for name in records:
        records[name]["inputs"] = pushed.inputs_of[name]
    _same_model(GraphModel.from_ops(records.values(), model.variable_bytes, model.name, model.variables), pushed)
    _same_model(before, model)


def test_a_copied_dag_is_networkxs_copy_and_independent_of_the_original():
    model = _update_feeder_model()
    dag = with_order_edges(model, [Order(op="gradient_tape/a", after="gradient_tape/b")]).dag
    mine, theirs = copy_dag(dag), dag.copy()
    assert list(mine.nodes(data=True)) == list(theirs.nodes(data=True))
    assert list(mine.edges(data=True)) == list(theirs.edges(data=True))
    assert all(list(mine.pred[n].items()) == list(theirs.pred[n].items()) for n in dag)
    assert mine.edges["x", "y"] is mine.pred["y"]["x"]  # one attribute dict per edge, as networkx keeps it
    mine.nodes["x"]["level"] = -1
    mine.edges["x", "y"]["control"] = True
    mine.add_edge("gradient_tape/dw", "gradient_tape/dy")
    assert dag.nodes["x"]["level"] != -1 and not dag.edges["x", "y"]["control"]
    assert not dag.has_edge("gradient_tape/dw", "gradient_tape/dy") and nx.is_directed_acyclic_graph(dag)


@pytest.mark.parametrize("budget_kib", [12, 18, 20, 22, 23, 24, 30, 50])
def test_the_capacity_searchs_answer_is_the_autotuners(budget_kib):
    """``serialized_search(..., exists_only=True)`` (what ``max_batch_size`` asks) finds a plan
    exactly where the full search does, on budgets from none fitting to the plain step fitting."""
    model = chain_model(n_fwd=8, variable_bytes=4096)
    config = LMSConfig(knobs=Knobs(min_bytes=1), policy="default")
    budget = budget_kib * 1024
    full = serialized_search(model, config, Simulator(model), budget)
    fast = serialized_search(model, config, Simulator(model), budget, exists_only=True)
    assert (fast[0] is None) == (full[0] is None)
    if full[0] is None:
        assert fast[1:3] == full[1:3]  # the same lowest peak and orders when nothing fits
