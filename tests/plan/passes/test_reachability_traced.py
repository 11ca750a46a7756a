# ruff: noqa: SLF001  (this module tests the schedule's private reachability fast paths)
"""The schedule's reachability fast paths against networkx on traced zoo steps, ordering edges added.

``_has_path`` (a topological order of the DAG, kept per DAG, prunes the search) must answer as
``nx.has_path``, and ``_closes_cycle`` / ``_acyclic`` as ``nx.is_directed_acyclic_graph`` of a
copy with the edges added, so that the schedule's passes make the same plans.
"""

import random

import networkx as nx
import pytest
import tensorflow as tf

import tflms
from tflms.emulate.simulator import Simulator
from tflms.ir.decisions import Order
from tflms.ir.graph import with_order_edges
from tflms.plan.passes import schedule
from tflms.testing.zoo import build

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=["cnn", "resnet50"])
def traced(request):
    built = build(request.param, batch=4, size=32)  # the model stays referenced: the step's variables
    model, x, y, train_step = built
    cf = tf.function(train_step).get_concrete_function(x, y)
    return tflms.GraphModel.from_func_graph(cf.graph), built


def _backward(model):
    return sorted(op for op in model.dag if model.phase(op) == "backward")


def _ordered(model, rng, count=12):
    """The model with ``count`` ordering edges between backward ops that keep it acyclic (as the
    schedule's orders do), the later op in a topological order waiting for the earlier."""
    topo = {op: i for i, op in enumerate(nx.topological_sort(model.dag))}
    ops = _backward(model)
    orders = set()
    while len(orders) < count:
        a, b = rng.sample(ops, 2)
        a, b = sorted((a, b), key=topo.__getitem__)
        orders.add(Order(op=b, after=a))
    return with_order_edges(model, sorted(orders))


def _pairs(dag, rng, count=300):
    """Pairs of ops: half with a path between them (a descendant), half drawn at random (both ways)."""
    ops = sorted(dag)
    pairs = []
    while len(pairs) < count:
        u = rng.choice(ops)
        below = sorted(nx.descendants(dag, u))
        if below and len(pairs) % 2 == 0:
            v = rng.choice(below)
            pairs += [(u, v), (v, u)]
        else:
            pairs.append((u, rng.choice(ops)))
    return pairs + [(ops[0], ops[0])]


def test_has_path_answers_as_networkx_with_and_without_orders(traced):
    model, _ = traced
    rng = random.Random(0)
    for dag in (model.dag, _ordered(model, rng).dag, Simulator(model).executed.dag):
        pairs = _pairs(dag, rng)
        got = [schedule._has_path(dag, u, v) for u, v in pairs]
        assert got == [nx.has_path(dag, u, v) for u, v in pairs]
        assert any(got) and not all(got)


def test_has_path_sees_an_op_added_to_a_dag_it_has_answered_for(traced):
    model, _ = traced
    dag = model.dag.copy()
    topo = list(nx.topological_sort(dag))
    first, last = topo[0], topo[-1]
    assert not schedule._has_path(dag, last, first)
    dag.add_edges_from([(last, "new"), ("new", first)])  # the index kept for the DAG is stale now
    assert schedule._has_path(dag, last, first) == nx.has_path(dag, last, first) is True


def _reference_closes_cycle(dag, edges):
    g = nx.DiGraph(dag.edges)
    g.add_edges_from(edges)
    return not nx.is_directed_acyclic_graph(g)


def test_closes_cycle_and_acyclic_answer_as_networkx(traced):
    model, _ = traced
    rng = random.Random(1)
    ordered = _ordered(model, rng)
    sim = Simulator(ordered)
    ops = _backward(model)
    topo = {op: i for i, op in enumerate(nx.topological_sort(ordered.dag))}
    seen = set()
    for trial in range(60):
        edges = []
        for _ in range(1 + trial % 5):
            a, b = rng.sample(ops, 2)
            if trial % 3 == 0:  # forward in a topological order: the fast path
                a, b = sorted((a, b), key=topo.__getitem__)
            edges.append((a, b))
        if trial % 7 == 0:
            edges.append((ops[0], "not_an_op_of_the_step"))
        orders = [Order(op=b, after=a) for a, b in edges]
        expected = _reference_closes_cycle(ordered.dag, edges)
        seen.add(expected)
        assert schedule._closes_cycle(ordered.dag, edges) == expected
        acyclic = not any(_reference_closes_cycle(d, edges) for d in (sim.model.dag, sim.executed.dag))
        assert schedule._acyclic(sim, [], orders) == acyclic
    assert seen == {True, False}
