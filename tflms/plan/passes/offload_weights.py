"""``offload="weights"``: the weights live on the host and come to the device for each use, host-gated.

What the step looks like with the weights offloaded (decided from the step alone by
:func:`weight_decisions`, on top of :func:`tflms.plan.passes.offload.offload_decisions`, so a plan's
``offload`` option is enough to make it again):

* the **weights** are the variables that the update writes after the backward pass (the
  trainable variables the optimizer updates): they live on the host, with the optimizer's state.
  A variable that the update does not write (a BatchNorm's moving statistics, a frozen layer's
  kernel) stays on the device;
* the **weight side**: the reads of the weights (``ReadVariableOp``, which TensorFlow's placer
  puts beside their variable) and the forward ops that read nothing but them and constants (a
  ``Reshape`` or ``Cast`` of a kernel) run on the host;
* **transfers**: each tensor of the weight side that device ops read comes to the device once per
  group of those ops, as a swapped tensor's swap-in does: its consumers, sorted by level, are
  grouped (a group spans at most :data:`GROUPBY` levels: the forward use and the backward use of
  a weight are two groups), and each group's copy is sent by a host ``Identity`` with a control
  input from a **trigger**, a device op about :data:`AHEAD` levels before the group's first
  consumer, on a path to it, and not among the group's nearest inputs (:data:`NEAR`: an op fused
  with a consumer would wait for itself). The copy lands on the device (an ``Identity`` there, named as a
  swap-in's landing) and the group reads it; it is freed after the group's last reader. So only
  the weights of the layers being computed are on the device at a time. A group with no device
  op before it (the first layer's) has no trigger: its copy is sent when the step starts;
* the update runs on the host, the weights' assigns included, and each gradient is sent there as
  soon as the backward pass made it (as with ``offload="optimizer"``).

The transfers are :class:`~tflms.ir.decisions.Swap` records whose producer is on the host: the
tensor is already there, so only their swap-ins exist. :func:`tflms.plan.passes.offload.with_offload`
makes the graph model of the step so placed for the simulator (each landing a device op that
allocates the weight's bytes when its swap-in arrives), and
:func:`tflms.rewrite.apply.apply_offload` makes the same ops on the TensorFlow graph.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection

import networkx as nx

from ...ir.decisions import Swap
from ...ir.graph import CONTROL_FLOW_OP_TYPES, SUM_OP_TYPES, GraphModel
from ..candidates import group_by_level, group_swap_in, tensor_swap

__all__ = ["AHEAD", "GROUPBY", "WEIGHT_IN_SCOPE", "weight_in_name", "weight_side", "weight_transfers"]

#: A weight's copy is triggered by an op about this many levels before the first op that reads it.
AHEAD = 3
#: The device ops reading one weight tensor within this many levels of the first share one copy.
GROUPBY = 5
#: A trigger is never within this many data edges upstream of the ops its copy feeds (:func:`_near_inputs`).
NEAR = 2
#: Name scope of the host ``Identity`` that sends a weight's copy (its swap-in).
WEIGHT_IN_SCOPE = "tflms_weightin"
#: Ops never chosen as a trigger: they are not a point in the step's time (no inputs), Grappler
#: removes them (``IdentityN``), their body is another function, or they are sums: Grappler's
#: arithmetic optimizer folds a tree of sums into an ``AddN`` only where no member has a control
#: edge, so a trigger there changes how the sum rounds and the step is no longer bit-identical
#: (in the GPT, a LayerNorm's ``add_2`` as the trigger of the next attention's query bias).
_NO_TRIGGER_TYPES = frozenset({"Placeholder", "Const", "IdentityN", "NoOp"}) | CONTROL_FLOW_OP_TYPES | SUM_OP_TYPES


def weight_in_name(tensor: str, k: int) -> str:
    """Name of the host ``Identity`` that sends group ``k``'s copy of weight tensor ``tensor``.

    >>> weight_in_name("dense/Cast/ReadVariableOp:0", 1)
    'tflms_weightin/dense/Cast/ReadVariableOp_0/1'
    """
    return f"{WEIGHT_IN_SCOPE}/{tensor.replace(':', '_')}/{k}"


def weight_side(model: GraphModel, weights: Collection[str], update: Collection[str]) -> list[str]:
    """The ops that run on the host with the weights (handles ``weights``): every forward read of
    a weight (a ``ReadVariableOp`` of it alone), and every forward op, not of ``update``, whose
    inputs are all such ops' outputs or constants (at least one of them a weight's) and whose
    control inputs are such ops too; in graph order."""
    dag, tensors = model.dag, model.tensors
    wanted, skip = set(weights), set(update)
    side: set[str] = set()
    for n in nx.topological_sort(dag):
        data = dag.nodes[n]
        if n in skip or data["phase"] != "forward" or data["type"] in _NO_TRIGGER_TYPES:
            continue
        ins = model.inputs_of[n]
        resources = [t for t in ins if tensors[t].dtype == "resource"]
        controls = [u for u, e in dag.pred[n].items() if e["control"]]
        if resources:
            if data["type"] == "ReadVariableOp" and set(resources) <= wanted and not controls:
                side.add(n)
            continue
        sources = [tensors[t].op for t in ins]
        if (
            any(s in side for s in sources)
            and all(s in side or dag.nodes[s]["type"] == "Const" for s in sources)
            and all(u in side for u in controls)
        ):
            side.add(n)
    return [n for n in dag if n in side]


def weight_transfers(model: GraphModel, side: Collection[str], host_ops: Collection[str]) -> tuple[Swap, ...]:
    """The copies of the weight side's tensors that device ops read: one :class:`Swap` per tensor
    (its producer on the host), one :class:`SwapIn` per group of its device consumers (see the
    module doc), in graph order. ``host_ops``: every op that runs on the host (``side`` included)."""
    nodes = model.dag.nodes
    on_host = set(host_ops) | set(side) | _constant(model)
    swaps = []
    for op in side:
        for name in model.outputs_of[op]:
            t = model.tensors[name]
            readers = sorted((nodes[c]["level"], c, i) for c, i in t.consumers if c not in on_host)
            if not readers or t.dtype in ("resource", "variant"):
                continue
            swap_ins = []
            for group in group_by_level(readers, GROUPBY):
                level, first, _ = group[0]
                near = _near_inputs(model, [c for _, c, _ in group])
                swap_ins.append(group_swap_in(model, group, _trigger(model, first, level - AHEAD, on_host | near)))
            swaps.append(tensor_swap(model, t, nodes[op]["level"], swap_ins))
    return tuple(swaps)


def _constant(model: GraphModel) -> set[str]:
    """The ops that read only constants (and the ``Const`` ops): Grappler folds them, and drops the
    control edges they would send: a copy gated by one leaves the host at the step's start (in the
    GPT, the position embedding's copy gated by an op of its constant indices)."""
    dag, found = model.dag, set()
    for n in nx.topological_sort(dag):
        preds = dag.pred[n]
        if dag.nodes[n]["type"] == "Const" or (preds and all(u in found for u in preds)):
            found.add(n)
    return found


def _near_inputs(model: GraphModel, consumers: list[str], hops: int = NEAR) -> set[str]:
    """The ops within ``hops`` data edges upstream of ``consumers``: never their trigger. Grappler's
    remapper and oneDNN fuse an op with the ops that read it (``Conv2D`` + ``BiasAdd`` + ``Relu``,
    ``MatMul`` + ``BiasAdd``): a trigger fused with a consumer of its own copy waits for itself and
    the step hangs (a kernel's ``Conv2D`` as the trigger of its bias's copy)."""
    dag, found, frontier = model.dag, set(), list(consumers)
    for _ in range(hops):
        frontier = [u for n in frontier for u, e in dag.pred[n].items() if not e["control"] and u not in found]
        found.update(frontier)
    return found


def _trigger(model: GraphModel, consumer: str, target: int, on_host: set[str]) -> str | None:
    """The trigger of a group whose first reader is ``consumer``: its lowest-level device ancestor
    (not in ``on_host``, which holds the ops ruled out) at level ``target`` or above; when there is
    none, its highest-level device ancestor below;
    ``None`` when it has no device ancestor (the group's copy is then sent at the step's start)."""
    dag = model.dag
    nodes = dag.nodes

    def eligible(u: str) -> bool:
        return u not in on_host and nodes[u]["type"] not in _NO_TRIGGER_TYPES and not _collective(nodes[u]["type"])

    seen = {consumer}
    stack, below = [consumer], []
    best: tuple[int, str] | None = None
    while stack:  # the ancestors at ``target`` or above: levels grow along edges
        for u in dag.predecessors(stack.pop()):
            if u in seen:
                continue
            seen.add(u)
            level = nodes[u]["level"]
            if level < target:
                heapq.heappush(below, (-level, u))
                continue
            stack.append(u)
            if eligible(u) and (best is None or (level, u) < best):
                best = (level, u)
    if best is not None:
        return best[1]
    while below:  # the highest-level ancestor below the window
        _, u = heapq.heappop(below)
        if eligible(u):
            return u
        for p in dag.predecessors(u):
            if p not in seen:
                seen.add(p)
                heapq.heappush(below, (-nodes[p]["level"], p))
    return None


def _collective(op_type: str) -> bool:
    return op_type.startswith(("Horovod", "Collective", "NcclAllReduce"))
