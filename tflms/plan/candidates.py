"""Swap candidates: which tensors may be swapped, their swap-in groups and triggers.

The rules are those listed in :mod:`tflms.plan.planner`; this module holds the part that
:mod:`tflms.plan.autotune` needs too (it imports nothing of the planner or autotuner).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import networkx as nx

from .._devices import parse as parse_device
from .._devices import same_device
from ..config import LMSConfig
from ..ir.decisions import Swap, SwapIn
from ..ir.graph import ALIAS_OP_TYPES, CONTROL_FLOW_OP_TYPES, GraphModel, TensorInfo

__all__ = [
    "candidate_swaps",
    "group_by_level",
    "is_collective",
    "pins_inputs",
    "EXCLUDED_PRODUCER_TYPES",
    "EXCLUDED_DTYPES",
]

EXCLUDED_PRODUCER_TYPES = (
    frozenset(
        {"Const", "Placeholder", "ReadVariableOp", "VarHandleOp", "VariableV2", "_Arg", "Identity", "IdentityN"}
        | {"Fill", "ZerosLike", "OnesLike"}
    )
    | CONTROL_FLOW_OP_TYPES
)
EXCLUDED_DTYPES = frozenset({"resource", "variant", "string", "int32"})
#: Backward inputs that must stay a direct edge from their forward producer, as
#: ``(op type, input index)``. On CPU, oneDNN's graph rewrite (TensorFlow's MKL layout
#: pass, run after partitioning) turns ``MaxPoolGrad``/``MaxPool3DGrad`` into
#: ``_MklNativeMaxPool(3D)Grad`` only when input 1 (the pooled output) comes straight from
#: the ``MaxPool``/``MaxPool3D`` (it then also reads the forward op's workspace), and
#: ``LRNGrad`` into oneDNN's only when its input 2 comes straight from the ``LRN``. Fed by
#: a swap-in (a ``_Recv`` after partitioning), the op keeps TensorFlow's own kernel, which
#: routes the gradient of tied maxima differently (``MaxPool3DGrad`` gives it to every
#: tied input): the step is no longer bit-identical. A tensor read by such an input far
#: in the backward pass is not swapped: its device copy must live until then anyway.
#: Only where the step does not run on a GPU (:func:`pins_inputs`): a GPU runs these gradients
#: with the same kernel whether the input comes from the forward op or from a swap-in.
PINNED_INPUTS = frozenset({("MaxPoolGrad", 1), ("MaxPool3DGrad", 1), ("LRNGrad", 2)})
#: Ops into which Grappler's arithmetic optimizer folds a ``Transpose`` of an input
#: (``FoldTransposeIntoMatMul``): a ``Transpose`` that only they read never runs in the plain step,
#: and swapping its output would make it run (another kernel, and a buffer the plain step never holds).
TRANSPOSE_FOLDING_TYPES = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"})

#: Ops that read only their input's shape, never its data.
SHAPE_OP_TYPES = frozenset({"Shape", "ShapeN", "Size", "Rank"})
#: Ops whose output buffer stays on the device whatever the plan does (weights, the
#: step's inputs, constants): swapping a view of one frees nothing.
RESIDENT_OP_TYPES = frozenset({"Placeholder", "_Arg", "Const", "VarHandleOp", "VariableV2"})


def buffer_owner(model: GraphModel, tensor: str) -> TensorInfo:
    """The tensor whose buffer ``tensor`` shares: followed back through
    :data:`tflms.ir.graph.ALIAS_OP_TYPES` ops (output i of ``IdentityN`` is its input i)."""
    t = model.tensors[tensor]
    while True:
        op_type = model.dag.nodes[t.op]["type"]
        ins = model.inputs_of[t.op]
        if op_type not in ALIAS_OP_TYPES or not ins:
            return t
        t = model.tensors[ins[t.index if op_type == "IdentityN" and t.index < len(ins) else 0]]


def pins_inputs(config: LMSConfig) -> bool:
    """Whether :data:`PINNED_INPUTS` apply: the step runs on ``config.device`` and that is not a
    GPU. ``device=None`` means a GPU (the Horovod local-rank GPU or ``/device:GPU:0``; without
    one no rewrite is made), so a plan for it may swap a pooled output. (``swapout_window='auto'``
    reads ``device=None`` in :func:`tflms.make_plan` as no device: no fences; ``tflms.optimize``
    and ``tflms.function`` pass the device they rewrite for.)

    >>> pins_inputs(LMSConfig(device="/device:CPU:1")), pins_inputs(LMSConfig(device="/device:GPU:0"))
    (True, False)
    >>> pins_inputs(LMSConfig())
    False
    """
    return config.device is not None and parse_device(config.device).type != "GPU"


def is_collective(op_type: str) -> bool:
    """Horovod / TF collective ops: never swapped, never triggers."""
    return op_type.startswith(("Horovod", "Collective", "NcclAllReduce"))


def candidate_swaps(model: GraphModel, config: LMSConfig) -> list[Swap]:
    """Every swap ``config`` allows, in the order ``n_tensors`` keeps them:
    bytes descending, then distance descending, then tensor name."""
    return _swaps(model, config, _eligible(model, config))


def _eligible(model: GraphModel, config: LMSConfig) -> list[TensorInfo]:
    """The tensors that ``config`` lets be swapped at all: the same for every swap-out
    threshold, prefetch distance and grouping (the autotuner's grid reuses them)."""
    return [t for t in model.tensors.values() if t.consumers and _is_candidate(model, t, config)]


def _swaps(model: GraphModel, config: LMSConfig, eligible: Sequence[TensorInfo]) -> list[Swap]:
    """:func:`candidate_swaps` of ``eligible`` (:func:`_eligible` of ``model`` under ``config``'s other options)."""
    swaps = [s for t in eligible if (s := _plan_tensor(model, t, config, checked=True)) is not None]
    swaps.sort(key=lambda s: (-s.bytes, -s.distance, s.tensor))
    return swaps


def _is_candidate(model: GraphModel, t: TensorInfo, config: LMSConfig) -> bool:
    node = model.dag.nodes[t.op]
    op_type = node["type"]
    phases = ("forward", "backward") if "swap_gradients" in config.policy else ("forward",)
    if node["phase"] not in phases or op_type in EXCLUDED_PRODUCER_TYPES or is_collective(op_type):
        return False
    if t.dtype in EXCLUDED_DTYPES or t.rank is None or t.rank < 2 or t.bytes < config.knobs.min_bytes:
        return False
    if any(d is None for d in t.shape[1:]):
        # Its size cannot be told (only the leading, batch dimension is sized by batch_size):
        # the plan's bytes and the simulator's swap-in copy would be guesses, e.g. a
        # Tensordot Reshape to (None, None) counted as batch x 4 bytes.
        return False
    if same_device(node["device"], config.host):
        return False
    if op_type in ("Transpose", "ConjugateTranspose") and all(
        model.dag.nodes[c]["type"] in TRANSPOSE_FOLDING_TYPES for c, _ in t.consumers
    ):
        return False  # Grappler folds it into its readers: it does not run in the plain step
    if model.dag.nodes[buffer_owner(model, t.name).op]["type"] in RESIDENT_OP_TYPES:
        return False  # a view of a weight, an input or a constant: it stays on the device anyway
    if config.knobs.incl_types and op_type not in config.knobs.incl_types:
        return False
    if op_type in config.knobs.excl_types:
        return False
    if config.knobs.incl_scopes and not t.op.startswith(config.knobs.incl_scopes):
        return False
    return not (config.knobs.excl_scopes and t.op.startswith(config.knobs.excl_scopes))


def _plan_tensor(model: GraphModel, t: TensorInfo, config: LMSConfig, checked: bool = False) -> Swap | None:
    """``t``'s swap under ``config``, or None; ``checked``: ``t`` is known to be :func:`_eligible`."""
    if not checked and (not t.consumers or not _is_candidate(model, t, config)):
        return None
    nodes = model.dag.nodes
    level = nodes[t.op]["level"]
    far = sorted(
        (nodes[c]["level"], c, i)
        for c, i in t.consumers
        if nodes[c]["phase"] == "backward" and nodes[c]["level"] - level > config.knobs.swapout_threshold
    )
    # Shape readers need no data: they keep reading the device copy, never a swap-in. With
    # a static shape Grappler folds them into constants; otherwise they run as soon as their
    # inputs exist, unless one waits for the backward pass: that one would keep the device
    # copy alive until then, and the swap would free nothing.
    shape_readers = [c for _, c, _ in far if nodes[c]["type"] in SHAPE_OP_TYPES]
    if shape_readers:
        static = t.shape is not None and None not in t.shape
        if not static and any(_waits_for_backward(model, c) for c in shape_readers):
            return None
        far = [item for item in far if nodes[item[1]]["type"] not in SHAPE_OP_TYPES]
    if any((nodes[c]["type"], i) in PINNED_INPUTS for _, c, i in far) and pins_inputs(config):
        return None  # the device copy lives until that backward op anyway: a swap would free nothing
    if not far:
        return None
    swap_ins = []
    for group in group_by_level(far, config.knobs.swapin_groupby):
        first_level, first_op, _ = group[0]
        trigger = _find_trigger(model, first_op, first_level - config.knobs.swapin_ahead, t.op, config)
        if trigger is None:
            return None  # nothing would hold the swap-in back: it would come back right after it left
        swap_ins.append(group_swap_in(model, group, trigger))
    return tensor_swap(model, t, level, swap_ins)


def group_swap_in(model: GraphModel, group: Sequence[tuple[int, str, int]], trigger: str | None) -> SwapIn:
    """The swap-in of ``group`` (its consumers' ``(level, op, input index)``, earliest first), after ``trigger``."""
    return SwapIn(
        consumers=tuple((c, i) for _, c, i in group),
        trigger=trigger,
        level=group[0][0],
        trigger_level=None if trigger is None else model.dag.nodes[trigger]["level"],
    )


def tensor_swap(model: GraphModel, t: TensorInfo, level: int, swap_ins: Sequence[SwapIn]) -> Swap:
    """The swap of ``t`` (produced at ``level``) with ``swap_ins`` (one at least, earliest first):
    its distance is from ``level`` to the first swap-in's consumers."""
    return Swap(
        tensor=t.name,
        producer=t.op,
        producer_type=model.dag.nodes[t.op]["type"],
        dtype=t.dtype,
        shape=t.shape,
        bytes=t.bytes,
        level=level,
        distance=swap_ins[0].level - level,
        swap_ins=tuple(swap_ins),
    )


def group_by_level(items: list[tuple[int, ...]], groupby: int) -> list[list[tuple[int, ...]]]:
    """Swap-in groups of ``items`` (tuples starting with a level, sorted): each item joins the
    group before it when within ``groupby`` levels of that group's first item.

    >>> group_by_level([(10,), (12,), (16,), (40,)], groupby=5)
    [[(10,), (12,)], [(16,)], [(40,)]]
    """
    groups: list[list[tuple[int, ...]]] = []
    for item in items:
        if groups and item[0] - groups[-1][0][0] <= groupby:
            groups[-1].append(item)
        else:
            groups.append([item])
    return groups


def _waits_for_backward(model: GraphModel, op: str) -> bool:
    """Whether ``op`` depends (through data or control edges) on a backward op."""
    return op in _after_backward(model.dag)


def _after_backward(dag: nx.DiGraph) -> frozenset[str]:
    """The ops that depend (through data or control edges) on a backward op of ``dag``: what the
    backward ops reach, each in one search; kept per DAG (a model's DAG is not edited once made;
    the node count is a cheap guard)."""
    size = dag.number_of_nodes()
    known = _AFTER_BACKWARD.get(dag)
    if known is not None and known[0] == size:
        return known[1]
    found: set[str] = set()
    frontier = [c for n, phase in dag.nodes(data="phase") if phase == "backward" for c in dag.successors(n)]
    while frontier:
        n = frontier.pop()
        if n not in found:
            found.add(n)
            frontier.extend(dag.successors(n))
    _AFTER_BACKWARD[dag] = (size, frozenset(found))
    return _AFTER_BACKWARD[dag][1]


#: Per DAG: (node count when made, :func:`_after_backward`).
_AFTER_BACKWARD: weakref.WeakKeyDictionary[nx.DiGraph, tuple[int, frozenset[str]]] = weakref.WeakKeyDictionary()


def _find_trigger(model: GraphModel, consumer: str, target_level: int, producer: str, config: LMSConfig) -> str | None:
    """The swap-in trigger for a group whose first consumer is ``consumer``.

    The lowest-level backward ancestor of ``consumer`` with level >= ``target_level``
    (and above the producer); when there is none in that window, the highest-level
    backward ancestor below it. Levels strictly grow along edges, so only
    ancestors above the relevant level are walked.

    A tensor of the backward pass (``swap_gradients``) gets only a trigger that descends
    from its producer: a sibling of the producer (both read the same gradient, e.g. a
    BatchNorm gradient's ``moments/Mul`` next to its ``moments/sub``) may run before it,
    and the swap-in would then come back as soon as it left: it would free the tensor only
    for its round trip over the link, which the simulator (it has no time) cannot credit.
    A forward tensor's trigger is not checked so: it is a backward op, which in the test
    models always descends from the forward tensor through the loss
    (``tests/plan/test_useful_swaps.py``), and the check would walk most of the step per tensor.
    """
    nodes = model.dag.nodes
    producer_level = nodes[producer]["level"]
    low = max(target_level, producer_level + 1)
    after = None
    if nodes[producer]["phase"] == "backward":
        # Every path from the producer to the consumer runs through ancestors of the consumer above the producer.
        below = _ancestors_down_to(model, consumer, producer_level + 1)
        after = nx.descendants(model.dag.subgraph([u for u, _ in below] + [producer]), producer)
        window = [(u, lu) for u, lu in below if lu >= low]
    else:
        window = below = _ancestors_down_to(model, consumer, low)

    def eligible(u: str) -> bool:
        data = nodes[u]
        return (
            data["phase"] == "backward"
            and not is_collective(data["type"])
            and data["type"] not in CONTROL_FLOW_OP_TYPES
            and not same_device(data["device"], config.host)
            and (after is None or u in after)
        )

    in_window = [(lu, u) for u, lu in window if eligible(u)]
    if in_window:
        return min(in_window)[1]
    if after is None:
        below = _ancestors_down_to(model, consumer, producer_level + 1)
    earlier = [(-lu, u) for u, lu in below if lu < target_level and eligible(u)]
    return min(earlier)[1] if earlier else None


def _ancestors_down_to(model: GraphModel, op: str, min_level: int) -> list[tuple[str, int]]:
    """Ancestors of ``op`` with level >= ``min_level``, as (name, level)."""
    dag = model.dag
    found = []
    seen = {op}
    stack = [op]
    while stack:
        n = stack.pop()
        for u in dag.predecessors(n):
            if u in seen:
                continue
            seen.add(u)
            lu = dag.nodes[u]["level"]
            if lu >= min_level:
                stack.append(u)
                found.append((u, lu))
    return found
