"""Grappler's rewrites that change what a step holds, emulated on the graph model: constant push-down."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import networkx as nx

from .._devices import device_key
from ..ir.graph import GraphModel

#: Grappler's constant push-down (``ConstantFolding::ConstantPushDown`` in TF 2.21's
#: ``constant_folding.cc``), commutative case: op types of one associative family.
PUSHDOWN_FAMILIES = {"Mul": "Mul", "Add": "Add", "AddV2": "Add"}


_CONSTANT_OP_TYPES = frozenset({"Const", "HostConst"})


def with_constant_pushdown(model: GraphModel) -> tuple[GraphModel, list[tuple[str, str]]]:
    """``model`` as TensorFlow runs it after Grappler's constant push-down, and the rewritten ``(parent, child)`` pairs.

    Grappler rewrites ``C * (X * Y)`` (``C`` a ``Const``, the inner product read only by
    the outer one) into ``X * (C * Y)``, and likewise for ``+``. Where ``Y`` is a forward
    tensor and ``X`` a gradient, the inner op then reads forward tensors only, so the
    executor runs it in the forward pass and its output lives until the backward pass, as
    in the gradients of Keras's attention (``softmax * scale``) and GELU
    (``tests/test_tf_internals.py`` pins the rewrite).
    The conditions are Grappler's: the five ops on one device (an unplaced op counts as
    the same), ``X`` the child's first input unless that is a constant, the parent's
    constant no larger than ``X`` (when both shapes are known), no 16-bit floats,
    repeated until nothing changes. Names and every other op are unchanged; ``model``
    itself is returned when nothing applies.

    >>> f32 = lambda *s: ("float32", s, 4 * (s[0] if s else 1), False)
    >>> ops = [
    ...     {"name": "y", "type": "Softmax", "inputs": [], "outputs": [f32(8)]},
    ...     {"name": "x", "type": "Relu", "inputs": ["y:0"], "outputs": [f32(8)]},
    ...     {"name": "c", "type": "Const", "inputs": [], "outputs": [f32()]},
    ...     {"name": "k", "type": "Mul", "inputs": ["x:0", "y:0"], "outputs": [f32(8)]},
    ...     {"name": "p", "type": "Mul", "inputs": ["k:0", "c:0"], "outputs": [f32(8)]},
    ... ]
    >>> pushed, pairs = with_constant_pushdown(GraphModel.from_ops(ops))
    >>> pairs, pushed.inputs_of["p"], pushed.inputs_of["k"]
    ([('p', 'k')], ['x:0', 'k:0'], ['c:0', 'y:0'])
    """
    if not _has_nested_family(model):  # the first pass below would find no pair
        return model, []
    nodes, tensors = model.dag.nodes, model.tensors
    # The ops of a family, in graph order, and their inputs (the only ones a push-down rewires).
    inputs = {op: list(model.inputs_of[op]) for op, kind in nodes(data="type") if kind in PUSHDOWN_FAMILIES}

    def op_of(tensor: str) -> str:
        return tensor.rsplit(":", 1)[0]

    def constant(tensor: str) -> bool:
        return nodes[op_of(tensor)]["type"] in _CONSTANT_OP_TYPES

    def too_large(c: str, x: str) -> bool:
        c_shape, x_shape = tensors[c].shape, tensors[x].shape
        if c_shape is None or x_shape is None:
            return False
        if None not in c_shape and None not in x_shape and math.prod(c_shape) > math.prod(x_shape):
            return True
        return bool(c_shape) and any(
            cd is not None and xd is not None and cd > xd for cd, xd in zip(c_shape, x_shape, strict=False)
        )

    pairs: list[tuple[str, str]] = []
    changed = True
    while changed:
        changed = False
        for parent, parent_inputs in inputs.items():
            family = PUSHDOWN_FAMILIES[nodes[parent]["type"]]
            if len(parent_inputs) != 2:
                continue
            left, right = parent_inputs
            if constant(left) == constant(right):
                continue
            c, inner = (left, right) if constant(left) else (right, left)
            child = op_of(inner)
            if (
                PUSHDOWN_FAMILIES.get(nodes[child]["type"]) != family
                or len(inputs[child]) != 2
                # Reads of the child's outputs: a push-down moves reads between ops, never adds one.
                or sum(len(tensors[t].consumers) for t in model.outputs_of[child]) != 1
                or tensors[inner].dtype in ("float16", "bfloat16")
            ):
                continue
            a, b = inputs[child]
            if constant(a) and constant(b):
                continue
            x, y = (b, a) if constant(a) else (a, b)
            keys = {device_key(nodes[op]["device"]) for op in (parent, child, op_of(c), op_of(x), op_of(y))}
            if len(keys - {None}) > 1 or (not constant(y) and too_large(c, x)):
                continue
            inputs[parent], inputs[child] = [x, inner], [c, y]
            pairs.append((parent, child))
            changed = True
    if not pairs:
        return model, pairs
    changed_ops = dict.fromkeys(op for pair in pairs for op in pair)
    return _rewired(model, {op: inputs[op] for op in changed_ops}), pairs


def _rewired(model: GraphModel, inputs: dict[str, list[str]]) -> GraphModel:
    """``model`` with the data inputs of the ops of ``inputs`` replaced (same count of inputs per
    op, tensors of ``model``): what :meth:`GraphModel.from_ops` of its records so rewired gives, the
    same in every field and in the order of every dict (nodes, each op's predecessors and
    successors, tensors, consumers), built from ``model`` by changing only what the new inputs
    touch, then its levels and phases annotated again. A push-down rewires a few hundred ops of a
    step of tens of thousands, which ``from_ops`` would build again whole."""
    index = {op: k for k, op in enumerate(model.dag)}
    tensors = dict(model.tensors)
    inputs_of = dict(model.inputs_of)
    touched = {t for op, new in inputs.items() for t in (*model.inputs_of[op], *new)}
    for op, new in inputs.items():
        inputs_of[op] = list(new)
    new_reads: dict[str, list[tuple[str, int]]] = {}  # touched tensor -> its reads by the rewired ops
    for op in inputs:
        for i, t in enumerate(inputs_of[op]):
            new_reads.setdefault(t, []).append((op, i))
    # Each touched tensor's consumers, in from_ops's order: by reading op in graph order, then input index.
    for name in touched:
        info = tensors[name]
        reads = [(c, i) for c, i in info.consumers if c not in inputs] + new_reads.get(name, [])
        reads.sort(key=lambda read: (index[read[0]], read[1]))
        tensors[name] = info._replace(consumers=tuple(reads))
    dag = _copied(model.dag)
    succ, pred = dag._succ, dag._pred  # noqa: SLF001 (rewired in place, as from_ops would have added them)
    # The edges that carry a touched tensor, with each tensor's new record.
    for name in touched:
        op = tensors[name].op
        for v in succ[op]:
            edge = succ[op][v]
            if any(t.name in touched for t in edge["tensors"]):
                edge["tensors"] = tuple(tensors[t.name] for t in edge["tensors"])
    # Each rewired op's predecessors: its data inputs' ops in input order, then its control inputs.
    sources: set[str] = set()
    for v in inputs:
        old = pred[v]
        for u in old:
            del succ[u][v]
            sources.add(u)
        pred[v] = edges = _in_edges(inputs_of[v], tensors, old)
        for u, edge in edges.items():
            succ[u][v] = edge
            sources.add(u)
    # A source's successors in graph order (from_ops adds the edges op by op).
    for u in sources:
        succ[u] = dict(sorted(succ[u].items(), key=lambda item: index[item[0]]))
    rewired = dataclasses.replace(model, dag=dag, tensors=tensors, inputs_of=inputs_of)
    rewired._annotate()  # noqa: SLF001 (levels and phases follow the new edges)
    return rewired


def _in_edges(inputs: list[str], tensors: dict[str, Any], old: dict[str, dict]) -> dict[str, dict]:
    """A rewired op's predecessor edges, as from_ops adds them: its data ``inputs``' ops in input
    order, then the control inputs among its ``old`` edges."""
    edges: dict[str, dict] = {}
    for name in inputs:
        t = tensors[name]
        edge = edges.get(t.op)
        if edge is None:
            edges[t.op] = {"tensors": (t,), "control": False}
        else:
            edge["tensors"] += (t,)
    for u, edge in old.items():
        if edge["control"]:
            if u in edges:
                edges[u]["control"] = True
            else:
                edges[u] = {"tensors": (), "control": True}
    return edges


def _has_nested_family(model: GraphModel) -> bool:
    """Whether some op of :data:`PUSHDOWN_FAMILIES` with two inputs, one of them a constant,
    reads the other from an op of the same family with two inputs: what every push-down of
    :func:`with_constant_pushdown` needs. Without one, the model has nothing to push down."""
    types = model.dag.nodes
    inputs_of = model.inputs_of

    def type_of(tensor: str) -> str:
        return types[tensor.rpartition(":")[0]]["type"]

    for op, kind in model.dag.nodes(data="type"):
        family = PUSHDOWN_FAMILIES.get(kind)
        if family is None or len(inputs_of[op]) != 2:
            continue
        left, right = inputs_of[op]
        left_constant, right_constant = type_of(left) in _CONSTANT_OP_TYPES, type_of(right) in _CONSTANT_OP_TYPES
        if left_constant == right_constant:
            continue
        inner = right if left_constant else left
        child = inner.rpartition(":")[0]
        if PUSHDOWN_FAMILIES.get(types[child]["type"]) == family and len(inputs_of[child]) == 2:
            return True
    return False


def _copied(dag: nx.DiGraph) -> nx.DiGraph:
    """A copy of ``dag`` with each node's and each edge's attribute dict a shallow copy (shared by
    the successor and the predecessor dicts, as networkx does) and the order of every node's
    successors and predecessors kept (``dag.copy()`` and :func:`tflms.ir.graph.copy_dag` list each
    node's predecessors in the order of the nodes instead)."""
    new = nx.DiGraph()
    new.graph.update(dag.graph)
    new._node.update((n, data.copy()) for n, data in dag._node.items())  # noqa: SLF001
    succ = {u: {v: edge.copy() for v, edge in nbrs.items()} for u, nbrs in dag._succ.items()}  # noqa: SLF001
    pred = {v: {u: succ[u][v] for u in nbrs} for v, nbrs in dag._pred.items()}  # noqa: SLF001
    new._succ, new._pred = succ, pred  # noqa: SLF001 (networkx resets its cached views on these)
    return new
