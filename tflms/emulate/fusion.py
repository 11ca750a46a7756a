"""oneDNN's fused gradient pairs: which ops run as one kernel, and which new edges would part them."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import networkx as nx

from ..ir.graph import GraphModel, reach

#: A filter gradient and a bias gradient of the same output gradient, which oneDNN's graph pass
#: (TensorFlow's CPU build) runs as one kernel (``_MklNativeConv2DBackpropFilterWithBias``),
#: unless a path joins the two: then each runs alone, and the bias gradient's bits change
#: (``tests/test_tf_internals.py``). No order or trigger of a plan may join them
#: (:func:`fused_partners`). The rule holds for every device: a GPU does not fuse the two, so a
#: plan for one may go without an order it could have had.
FUSED_GRADIENT_TYPES = ("Conv2DBackpropFilter", "BiasAddGrad")


#: Per DAG: (node count when made, the fused pairs, the context edges of the last
#: :func:`_fused_reach`, its result or None). A model's DAG is not edited once made; the node
#: count is a cheap guard (as for ``_READY_STRUCTURES``).
_FUSED: weakref.WeakKeyDictionary[nx.DiGraph, tuple[int, dict[str, frozenset[str]], tuple, Mapping | None]] = (
    weakref.WeakKeyDictionary()
)


def fused_partners(model: GraphModel) -> dict[str, frozenset[str]]:
    """The ops of ``model`` that oneDNN fuses in pairs (:data:`FUSED_GRADIENT_TYPES`), each with
    its partners: a ``Conv2DBackpropFilter`` and the ``BiasAddGrad`` ops of its output gradient
    (its input 2), both ways. Do not modify the result (kept per DAG).

    >>> out = [("float32", (4, 8), 128, False)]
    >>> m = GraphModel.from_ops([
    ...     {"name": "dy", "type": "Fill", "inputs": [], "outputs": out},
    ...     {"name": "x", "type": "Fill", "inputs": [], "outputs": out},
    ...     {"name": "s", "type": "Const", "inputs": [], "outputs": [("int32", (4,), 16, False)]},
    ...     {"name": "gradients/w", "type": "Conv2DBackpropFilter", "inputs": ["x:0", "s:0", "dy:0"], "outputs": out},
    ...     {"name": "gradients/b", "type": "BiasAddGrad", "inputs": ["dy:0"], "outputs": out},
    ... ])
    >>> {op: sorted(p) for op, p in fused_partners(m).items()}
    {'gradients/b': ['gradients/w'], 'gradients/w': ['gradients/b']}
    >>> joins_fused(m, [("gradients/b", "gradients/w")]), joins_fused(m, [("x", "gradients/w")])
    (True, False)
    """
    known = _FUSED.get(model.dag)
    if known is not None and known[0] == model.dag.number_of_nodes():
        return known[1]
    filters, biases = FUSED_GRADIENT_TYPES
    partners: dict[str, set[str]] = {}
    for op, kind in model.dag.nodes(data="type"):
        if kind != biases or not model.inputs_of[op]:
            continue
        for c, i in model.tensors[model.inputs_of[op][0]].consumers:
            if i == 2 and model.dag.nodes[c]["type"] == filters:
                partners.setdefault(op, set()).add(c)
                partners.setdefault(c, set()).add(op)
    result = {op: frozenset(p) for op, p in partners.items()}
    _FUSED[model.dag] = (model.dag.number_of_nodes(), result, (), None)
    return result


def joins_fused(model: GraphModel, edges: Iterable[tuple[str, str]], context: Iterable[tuple[str, str]] = ()) -> bool:
    """Whether adding ``edges`` (``(before, after)`` pairs) to ``model``'s DAG, with the edges of
    ``context`` already there (e.g. the swap-ins' triggers), makes a path from one op of a fused
    pair (:func:`fused_partners`) to its partner: a path through at least one of ``edges``,
    which may start and end anywhere along the way.

    >>> out = [("float32", (4,), 16, False)]
    >>> m = GraphModel.from_ops([
    ...     {"name": "dy", "type": "Fill", "inputs": [], "outputs": out},
    ...     {"name": "b", "type": "BiasAddGrad", "inputs": ["dy:0"], "outputs": out},
    ...     {"name": "x", "type": "Neg", "inputs": ["b:0"], "outputs": out},
    ...     {"name": "y", "type": "Neg", "inputs": ["dy:0"], "outputs": out},
    ...     {"name": "w", "type": "Conv2DBackpropFilter", "inputs": ["y:0", "dy:0", "dy:0"], "outputs": out},
    ...     {"name": "z", "type": "Neg", "inputs": ["dy:0"], "outputs": out},
    ... ])
    >>> joins_fused(m, [("x", "y")]), joins_fused(m, [("y", "x")]), joins_fused(m, [("y", "w")], [("b", "y")])
    (True, False, True)
    >>> joins_fused(m, [("x", "z")]), joins_fused(m, [("z", "w")]), joins_fused(m, [("x", "z"), ("z", "w")])
    (False, False, True)
    """
    context = tuple(context)
    reached_by = _fused_reach(model, context)
    edges = list(edges)
    starts: dict[str, list[str]] = {}
    for u, v in edges:
        if u in reached_by:  # a fused op reaches the edge's start (or is it)
            starts.setdefault(u, []).append(v)
    if not starts:
        return False
    successors = _successors_with(model, [*context, *edges])
    partners = fused_partners(model)
    for u, vs in starts.items():
        targets = {q for p in reached_by[u] for q in partners[p]}
        seen: set[str] = set()
        frontier = list(vs)
        while frontier:  # reach, stopping at a target
            n = frontier.pop()
            if n in targets:
                return True
            if n not in seen:
                seen.add(n)
                frontier.extend(successors(n))
    return False


def _successors_with(model: GraphModel, edges: Sequence[tuple[str, str]]) -> Any:
    """The successors of an op in ``model``'s DAG with ``edges`` added (ops outside it included)."""
    extra: dict[str, list[str]] = {}
    for u, v in edges:
        extra.setdefault(u, []).append(v)

    def successors(n: str) -> list[str]:
        return [*model.dag.successors(n), *extra.get(n, ())] if n in model.dag else extra.get(n, [])

    return successors


def _fused_reach(model: GraphModel, context: tuple[tuple[str, str], ...]) -> Mapping[str, frozenset[str]]:
    """Each op that an op of a fused pair reaches (itself included) in ``model``'s DAG with the
    ``context`` edges, with the fused ops that reach it; kept for the last context per DAG.

    One pass in topological order over what the fused ops reach, each op's set of fused ops
    held as the bits of an int (the union of its predecessors'); where the ``context`` edges
    close a cycle, one search per fused op instead (the same result)."""
    partners = fused_partners(model)
    known = _FUSED[model.dag]
    if known[2] == context and known[3] is not None:
        return known[3]
    successors = _successors_with(model, context)
    masks = _reach_masks(successors, list(partners))
    if masks is None:  # a cycle: the search per fused op
        reached: dict[str, set[str]] = {}
        for p in partners:
            for n in reach(successors, {p}) | {p}:
                reached.setdefault(n, set()).add(p)
        result = {n: frozenset(ps) for n, ps in reached.items()}
    else:
        result = _MaskSets(masks, list(partners))
    _FUSED[model.dag] = (known[0], partners, context, result)
    return result


def _reach_masks(successors: Any, sources: list[str]) -> dict[str, int] | None:
    """For each node that one of ``sources`` reaches through ``successors`` (the sources
    included): the bits ``1 << k`` of the sources ``sources[k]`` that reach it. None where the
    reached nodes hold a cycle."""
    masks = {p: 1 << k for k, p in enumerate(sources)}
    indegree = dict.fromkeys(masks, 0)
    frontier = list(masks)
    while frontier:  # the reached nodes, and their in-degrees among them (repeated edges counted)
        for m in successors(frontier.pop()):
            if m in indegree:
                indegree[m] += 1
            else:
                indegree[m] = 1
                masks[m] = 0
                frontier.append(m)
    ready = [n for n, d in indegree.items() if d == 0]
    done = 0
    while ready:
        n = ready.pop()
        done += 1
        bits = masks[n]
        for m in successors(n):
            masks[m] |= bits
            indegree[m] -= 1
            if indegree[m] == 0:
                ready.append(m)
    return masks if done == len(indegree) else None


class _MaskSets(Mapping[str, frozenset[str]]):
    """``{op: the fused ops that reach it}`` over :func:`_reach_masks`' bits, each set made when read."""

    def __init__(self, masks: dict[str, int], ops: list[str]) -> None:
        self._masks, self._ops = masks, ops

    def __getitem__(self, op: str) -> frozenset[str]:
        bits = self._masks[op]
        found = []
        while bits:
            low = bits & -bits
            found.append(self._ops[low.bit_length() - 1])
            bits ^= low
        return frozenset(found)

    def __contains__(self, op: object) -> bool:
        return op in self._masks

    def __iter__(self) -> Iterator[str]:
        return iter(self._masks)

    def __len__(self) -> int:
        return len(self._masks)
