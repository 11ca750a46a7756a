"""TensorFlow's executor order, emulated: the order in which a step's ops run on one thread."""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import networkx as nx

from ..ir.graph import GraphModel, reach


def ready_order(model: GraphModel, extra_edges: Iterable[tuple[str, str]] = ()) -> list[str]:
    """An order of the ops that follows TensorFlow's executor (depth first).

    First the ops that only feed the optimizer's update (reads of its slots, its
    learning rate): the executor starts every op without inputs at once. Then a stack
    of ready ops: after an op runs, the successors it made ready are pushed, the first
    in graph order on top, so it runs next; ops that were ready earlier wait below.
    Grappler removes ``IdentityN`` ops, so a consumer of one waits only for the ops
    whose outputs it reads through it (Keras's optimizer passes every gradient through
    one ``IdentityN``; each variable's update then runs as soon as its own gradient
    exists, as profiled steps show): the order is topological except for the edges out
    of ``IdentityN`` ops. ``extra_edges``: ``(u, v)`` pairs taken as edges too (the
    order of the model with those control edges, without building it).

    >>> f32 = ("float32", (1,), 4, False)
    >>> op = lambda name, kind, *inputs: {"name": name, "type": kind, "inputs": list(inputs), "outputs": [f32]}
    >>> ops = [op("x", "Relu"), op("gradient_tape/g1", "Relu", "x:0"), op("u1", "AssignSubVariableOp", "n:0"),
    ...        op("gradient_tape/g2", "Relu", "gradient_tape/g1:0"),
    ...        {**op("n", "IdentityN", "gradient_tape/g1:0", "gradient_tape/g2:0"), "outputs": [f32, f32]},
    ...        op("u2", "AssignSubVariableOp", "n:1")]
    >>> ready_order(GraphModel.from_ops(ops))  # u1 runs before g2: it waits for g1 only
    ['x', 'gradient_tape/g1', 'u1', 'gradient_tape/g2', 'n', 'u2']
    """
    dag = model.dag
    extra = list(extra_edges)
    if not extra:  # the step's own order: made once per DAG (each caller gets its own list)
        known = _PLAIN_ORDERS.get(dag)
        if known is None or len(known) != dag.number_of_nodes():
            known = _PLAIN_ORDERS[dag] = _ready_order(dag, [])
        return list(known)
    return _ready_order(dag, extra)


def _ready_order(dag: nx.DiGraph, extra: list[tuple[str, str]]) -> list[str]:
    """:func:`ready_order` of ``dag`` with the ``extra`` edges."""
    index, succ, pending, early = _ready_structure(dag)
    pending = dict(pending)
    if extra:
        succ = dict(succ)  # the lists of the edges' sources are replaced, never changed in place
        for u, v in extra:
            if v not in succ[u]:
                succ[u] = sorted([*succ[u], v], key=index.__getitem__)
                pending[v] += 1
    # What only feeds the optimizer's update (reads of its slots, its learning rate) runs first:
    # the executor starts every op without inputs at once, and each variable's update runs as
    # soon as its gradient exists.
    order = list(early)
    for n in early:
        for c in succ[n]:
            pending[c] -= 1
    skip = set(early)
    stack = sorted((n for n in dag if pending[n] == 0 and n not in skip), key=index.__getitem__, reverse=True)
    while stack:
        n = stack.pop()
        order.append(n)
        ready = [c for c in succ[n] if _done(pending, c)]
        stack.extend(reversed(ready))
    return order


def _ready_structure(dag: nx.DiGraph) -> tuple[dict[str, int], dict[str, list[str]], dict[str, int], list[str]]:
    """``ready_order``'s view of ``dag`` (do not modify): remade when its node count changed."""
    size = dag.number_of_nodes()
    hit = _READY_STRUCTURES.get(dag)
    if hit is not None and hit[0] == size:
        return hit[1], hit[2], hit[3], hit[4]
    index = {n: i for i, n in enumerate(dag.nodes)}
    through = _identity_n_sources(dag)
    successors: dict[str, set[str]] = {n: set() for n in dag}
    for u, v, data in dag.edges(data=True):
        if u in through:
            # Grappler removes an IdentityN: its consumers wait only for what they read through it.
            for t in data["tensors"]:
                successors[_through(through, u, t.index)].add(v)
            if not data["control"]:
                continue
        successors[u].add(v)
    succ = {n: sorted(s, key=index.__getitem__) for n, s in successors.items()}
    pending = dict.fromkeys(dag.nodes, 0)
    for n in dag:
        for c in succ[n]:
            pending[c] += 1
    early = _update_feeders(dag, succ)
    _READY_STRUCTURES[dag] = (size, index, succ, pending, early)
    return index, succ, pending, early


def seed_ready_structure(parent: nx.DiGraph, child: nx.DiGraph, edges: Iterable[tuple[str, str]]) -> None:
    """Cache ``child``'s :func:`ready_order` view from ``parent``'s, where ``child`` is a copy of
    ``parent`` with the control edges ``edges`` (:func:`tflms.ir.graph.with_order_edges`) and
    ``parent``'s view is cached: each edge's target waits for one more op (as ``extra_edges``
    does). Only where the edges leave the update's feeders and their order as they are: no
    edge starts or ends at a forward op, and none ends at a feeder or at an op it waits for
    (then no feeder, nor any op it waits for, gains or loses an edge, and the topological order
    of them that the feeders are listed in is unchanged). Otherwise nothing is cached and the
    view is made from ``child`` when asked."""
    hit = _READY_STRUCTURES.get(parent)
    size = parent.number_of_nodes()
    if hit is None or hit[0] != size or child.number_of_nodes() != size or child in _READY_STRUCTURES:
        return
    _, index, succ, pending, early = hit
    nodes = parent.nodes
    edges = list(edges)
    if any(nodes[u]["phase"] == "forward" or nodes[v]["phase"] == "forward" for u, v in edges):
        return
    waited_for = reach(parent.predecessors, set(early)) | set(early)
    if any(v in waited_for for _, v in edges):
        return
    succ, pending = dict(succ), dict(pending)  # the lists of the edges' sources are replaced, never changed
    for u, v in edges:
        if v not in succ[u]:
            succ[u] = sorted([*succ[u], v], key=index.__getitem__)
            pending[v] += 1
    _READY_STRUCTURES[child] = (size, index, succ, pending, early)


def _identity_n_sources(dag: nx.DiGraph) -> dict[str, dict[int, tuple[str, int]]]:
    """Per ``IdentityN`` op: its input index -> (the op that computes that input, its output index)."""
    through: dict[str, dict[int, tuple[str, int]]] = {}
    for n, op_type in dag.nodes(data="type"):
        if op_type == "IdentityN":
            through[n] = {
                i: (p, t.index)
                for p, _, data in dag.in_edges(n, data=True)
                for t in data["tensors"]
                for c, i in t.consumers
                if c == n
            }
    return through


def _through(through: dict[str, dict[int, tuple[str, int]]], op: str, index: int) -> str:
    """The op that computes output ``index`` of ``op``, looking through ``IdentityN`` ops."""
    while op in through and index in through[op]:
        op, index = through[op][index]
    return op


def _update_feeders(dag: nx.DiGraph, succ: dict[str, list[str]]) -> list[str]:
    """Forward ops that feed only update-phase ops and wait for nothing else (``succ``), topologically ordered."""
    topo = topological_order(dag)
    feeds: set[str] = set()
    for n in reversed(topo):
        if dag.nodes[n]["phase"] == "forward" and succ[n]:
            if all(c in feeds or dag.nodes[c]["phase"] == "update" for c in succ[n]):
                feeds.add(n)
    preds: dict[str, list[str]] = {n: [] for n in dag}
    for n, cs in succ.items():
        for c in cs:
            preds[c].append(n)
    early: list[str] = []
    done: set[str] = set()
    for n in topo:
        if n in feeds and all(p in done for p in preds[n]):
            done.add(n)
            early.append(n)
    return early


def topological_order(dag: nx.DiGraph) -> list[str]:
    """``list(nx.topological_sort(dag))``, made once per DAG (do not modify the list): the
    simulator's static facts and the executor's order each walk a step's ops in it."""
    known = _TOPOLOGICAL_ORDERS.get(dag)
    if known is None or len(known) != dag.number_of_nodes():
        known = _TOPOLOGICAL_ORDERS[dag] = list(nx.topological_sort(dag))
    return known


def _done(pending: dict[str, int], op: str) -> bool:
    pending[op] -= 1
    return pending[op] == 0


#: Per DAG: (node count when made, graph-order index, sorted distinct successors as the
#: executor waits (through IdentityN ops), predecessor counts, the update's feeders that run
#: first). The schedule's search orders one DAG many times (``extra_edges``). A model's DAG is
#: not edited once made (``with_orders`` copies it); the node count is a cheap guard.
_READY_STRUCTURES: weakref.WeakKeyDictionary[nx.DiGraph, tuple[int, dict, dict, dict, list]] = (
    weakref.WeakKeyDictionary()
)

#: Per DAG: :func:`ready_order` without extra edges, and :func:`topological_order`. A model's
#: DAG is not edited once made; the length is a cheap guard.
_PLAIN_ORDERS: weakref.WeakKeyDictionary[nx.DiGraph, list[str]] = weakref.WeakKeyDictionary()
_TOPOLOGICAL_ORDERS: weakref.WeakKeyDictionary[nx.DiGraph, list[str]] = weakref.WeakKeyDictionary()
