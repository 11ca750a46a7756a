"""What the simulator knows of a step before any schedule: forwarding (in-place) rules, the
step's arrays, the variable copies TensorFlow makes; cached per graph model."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._devices import device_key
from ..ir.graph import ALIAS_OP_TYPES, GraphModel, reach
from .order import _ready_structure, ready_order, topological_order

__all__ = [
    "FORWARDING_OP_TYPES",
    "FORWARDING_OUTPUTS",
    "VARIABLE_WRITE_TYPES",
    "is_scratch",
    "scratch_name",
    "static_of",
]

#: Op types whose kernel may write its output into the buffer of an input it reads
#: last (TensorFlow's ``forward_input_or_allocate_output``): input indices it may
#: reuse (None: any). Checked on the CPU kernels of TF 2.21: element-wise ops,
#: ``AddN`` and ``BiasAdd`` (which Grappler fuses into the convolution before it).
FORWARDING_OP_TYPES: dict[str, tuple[int, ...] | None] = {
    **dict.fromkeys(
        (
            "Abs", "Acos", "Asin", "Atan", "BiasAdd", "Ceil", "Cos", "Cosh", "Elu", "Erf", "Erfc", "Exp",
            "Expm1", "Floor", "Gelu", "Inv", "LeakyRelu", "Log", "Log1p", "Neg", "Reciprocal", "Relu",
            "Relu6", "Rint", "Round", "Rsqrt", "Selu", "Sigmoid", "Sign", "Sin", "Sinh", "Softplus",
            "Softsign", "Sqrt", "Square", "Tan", "Tanh", "ClipByValue",
        ),
        (0,),
    ),
    **dict.fromkeys(
        (
            "Add", "AddV2", "Sub", "Mul", "MulNoNan", "Div", "DivNoNan", "RealDiv", "FloorDiv", "FloorMod",
            "Maximum", "Minimum", "Pow", "SquaredDifference", "ReluGrad", "Relu6Grad", "EluGrad", "SeluGrad",
            "LeakyReluGrad", "SigmoidGrad", "TanhGrad", "RsqrtGrad", "SqrtGrad", "SoftplusGrad",
            "ReciprocalGrad", "AddN", "Xdivy", "Xlogy",
        ),
        None,
    ),
    **dict.fromkeys(("Select", "SelectV2"), (1, 2)),
}  # fmt: skip


#: Ops that are not element-wise and still write an output into an input they read last, as
#: :data:`FORWARDING_OP_TYPES` (rule 3; kept apart from it: :mod:`tflms.plan.passes.schedule` orders element-wise
#: ops): op type -> (the output, the input indices). Softmax and LogSoftmax write into their logits
#: (``softmax_op.cc``); the cross-entropy ops write their backprop, output 1, into them
#: (``xent_op.cc``, ``sparse_xent_op.cc``), so none of them allocates a buffer of its own.
FORWARDING_OUTPUTS: dict[str, tuple[int, tuple[int, ...]]] = {
    "Softmax": (0, (0,)),
    "LogSoftmax": (0, (0,)),
    "SoftmaxCrossEntropyWithLogits": (1, (0,)),
    "SparseSoftmaxCrossEntropyWithLogits": (1, (0,)),
}


def scratch_name(op: str) -> str:
    """The name of ``op``'s temporary buffer (its node attribute ``scratch``, bytes) among the
    simulator's buffers: allocated when the op runs, after its outputs, and freed after it, as
    an output nobody reads (:func:`tflms.emulate.costs.with_scratch`).

    >>> scratch_name("conv/Conv2DBackpropFilter")
    'conv/Conv2DBackpropFilter (scratch)'
    """
    return f"{op} (scratch)"


def is_scratch(name: str) -> bool:
    """Whether a buffer name of the simulator is an op's temporary buffer (:func:`scratch_name`)."""
    return name.endswith(" (scratch)")


def _forwarding(op_type: str) -> tuple[int, tuple[int, ...] | None]:
    """``(output, input indices or None for any)`` that an op of ``op_type`` may write in place
    (rule 3); ``(0, ())`` for none."""
    if op_type in FORWARDING_OUTPUTS:
        return FORWARDING_OUTPUTS[op_type]
    return 0, FORWARDING_OP_TYPES.get(op_type, ())


#: The step's arguments: their buffers belong to the caller, who holds them for the whole step.
_ARGUMENT_OP_TYPES = frozenset({"Placeholder", "_Arg"})


#: Producers whose buffers an op never reuses: the caller or the kernel keeps a reference.
_NOT_FORWARDABLE = frozenset({"Placeholder", "Const", "_Arg", "HostConst"})


@dataclasses.dataclass
class _Static:
    """What :class:`_Replay` needs of a model that does not depend on the schedule."""

    root: dict[str, str]  # tensor -> the tensor whose buffer it shares (itself if none)
    #: Per tensor, in model order: (its buffer's root, its op, its reads (consumer, input
    #: index) but IdentityN's, whether its op keeps the buffer live (not an IdentityN), the
    #: bytes it allocates on the device (0: none, an alias, or on the host)).
    tensors: list[tuple[str, str, list[tuple[str, int]], bool, int]]
    #: Ops that may write their output into an input: (op, [(input index, its root)]).
    forwarding: list[tuple[str, list[tuple[int, str]]]]
    #: In-place variable writes (rule 6): (writer, bytes, the variable's handle (root tensor),
    #: [(a ReadVariableOp of that variable, the ops that read its value and that the writer
    #: does not wait for)]).
    writes: list[tuple[str, int, str, list[tuple[str, list[str]]]]]
    #: ``tensors`` and ``forwarding`` as arrays (:func:`_arrays`), made on the first replay; an
    #: ordered step's static (:func:`_seed_ordered_static`) shares its parent's.
    arrays: _Arrays | None = None


@dataclasses.dataclass
class _Arrays:
    """:class:`_Static`'s buffers and reads as numpy arrays, for :class:`_Replay` to place them on
    a schedule in numpy: ``op``-arrays index :attr:`ops`, ``root``-arrays :attr:`roots`."""

    ops: dict[str, int]  # op -> its index
    roots: list[str]  # the buffers allocated on the device, in the order of their tensors
    alloc_op: np.ndarray  # per root: the op that allocates it
    alloc_bytes: np.ndarray  # per root: its bytes
    is_argument: np.ndarray  # per root: a step argument (the caller holds it for the whole step)
    keep_root: np.ndarray  # per (tensor, op) that keeps a root live (not an IdentityN): the root
    keep_op: np.ndarray  # ... and the op
    read_root: np.ndarray  # per read of a root (through any alias): the root
    read_op: np.ndarray  # ... the reading op
    read_index: np.ndarray  # ... and its input index
    read_via: np.ndarray  # ... and the op whose output it reads (an alias op's, for a read through it)
    reads_of: dict[str, list[tuple[str, int]]]  # every root (allocated or not) -> its reads (consumer, index)
    #: In-place candidates: (op, [(input index, root index)]), for roots that are allocated.
    forwarding: list[tuple[str, list[tuple[int, int]]]]


def _arrays(static: _Static, model: GraphModel) -> _Arrays:
    """``static``'s :class:`_Arrays` (made once, kept on it)."""
    if static.arrays is not None:
        return static.arrays
    ops = {op: k for k, op in enumerate(model.dag)}
    roots: dict[str, int] = {}
    alloc_op, alloc_bytes, is_argument = [], [], []
    types = model.dag.nodes
    for r, op, _, _, nbytes in static.tensors:
        if nbytes and r not in roots:
            roots[r] = len(roots)
            alloc_op.append(ops[op])
            alloc_bytes.append(nbytes)
            is_argument.append(types[op]["type"] in _ARGUMENT_OP_TYPES)
    keep_root, keep_op, read_root, read_op, read_index, read_via = [], [], [], [], [], []
    reads_of: dict[str, list[tuple[str, int]]] = {}
    for r, op, readers, counts, _ in static.tensors:
        reads_of.setdefault(r, []).extend(readers)
        k = roots.get(r)
        if k is None:
            continue
        if counts:
            keep_root.append(k)
            keep_op.append(ops[op])
        for c, i in readers:
            read_root.append(k)
            read_op.append(ops[c])
            read_index.append(i)
            read_via.append(ops[op])
    forwarding = [(op, [(i, roots[r]) for i, r in cands]) for op, cands in static.forwarding]

    def ints(values: list[int]) -> np.ndarray:
        return np.array(values, dtype=np.int64)

    static.arrays = _Arrays(
        ops,
        list(roots),
        ints(alloc_op),
        ints(alloc_bytes),
        np.array(is_argument, dtype=bool),
        ints(keep_root),
        ints(keep_op),
        ints(read_root),
        ints(read_op),
        ints(read_index),
        ints(read_via),
        reads_of,
        forwarding,
    )
    return static.arrays


class _Reads(dict):
    """Root -> its reads ``[(position, (consumer, input index))]`` in a schedule, made when asked."""

    def __init__(self, pos: dict[str, int], reads_of: dict[str, list[tuple[str, int]]]) -> None:
        super().__init__()
        self._pos, self._reads_of = pos, reads_of

    def __missing__(self, r: str) -> list[tuple[int, tuple[str, int]]]:
        pos = self._pos
        found = self[r] = [(pos[read[0]], read) for read in self._reads_of[r]]
        return found


#: Per model DAG and host: its :class:`_Static`, with the tensors dict it was made from. The
#: schedule's search replays one model under many orders.
_STATICS: weakref.WeakKeyDictionary[Any, dict[Any, tuple[dict, _Static]]] = weakref.WeakKeyDictionary()


def static_of(model: GraphModel, host_key: Any) -> _Static:
    per_host = _STATICS.setdefault(model.dag, {})
    hit = per_host.get(host_key)
    if hit is not None and hit[0] is model.tensors:
        return hit[1]
    dag = model.dag
    types = {op: data["type"] for op, data in dag.nodes(data=True)}
    # Buffer roots: an alias op's output i shares the buffer of its input i (in a topological order).
    root: dict[str, str] = {}
    for op in topological_order(dag):
        op_type = types[op]
        ins = model.inputs_of[op]
        alias = op_type in ALIAS_OP_TYPES and ins
        for i, t in enumerate(model.outputs_of[op]):
            src = (ins[i] if op_type == "IdentityN" and i < len(ins) else ins[0]) if alias else None
            root[t] = root[src] if src is not None else t
    tensors = []
    allocated = set()
    for name, t in model.tensors.items():
        r = root[name]
        on_device = host_key is None or device_key(dag.nodes[t.op]["device"]) != host_key
        nbytes = t.bytes if r == name and t.bytes and on_device else 0
        if nbytes:
            allocated.add(r)
        readers = [(c, i) for c, i in t.consumers if types[c] != "IdentityN"]
        tensors.append((r, t.op, readers, types[t.op] != "IdentityN", nbytes))
    for op, nbytes in dag.nodes(data="scratch"):
        if nbytes and (host_key is None or device_key(dag.nodes[op]["device"]) != host_key):
            name = scratch_name(op)
            root[name] = name
            tensors.append((name, op, [], True, nbytes))
    forwarding = []
    for op in dag.nodes:
        k, allowed = _forwarding(types[op])
        outs = model.outputs_of[op]
        if allowed == () or len(outs) <= k:
            continue
        out = model.tensors[outs[k]]
        cands = []
        for i, tname in enumerate(model.inputs_of[op]):
            t = model.tensors[tname]
            r = root[tname]
            if (allowed is None or i in allowed) and t.bytes == out.bytes and t.dtype == out.dtype:
                if r in allocated and types[model.tensors[r].op] not in _NOT_FORWARDABLE:
                    cands.append((i, r))
        if cands:
            forwarding.append((op, cands))
    static = _Static(root, tensors, forwarding, _variable_writes(model, root, types))
    per_host[host_key] = (model.tensors, static)
    return static


def _seed_ordered_static(parent: GraphModel, child: GraphModel, orders: Sequence[Any], host_key: Any) -> None:
    """Cache the :class:`_Static` of ``child`` (``parent`` with the control edges of ``orders``,
    :func:`tflms.ir.graph.with_order_edges`) from ``parent``'s, where that is cached. An order is no
    data: buffers, reads and in-place outputs stay; only a variable write (rule 6) may now wait for
    a read that it did not wait for, through a path over one of the new edges ``after -> op``, i.e.
    from an ancestor of ``after`` to a descendant of ``op``. (For the schedule's search, which
    orders one step many times: deriving the writes afresh walks the whole graph each time.)"""
    hit = _STATICS.get(parent.dag, {}).get(host_key)
    if hit is None or hit[0] is not parent.tensors or child.tensors is not parent.tensors:
        return
    static = hit[1]
    _, succ, _, _ = _ready_structure(child.dag)  # the executor's waits, the new edges included
    preds: dict[str, list[str]] = {op: [] for op in succ}
    for op, successors in succ.items():
        for c in successors:
            preds[c].append(op)
    # Per new edge: (what ``after`` waits for, what waits for ``op``), each with the op itself.
    paths = [
        (reach(preds.__getitem__, {o.after}) | {o.after}, reach(succ.__getitem__, {o.op}) | {o.op}) for o in orders
    ]
    writes = []
    for op, nbytes, handle, rvos in static.writes:
        waits = [before for before, after in paths if op in after]
        rvos = [(r, [c for c in free if not any(c in before for before in waits)]) for r, free in rvos]
        if any(free for _, free in rvos):
            writes.append((op, nbytes, handle, rvos))
    _STATICS.setdefault(child.dag, {})[host_key] = (child.tensors, dataclasses.replace(static, writes=writes))


#: Ops that update a variable in place. When a tensor read from the variable earlier is
#: still held, TensorFlow first copies the variable into a new buffer
#: (``PrepareToUpdateVariable`` in ``resource_variable_ops.cc``), which then is the variable.
VARIABLE_WRITE_TYPES = frozenset({"AssignSubVariableOp", "AssignAddVariableOp"})


def _variable_writes(
    model: GraphModel, root: dict[str, str], types: dict[str, str]
) -> list[tuple[str, int, str, list[tuple[str, list[str]]]]]:
    """The in-place variable writes of ``model``, with the reads of the same variable (see :class:`_Static`)."""
    view: dict[str, str] = {}  # tensor -> the ReadVariableOp whose value it is (through aliases)
    for op in topological_order(model.dag):
        op_type = types[op]
        ins = model.inputs_of[op]
        for i, t in enumerate(model.outputs_of[op]):
            if op_type == "ReadVariableOp":
                view[t] = op
            elif op_type in ALIAS_OP_TYPES and ins:
                src = ins[i] if op_type == "IdentityN" and i < len(ins) else ins[0]
                if src in view:
                    view[t] = view[src]
    readers: dict[str, list[str]] = {}
    for t, rvo in view.items():
        readers.setdefault(rvo, []).extend(c for c, _ in model.tensors[t].consumers if types[c] not in ALIAS_OP_TYPES)
    reads_of: dict[str, list[str]] = {}  # a variable's handle -> its ReadVariableOps
    for rvo in readers:
        reads_of.setdefault(root[model.inputs_of[rvo][0]], []).append(rvo)
    writes = [op for op in model.dag if types[op] in VARIABLE_WRITE_TYPES and len(model.inputs_of[op]) == 2]
    # Which of the reads' consumers each write waits for as the executor runs it (through IdentityN
    # ops, as ready_order): one bit per consumer, ORed along those edges in an order of them.
    bit = {c: 1 << i for i, c in enumerate(dict.fromkeys(c for cs in readers.values() for c in cs))}
    _, succ, _, _ = _ready_structure(model.dag)
    before: dict[str, int] = {}  # op -> the bits of the consumers it waits for
    for op in ready_order(model):
        before.setdefault(op, 0)
        mine = before[op] | bit.get(op, 0)
        for c in succ[op]:
            before[c] = before.get(c, 0) | mine
    out = []
    for op in writes:
        handle, value = model.inputs_of[op]
        nbytes = model.tensors[value].bytes
        waits = before[op]
        rvos = [(r, [c for c in readers[r] if c != op and not waits & bit[c]]) for r in reads_of.get(root[handle], [])]
        if nbytes and any(free for _, free in rvos):
            out.append((op, nbytes, root[handle], rvos))
    return out
