"""Grappler's rewrites that change what a step holds, emulated on the graph model: constant push-down."""

from __future__ import annotations

import math
from typing import Any

from ..ir.devices import device_key
from ..ir.graph import GraphModel, op_records

#: Grappler's constant push-down (``ConstantFolding::ConstantPushDown`` in TF 2.21's
#: ``constant_folding.cc``), commutative case: op types of one associative family.
PUSHDOWN_FAMILIES = {"Mul": "Mul", "Add": "Add", "AddV2": "Add"}


_CONSTANT_OP_TYPES = frozenset({"Const", "HostConst"})


def with_constant_pushdown(model: GraphModel) -> tuple[GraphModel, list[tuple[str, str]]]:
    """``model`` as TensorFlow runs it after Grappler's constant push-down, and the rewritten ``(parent, child)`` pairs.

    Grappler rewrites ``C * (X * Y)`` (``C`` a ``Const``, the inner product read only by
    the outer one) into ``X * (C * Y)``, and likewise for ``+``. Where ``Y`` is a forward
    tensor and ``X`` a gradient, the inner op then reads forward tensors only, so the
    executor runs it in the forward pass and its output lives until the backward pass:
    Keras's attention (``softmax * scale``) and GELU gradients, measured on the test bed.
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
    records = op_records(model)
    tensors = model.tensors
    readers: dict[str, int] = {}
    for rec in records.values():
        for t in rec["inputs"]:
            readers[t] = readers.get(t, 0) + 1

    def op_of(tensor: str) -> dict[str, Any]:
        return records[tensor.rsplit(":", 1)[0]]

    def constant(tensor: str) -> bool:
        return op_of(tensor)["type"] in _CONSTANT_OP_TYPES

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
        for parent in records.values():
            family = PUSHDOWN_FAMILIES.get(parent["type"])
            if family is None or len(parent["inputs"]) != 2:
                continue
            left, right = parent["inputs"]
            if constant(left) == constant(right):
                continue
            c, inner = (left, right) if constant(left) else (right, left)
            child = op_of(inner)
            if (
                PUSHDOWN_FAMILIES.get(child["type"]) != family
                or len(child["inputs"]) != 2
                or sum(readers.get(t, 0) for t in model.outputs_of[child["name"]]) != 1
                or tensors[inner].dtype in ("float16", "bfloat16")
            ):
                continue
            a, b = child["inputs"]
            if constant(a) and constant(b):
                continue
            x, y = (b, a) if constant(a) else (a, b)
            keys = {device_key(r["device"]) for r in (parent, child, op_of(c), op_of(x), op_of(y))}
            if len(keys - {None}) > 1 or (not constant(y) and too_large(c, x)):
                continue
            parent["inputs"], child["inputs"] = [x, inner], [c, y]
            pairs.append((parent["name"], child["name"]))
            changed = True
    if not pairs:
        return model, pairs
    pushed = GraphModel.from_ops(
        records.values(), variable_bytes=model.variable_bytes, name=model.name, variables=model.variables
    )
    return pushed, pairs


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
