"""Tiles left out (the pass ``drop_tiles`` of a policy): a gradient that a ``Tile`` copies to a full
activation's size is kept at its own size, and the element-wise ops that read it broadcast it.

The gradient of a mean is its incoming gradient tiled back to the input's shape, then divided
by the count. Keras 3's BatchNormalization (unfused on the TensorFlow backend) and
LayerNormalization take two means in their forward pass (``moments``), so each of their
gradients makes two such ``Tile`` ops of an activation's size, and a ``RealDiv``, a ``Mul``
and the ``AddN`` of the input gradient read them. In ResNet50's backward pass they are two of
the five to seven activation-sized buffers a BatchNorm gradient holds at its peak.

With the option, each such ``Tile`` is left out: its reader reads the ``Tile``'s input (a
per-channel value, ``[1, 1, 1, C]``) instead, and every op on the way to a full-sized result is
made again under a new name (``<op>/tflms_bcast``) with the smaller input. Those ops (``Mul``,
``RealDiv``, ``AddV2``, ``Sub``) broadcast: each element of their output is the same operation
on the same two numbers as before, so the numbers stay bit-identical, and the full-sized
tensors between the ``Tile`` and the first full-sized result are not made at all.

A ``Tile`` is left out only where every op its value reaches, up to a full-sized result, is one
of those four element-wise ops of the backward pass with its other input of a known shape, none
of them is an output of the step, and no ``AddN`` of three or more inputs reads a made-again op
(a new name could change Grappler's order of its terms). The input gradient of a BatchNorm is an ``AddN`` of three
terms, one of them the mean's: so the pass needs ``split_sums`` in the policy too, whose chains of
``AddV2`` take the per-channel term as it is (:mod:`tflms.plan.passes.sums`). The planner and the simulator
see the step with the sums split, then the tiles left out (:func:`with_dropped_tiles`); the
rewrite applies them in the same order (:func:`apply_tiles`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Any

import networkx as nx

from ...ir.graph import GraphModel, op_records
from .base import GraphEdit, TransformPass

__all__ = ["BROADCAST_OPS", "SUFFIX", "DropTiles", "new_name", "droppable_tiles", "with_dropped_tiles", "apply_tiles"]

#: The element-wise ops that read a left-out ``Tile``'s value and are made again: they broadcast.
BROADCAST_OPS = frozenset({"Mul", "RealDiv", "AddV2", "Sub"})
#: The ops left out: they copy their input 0 to a larger shape.
TILE_TYPES = frozenset({"Tile", "BroadcastTo"})
#: The float dtypes of the tiles left out.
TILE_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
#: What the name of a made-again op ends with.
SUFFIX = "tflms_bcast"


def new_name(op: str) -> str:
    """The name of ``op`` made again with a left-out ``Tile``'s smaller value.

    >>> new_name("gradient_tape/bn/moments/truediv")
    'gradient_tape/bn/moments/truediv/tflms_bcast'
    """
    return f"{op}/{SUFFIX}"


def broadcast_shape(a: tuple[int | None, ...], b: tuple[int | None, ...]) -> tuple[int | None, ...] | None:
    """NumPy's broadcast of two static shapes (``None``: an unknown size, taken to be the one that
    broadcasts), ``None`` if they cannot broadcast.

    >>> broadcast_shape((1, 1, 1, 8), (None, 4, 4, 8))
    (None, 4, 4, 8)
    >>> broadcast_shape((), (1, 1, 8))
    (1, 1, 8)
    >>> broadcast_shape((2, 8), (3, 8)) is None
    True
    """
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    out: list[int | None] = []
    for x, y in zip(a, b):
        if x == 1 or x is None and y != 1:
            out.append(y)
        elif y == 1 or y is None or x == y:
            out.append(x)
        else:
            return None
    return tuple(out)


def _smaller(shape: tuple, full: tuple) -> bool | None:
    """Whether ``shape`` (an op's output made again) is smaller than ``full`` (the old output's):
    ``True`` where it keeps a 1 that ``full`` lacks, ``False`` where it is ``full``'s, ``None``
    where they do not match (unknown sizes match any)."""
    if len(shape) != len(full) or broadcast_shape(shape, full) is None:
        return None
    if any(s == 1 and f != 1 for s, f in zip(shape, full)):
        return True
    if any(f == 1 and s not in (1, None) for s, f in zip(shape, full)):
        return None
    return False


def _tiles_broadcast(in_shape: Any, out_shape: Any) -> bool:
    """A ``Tile`` from ``in_shape`` to ``out_shape`` copies a value that broadcasting gives."""
    if in_shape is None or out_shape is None or len(in_shape) != len(out_shape) or None in in_shape:
        return False
    return bool(_smaller(tuple(in_shape), tuple(out_shape))) and all(
        s == 1 or s == f for s, f in zip(in_shape, out_shape)
    )


class _View:
    """What the closure needs to know of a step: a :class:`GraphModel` or a TensorFlow graph."""

    def __init__(self, model: GraphModel | None = None, graph: Any = None, gone: frozenset[str] = frozenset()) -> None:
        self.model, self.graph, self.gone = model, graph, gone
        if model is not None:
            self.order = {op: i for i, op in enumerate(model.dag)}
        else:
            self.ops = {op.name: op for op in graph.get_operations()}
            self.order = {name: i for i, name in enumerate(self.ops)}

    def type(self, op: str) -> str:
        return self.model.dag.nodes[op]["type"] if self.model is not None else self.ops[op].type

    def inputs(self, op: str) -> list[str]:
        return self.model.inputs_of[op] if self.model is not None else [t.name for t in self.ops[op].inputs]

    def output(self, op: str) -> str:
        return f"{op}:0"

    def shape(self, tensor: str) -> tuple | None:
        if self.model is not None:
            return self.model.tensors[tensor].shape
        shape = self.graph.get_tensor_by_name(tensor).shape
        return tuple(shape.as_list()) if shape.rank is not None else None

    def dtype(self, tensor: str) -> str:
        if self.model is not None:
            return self.model.tensors[tensor].dtype
        return self.graph.get_tensor_by_name(tensor).dtype.name

    def readers(self, tensor: str) -> list[str]:
        if self.model is not None:
            return [c for c, _ in self.model.tensors[tensor].consumers]
        return [c.name for c in self.graph.get_tensor_by_name(tensor).consumers() if c.name not in self.gone]

    def control_inputs(self, op: str) -> list[str]:
        if self.model is not None:
            dag = self.model.dag
            return [u for u in dag.predecessors(op) if dag.edges[u, op]["control"]]
        return [c.name for c in self.ops[op].control_inputs]

    def control_readers(self, op: str) -> list[str]:
        if self.model is not None:
            dag = self.model.dag
            return [v for v in dag.successors(op) if dag.edges[op, v]["control"]]
        return [c.name for c in self.ops[op]._control_outputs]  # noqa: SLF001

    def backward(self, op: str) -> bool:
        return self.model is None or self.model.dag.nodes[op]["phase"] == "backward"

    def is_output(self, op: str) -> bool:
        """Whether ``op`` is one of the function's outputs or control outputs (a graph only)."""
        if self.graph is None:
            return False
        outputs = getattr(self.graph, "outputs", ())
        controls = getattr(self.graph, "control_outputs", ())
        return any(t.op.name == op for t in outputs) or any(c.name == op for c in controls)


def _closure(view: _View, tiles: Sequence[str]) -> tuple[dict[str, tuple], list[str], dict[str, str]]:
    """What leaving out ``tiles`` does: ``(the new shape of each tensor that gets smaller, the
    ops made again in dependency order, {op: why it stops a tile being left out})``."""
    small, problems = _tile_values(view, tiles)
    state: dict[str, bool] = {}  # an op made again -> whether its output is smaller
    heap = [(view.order[c], c) for t in small for c in view.readers(t)]
    heapq.heapify(heap)
    # Graph order is not always topological (a split sum's chain comes last), so each op is
    # looked at again when one of its inputs gets smaller, until nothing changes (an output
    # only ever goes from full-sized to smaller).
    while heap:
        _, op = heapq.heappop(heap)
        problems.pop(op, None)
        shape, smaller, problem = _made_again(view, op, small)
        if problem:
            problems[op] = problem
            continue
        if state.get(op) is not smaller:
            state[op] = smaller
            if smaller:
                small[view.output(op)] = tuple(shape)
                for c in view.readers(view.output(op)):
                    heapq.heappush(heap, (view.order[c], c))
        if not smaller:
            for c in view.readers(view.output(op)):
                if view.type(c) == "AddN" and len(view.inputs(c)) >= 3:
                    problems[op] = f"{op!r} is read by {c!r}, an AddN whose order of terms a new name may change"
    # In dependency order (graph order breaks the ties): an op is made again after its inputs.
    made = nx.DiGraph()
    made.add_nodes_from(state)
    made.add_edges_from(
        (producer, op) for op in state for t in view.inputs(op) if (producer := t.rpartition(":")[0]) in state
    )
    made.add_edges_from((c, op) for op in state for c in view.control_inputs(op) if c in state)
    return small, list(nx.lexicographical_topological_sort(made, key=view.order.__getitem__)), problems


def _tile_values(view: _View, tiles: Sequence[str]) -> tuple[dict[str, tuple], dict[str, str]]:
    """``({each tile's output: the shape of the value it tiles}, {tile: why it cannot be left out})``."""
    small: dict[str, tuple] = {}
    problems: dict[str, str] = {}
    for tile in tiles:
        if tile not in view.order or view.type(tile) not in TILE_TYPES:
            problems[tile] = f"{tile!r} is not a Tile or BroadcastTo op of this step"
            continue
        out, value = view.output(tile), view.inputs(tile)[0]
        if not _tiles_broadcast(view.shape(value), view.shape(out)):
            problems[tile] = f"{tile!r} tiles {view.shape(value)} to {view.shape(out)}: not a broadcast"
        elif view.dtype(out) not in TILE_DTYPES:
            problems[tile] = f"{tile!r} tiles a {view.dtype(out)} value"
        elif view.control_readers(tile):
            problems[tile] = f"{tile!r} has control outputs"
        small[out] = view.shape(value)
    return small, problems


def _made_again(view: _View, op: str, small: dict[str, tuple]) -> tuple[tuple | None, bool | None, str]:
    """``op`` (a reader of a smaller tensor) made again: ``(its output's shape, whether that is
    smaller than its output's now, '')``, or ``(None, None, why it cannot be)``."""
    ins = view.inputs(op)
    if view.type(op) not in BROADCAST_OPS or len(ins) != 2 or not view.backward(op):
        return None, None, f"{op!r} ({view.type(op)}) reads a tiled value and is not a backward op that broadcasts"
    shapes = [small.get(t, view.shape(t)) for t in ins]
    full = view.shape(view.output(op))
    shape = None if None in shapes else broadcast_shape(shapes[0], shapes[1])
    smaller = None if shape is None or full is None else _smaller(shape, tuple(full))
    if smaller is None:
        return None, None, f"{op!r}: its inputs, of shapes {shapes}, do not broadcast to its output's {full}"
    if view.is_output(op):
        return None, None, f"{op!r} reads a tiled value and is an output of the step"
    return shape, smaller, ""


def droppable_tiles(model: GraphModel) -> list[str]:
    """The ``Tile`` and ``BroadcastTo`` ops of ``model``'s backward pass that
    :func:`with_dropped_tiles` leaves out (see the module doc), in graph order. Plan on ``model``
    with its sums split first."""
    return _droppable(model, _View(model))[0]


def _droppable(model: GraphModel, view: _View) -> tuple[list[str], tuple[dict[str, tuple], list[str], dict[str, str]]]:
    """``(droppable_tiles(model), their closure)``: the closure of the tiles found, not computed twice."""
    dag = model.dag
    candidates = [op for op, data in dag.nodes(data=True) if data["type"] in TILE_TYPES and data["phase"] == "backward"]
    reach: dict[str, set[str]] = {}  # a tile that can be left out alone -> the ops it makes again
    for tile in candidates:
        _, remade, problems = _closure(view, [tile])
        if not problems:
            reach[tile] = set(remade)
    tiles = list(reach)
    while tiles:  # together, two tiles' values can meet in one op and reach further
        closure = _closure(view, tiles)
        problems = closure[2]
        if not problems:
            return tiles, closure
        near = set(problems) | {t.rpartition(":")[0] for op in problems if op in dag for t in model.inputs_of[op]}
        drop = {t for t in tiles if t in near or reach[t] & near} or {tiles[-1]}
        tiles = [t for t in tiles if t not in drop]
    return [], ({}, [], {})


def _smaller_bytes(dtype: str, nbytes: int, full: Any, shape: tuple) -> tuple[int, bool]:
    """``(bytes, estimated)`` of a tensor of ``shape`` cut from one of ``full`` shape and ``nbytes``:
    an unknown size of ``shape`` is ``full``'s there, one unknown size of ``full`` what ``nbytes`` implies."""
    itemsize = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}[dtype]
    sizes = list(full) if full is not None and len(full) == len(shape) else [None] * len(shape)
    known = math.prod(d for d in sizes if d is not None)
    if sizes.count(None) == 1 and known:
        sizes[sizes.index(None)] = max(1, nbytes // itemsize // known)
    n = math.prod(s if s is not None else (f if f is not None else 1) for s, f in zip(shape, sizes))
    return n * itemsize, None in shape


def with_dropped_tiles(model: GraphModel, tiles: Sequence[str] | None = None) -> tuple[GraphModel, list[str]]:
    """``(model with tiles left out and the ops that read their values made again, the tiles)``;
    ``tiles`` defaults to :func:`droppable_tiles`. ``model`` itself when there are none."""
    view = _View(model)
    if tiles is None:
        tiles, (small, remade, problems) = _droppable(model, view)
    else:
        tiles = list(tiles)
        small, remade, problems = _closure(view, tiles) if tiles else ({}, [], {})
    if not tiles:
        return model, []
    if problems:
        raise ValueError(
            f"The tiles to leave out do not fit this model: {next(iter(problems.values()))}. Make the plan from "
            "this model."
        )
    old = op_records(model)
    renamed = {op: new_name(op) for op in remade}
    taken = [name for name in renamed.values() if name in model.dag]
    if taken:
        raise ValueError(
            f"tflms: cannot name the op made again for {taken[0][: -len(SUFFIX) - 1]!r}: {taken[0]!r} is taken"
        )
    source = {f"{t}:0": model.inputs_of[t][0] for t in tiles}  # a tile's output -> its value
    dropped = set(tiles)
    records = []
    for name, rec in old.items():
        if name in dropped:
            continue
        rec["inputs"] = [source.get(t) or _renamed_tensor(renamed, t) for t in rec["inputs"]]
        rec["control_inputs"] = [renamed.get(c, c) for c in rec["control_inputs"]]
        if name in renamed:
            out = f"{name}:0"
            dtype, full, nbytes, est = rec["outputs"][0]
            if out in small:
                shape = small[out]
                nbytes, est = _smaller_bytes(dtype, nbytes, full, shape)
                rec["outputs"] = [(dtype, shape, nbytes, est)]
            rec["name"] = renamed[name]
        records.append(rec)
    done = GraphModel.from_ops(records, variable_bytes=model.variable_bytes, name=model.name, variables=model.variables)
    return done, tiles


def _renamed_tensor(renamed: dict[str, str], tensor: str) -> str:
    op, _, index = tensor.rpartition(":")
    return f"{renamed[op]}:{index}" if op in renamed else tensor


def apply_tiles(graph: Any, tiles: Sequence[str], device: str, lookup: Any, gone: Sequence[str] = ()) -> int:
    """Leave ``tiles`` out of ``graph``: make again, under :func:`new_name`, every op that reads
    their values up to a full-sized result, and rewire the readers of the old ops (their data and
    control inputs) to the new ones. Return the number of ops made. The ``Tile`` ops and the old
    ops are left unread (Grappler prunes them). ``gone``: ops already left unread (the split
    sums' ``AddN`` ops), which do not count as readers."""
    import tensorflow as tf

    from ... import _tf_internal as tfi

    if not tiles:
        return 0
    for t in tiles:
        lookup("tile op", graph.get_operation_by_name, t)
    view = _View(graph=graph, gone=frozenset(gone))
    _, remade, problems = _closure(view, tiles)
    if problems:
        raise ValueError(
            f"The plan does not fit this function: {next(iter(problems.values()))}. Make the plan from the same "
            "traced function (same model, input signature and options)."
        )
    new: dict[str, Any] = {f"{t}:0": view.ops[t].inputs[0] for t in tiles}
    made: dict[str, Any] = {}
    for name in remade:
        op = view.ops[name]
        inputs = [new.get(t.name, t) for t in op.inputs]
        with graph.as_default(), tf.control_dependencies(None), tf.device(op.device or device):
            clone = tfi.clone_op(graph, op, inputs, new_name(name))
        for c in op.control_inputs:
            tfi.add_control_input(clone, made.get(c.name, c))
        new[op.outputs[0].name] = clone.outputs[0]
        made[name] = clone
    for name, clone in made.items():
        op = view.ops[name]
        old = op.outputs[0]
        for reader in list(old.consumers()):
            if reader.name in made or reader.name in view.gone:
                continue
            for index, t in enumerate(reader.inputs):
                if t is old:
                    tfi.update_input(reader, index, clone.outputs[0])
        for reader in list(op._control_outputs):  # noqa: SLF001
            if reader.name not in made:
                tfi.replace_control_input(reader, op, clone)
    return len(made)


class DropTiles(TransformPass):
    """The gradient of a mean is broadcast, not tiled (the pass ``drop_tiles`` of a policy). It
    needs ``split_sums`` before it, in the registry and in a policy (see the module doc)."""

    name, field, needs = "drop_tiles", "tiles", ("split_sums",)

    def names(self, decisions: Sequence[str]) -> list[str]:
        return list(decisions)

    def made_again_from(self, name: str) -> str | None:
        base = name.removesuffix(f"/{SUFFIX}")
        return base if base != name else None

    def transform(self, model: GraphModel, decisions: Sequence[str] | None = None) -> tuple[GraphModel, list[str]]:
        return with_dropped_tiles(model, decisions)

    def rewrote(self, op: Any, attr: bytes | None) -> bool:
        return op.name.endswith(f"/{SUFFIX}")

    def rewrite(self, edit: GraphEdit) -> dict[str, int]:
        """The ops of the split sums (``split_sums``, before it) are left unread: no readers."""
        gone = [s.op for s in edit.plan.sums]
        return {"tile": apply_tiles(edit.graph, edit.plan.tiles, edit.device, edit.lookup, gone)}
