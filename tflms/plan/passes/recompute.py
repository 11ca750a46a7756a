"""Recompute instead of swap: which tensors, their producer chains, and the model with them.

A swap candidate (:func:`tflms.plan.candidates.candidate_swaps`) is *recomputable* when its
producer and the forward ops it needs, walking up, are all of
:data:`RECOMPUTE_OP_TYPES` (cheap, deterministic element-wise ops and views; never
random or stateful ones), at most :data:`MAX_OPS` of them, and every input the chain
reads from outside is on the device at the backward pass anyway ("available"):

* a view of a weight, an input or a constant (it stays resident);
* smaller than ``min_bytes`` (keeping it until the backward pass costs little);
* another swap candidate that is not recomputed itself (it is back on the device for
  its own backward consumers; the clone becomes one more of them);
* a tensor whose device copy is read at or after the last group's recompute anyway.

Per consumer group of the swap (the same groups as its swap-ins), the chain's clones run
after a trigger: the backward op just before the group's first consumer (as a swap-in's,
with ``swapin_ahead=1``), so the recomputed tensor lives only from there to the group's
last consumer.

Cost model (KARMA-like, per tensor, in seconds; options of :class:`tflms.LMSConfig`):

* swap: ``(1 + swap-ins) x (link_latency + bytes / link_bandwidth)``;
* recompute: per group, ``OP_LATENCY`` per op plus the chain's bytes read and written
  over ``device_bandwidth``, plus one swap-in per group of clones that reads a swapped
  source outside that source's own swap-in groups (a source read twice by one chain is
  charged once).

Candidates are taken greedily, the largest saving first; a candidate is recomputed
when its recompute costs less than its swap, it is not a source of a recompute already
taken, and its chain reads no recomputed tensor (those are not on the device). Keep,
swap or recompute: what is neither swapped nor recomputed is kept; the budget
(:mod:`tflms.plan.autotune`) then decides how many of the remaining candidates are swapped.

The chosen recomputes are applied to the graph model (:func:`with_recomputes`): the
clones become ops of the model and the far consumers read them, so the swap planner and
the simulator see the step as it will run. The result is deterministic.

The rewrite (:class:`RecomputePass`) adds the same clones to the TensorFlow graph: for each
consumer group a clone of each op of the chain, on the device (or the original op's device),
named ``tflms_recompute/<producer>/<group>/<op>``, reading the clones before it and the original
tensors otherwise, with a control input from the group's trigger on every clone; the group's
consumers are rewired to the last clone. Clones carry ``_tflms_swap="recompute"`` but, unlike swap
ops, not ``_grappler_do_not_remove``: with it, Grappler's arithmetic optimizer rewrites the original
ops (ResNet50's BatchNorm-ReLU chains) and not their clones, and the two compute different numbers;
without it the clones get the same rewrites, and their control input from the trigger keeps them
distinct from the originals, so they survive (``tests/rewrite/test_zoo.py`` checks both). A swap
whose consumer is a clone then rewires the clone's input, as for any consumer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ...config import LMSConfig
from ...ir.decisions import RECOMPUTE_SCOPE, Recompute, Swap, SwapIn
from ...ir.graph import GraphModel, op_records
from ..candidates import RESIDENT_OP_TYPES, _find_trigger, buffer_owner, candidate_swaps, group_by_level
from ..records import link_seconds, recompute_seconds
from .base import Edges, GraphEdit, Pass, changed
from .swaps import group_ops

if TYPE_CHECKING:
    from ...emulate.simulator import Simulator

__all__ = [
    "RECOMPUTE_OP_TYPES",
    "MAX_OPS",
    "RecomputePass",
    "plan_recomputes",
    "with_recomputes",
    "with_planned_recomputes",
    "recompute_cost",
    "swap_cost",
]

#: Op types whose clones compute the same bytes as the forward op: element-wise
#: arithmetic and activations (deterministic kernels, no state, no randomness), bias
#: adds, padding and views.
RECOMPUTE_OP_TYPES = frozenset(
    {
        "Abs", "Add", "AddV2", "BiasAdd", "Cast", "ClipByValue", "Elu", "Erf", "Erfc", "Exp", "ExpandDims",
        "Gelu", "LeakyRelu", "Maximum", "Minimum", "Mul", "Neg", "Pad", "RealDiv", "Relu", "Relu6", "Reshape",
        "Rsqrt", "Selu", "Sigmoid", "Softplus", "Sqrt", "Square", "SquaredDifference", "Squeeze", "Sub", "Tanh",
    }
)  # fmt: skip
#: Longest chain of ops one recompute runs again.
MAX_OPS = 8


def swap_cost(swap: Swap, config: LMSConfig) -> float:
    """Predicted link seconds of ``swap``: one swap-out and its swap-ins."""
    return link_seconds([swap], config.knobs.link_bandwidth, config.knobs.link_latency)


def recompute_cost(recompute: Recompute, extra_swap_in_bytes: Iterable[int], config: LMSConfig) -> float:
    """Predicted seconds of ``recompute`` (see module doc), with the extra swap-ins it causes."""
    compute = recompute_seconds([recompute], config.knobs.device_bandwidth)
    return compute + sum(config.knobs.link_latency + b / config.knobs.link_bandwidth for b in extra_swap_in_bytes)


def plan_recomputes(model: GraphModel, config: LMSConfig, swaps: Sequence[Swap] | None = None) -> list[Recompute]:
    """The candidates of ``swaps`` (default: every candidate under ``config``) to recompute, by the
    cost model of the module doc, in producer-level order."""
    swaps = candidate_swaps(model, config) if swaps is None else list(swaps)
    by_tensor = {s.tensor: s for s in swaps}
    options = []
    for s in swaps:
        found = _chain(model, s, config, by_tensor, frozenset())
        if found is not None:
            saving = swap_cost(s, config) - recompute_cost(*found, config)
            if saving > 0:
                options.append((-saving, s.tensor, found))
    chosen: dict[str, Recompute] = {}
    sources: set[str] = set()
    for _, tensor, found in sorted(options, key=lambda o: o[:2]):
        if tensor in sources:
            continue  # a chosen recompute reads it: its device copy must come back
        s = by_tensor[tensor]
        if _sources(model, found[0]) & chosen.keys():
            # It reads a recomputed tensor, which is not on the device: walk up through it.
            found = _chain(model, s, config, by_tensor, frozenset(chosen))
            if found is None or recompute_cost(*found, config) >= swap_cost(s, config):
                continue
        chosen[tensor] = found[0]
        sources.update(_sources(model, found[0]))
    return sorted(chosen.values(), key=lambda r: (r.level, r.tensor))


def with_planned_recomputes(model: GraphModel, config: LMSConfig) -> tuple[GraphModel, list[Recompute]]:
    """``(model with the recomputes applied, the recomputes)`` that :func:`plan_recomputes` picks under
    ``config`` (its budget and ``n_tensors`` ignored: they decide the swaps, afterwards)."""
    recomputes = plan_recomputes(model, config.replace(budget=None).with_knobs(n_tensors=None))
    return with_recomputes(model, recomputes), recomputes


def with_recomputes(model: GraphModel, recomputes: Sequence[Any]) -> GraphModel:
    """``model`` with the clones of ``recomputes`` (:class:`tflms.ir.decisions.Recompute`) added, and
    each group's consumers reading its clones; ``model`` itself when there are none.

    Per group, each op of the chain gets a clone named :meth:`Recompute.clone`, reading the
    clones before it and the original tensors otherwise, with a control edge from the
    group's trigger: the ops the rewrite adds (:meth:`RecomputePass.rewrite`), so that the planner
    and the simulator see the step as it will run.
    """
    if not recomputes:
        return model
    tensors = model.tensors
    records = op_records(model)
    for rc in recomputes:
        for k, group in enumerate(rc.groups):
            for name in rc.ops:
                inputs = [rc.clone_tensor(t, k) if tensors[t].op in rc.ops else t for t in model.inputs_of[name]]
                clone = rc.clone(name, k)
                records[clone] = {**records[name], "name": clone, "inputs": inputs, "control_inputs": [group.trigger]}
            for consumer, index in group.consumers:
                if records[consumer]["inputs"][index] != rc.tensor:
                    raise ValueError(
                        f"The recompute of {rc.tensor!r} does not fit this model: input {index} of {consumer!r} "
                        f"is {records[consumer]['inputs'][index]!r}. Make the plan from this model."
                    )
                records[consumer]["inputs"][index] = rc.output(k)
    return GraphModel.from_ops(
        records.values(), variable_bytes=model.variable_bytes, name=model.name, variables=model.variables
    )


class RecomputePass(Pass):
    """Cheap tensors recomputed, not swapped (the pass ``recompute`` of a policy)."""

    name, field, policy, adds_edges = "recompute", "recomputes", True, True

    def names(self, decisions: Sequence[Recompute]) -> list[str]:
        return [name for r in decisions for name in (r.producer, *r.ops, *group_ops(r.groups))]

    def made(self, decisions: Sequence[Recompute]) -> set[str]:
        return {rc.clone(op, k) for rc in decisions for k in range(len(rc.groups)) for op in rc.ops}

    def prepare(
        self, model: GraphModel, config: LMSConfig, sim: Simulator | None
    ) -> tuple[GraphModel, tuple, Simulator | None]:
        return changed(*with_planned_recomputes(model, config), sim)

    def replay(self, model: GraphModel, decisions: Sequence[Any]) -> GraphModel:
        return with_recomputes(model, decisions)

    def rewrote(self, op: Any, attr: bytes | None) -> bool:
        return op.name.startswith(RECOMPUTE_SCOPE + "/")

    def edges(self, edit: GraphEdit) -> Edges:
        """Each group's trigger runs before its consumers (through the clones)."""
        added: Edges = {}
        for rc in edit.plan.recomputes:
            for group in rc.groups:
                for consumer, _ in group.consumers:
                    added.setdefault((group.trigger, consumer), f"recompute trigger {group.trigger!r} of {rc.tensor!r}")
        return added

    def rewrite(self, edit: GraphEdit) -> dict[str, int]:
        """Add the clones of the plan's recomputes and rewire their consumers (see the module doc)."""
        import tensorflow as tf

        from ... import _tf_internal as tfi
        from .swaps import mark

        graph, n = edit.graph, 0
        for rc in edit.plan.recomputes:
            target = edit.tensor(rc.tensor)
            originals = [edit.op("recomputed op", name) for name in rc.ops]
            for k, group in enumerate(rc.groups):
                trigger = edit.op("trigger op", group.trigger)
                clones: dict[str, Any] = {}
                for op in originals:
                    inputs = [clones[t.op.name].outputs[t.value_index] if t.op.name in clones else t for t in op.inputs]
                    with graph.as_default(), tf.control_dependencies(None), tf.device(op.device or edit.device):
                        clone = tfi.clone_op(graph, op, inputs, rc.clone(op.name, k))
                    mark(clone, "recompute", keep=False)
                    tfi.add_control_input(clone, trigger)
                    clones[op.name] = clone
                    n += 1
                edit.rewire(group.consumers, target, clones[rc.producer].outputs[target.value_index], rc.tensor)
        return {"recompute": n}


def _sources(model: GraphModel, rc: Recompute) -> set[str]:
    inside = set(rc.ops)
    return {t for op in rc.ops for t in model.inputs_of[op] if model.tensors[t].op not in inside}


def _chain(
    model: GraphModel, swap: Swap, config: LMSConfig, candidates: dict[str, Swap], recomputed: frozenset[str]
) -> tuple[Recompute, list[int]] | None:
    """``(recompute of swap's tensor, bytes of the extra swap-ins it causes)`` or None when not recomputable."""
    nodes = model.dag.nodes
    # The clones of every group read the chain's outside inputs: each must be there at the
    # latest group's level, and a swapped one needs a swap-in wherever no group of its own
    # covers a group's level.
    levels = [si.level for si in swap.swap_ins]
    ops: list[str] = []
    swapped_sources: set[str] = set()
    stack = [swap.producer]
    seen: set[str] = set()
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        node = nodes[op]
        if node["type"] not in RECOMPUTE_OP_TYPES or node["phase"] != "forward" or len(model.outputs_of[op]) != 1:
            return None
        if any(model.dag.edges[u, op]["control"] for u in model.dag.predecessors(op)):
            return None  # it waits for something the clone would not
        ops.append(op)
        if len(ops) > MAX_OPS:
            return None
        for name in model.inputs_of[op]:
            if name in recomputed:  # not on the device: walk up through it
                stack.append(model.tensors[name].op)
            elif name in candidates:
                swapped_sources.add(name)
            elif not _available(model, name, max(levels), config):
                stack.append(model.tensors[name].op)
    ops.sort(key=lambda o: (nodes[o]["level"], o))  # the producer, a descendant of every other, is last
    extra = [
        b
        for name in sorted(swapped_sources)
        if model.tensors[name].op not in seen  # else the clones make it
        for b in _extra_swap_ins(model, candidates[name], levels, config)
    ]
    work = sum(model.tensors[o].bytes for op in ops for o in model.outputs_of[op] + model.inputs_of[op])
    groups = []
    for si in swap.swap_ins:
        first_op = min(si.consumers, key=lambda c: (nodes[c[0]]["level"], c))[0]
        trigger = _find_trigger(model, first_op, si.level - 1, swap.producer, config)
        if trigger is None:
            return None
        groups.append(SwapIn(si.consumers, trigger, si.level, nodes[trigger]["level"]))
    rc = Recompute(
        tensor=swap.tensor,
        producer=swap.producer,
        ops=tuple(ops),
        bytes=swap.bytes,
        work_bytes=work,
        level=swap.level,
        distance=swap.distance,
        groups=tuple(groups),
    )
    return rc, extra


def _available(model: GraphModel, name: str, level: int, config: LMSConfig) -> bool:
    """Whether tensor ``name`` is on the device at backward level ``level`` without help."""
    t = model.tensors[name]
    if t.bytes < config.knobs.min_bytes:
        return True
    if model.dag.nodes[buffer_owner(model, name).op]["type"] in RESIDENT_OP_TYPES:
        return True
    return any(model.dag.nodes[c]["level"] >= level for c, _ in t.consumers)


def _extra_swap_ins(model: GraphModel, source: Swap, levels: Sequence[int], config: LMSConfig) -> list[int]:
    """``source.bytes`` once per swap-in group that reads at ``levels`` add to ``source``'s own."""
    own = sorted((model.dag.nodes[c]["level"],) for si in source.swap_ins for c, _ in si.consumers)
    before = len(group_by_level(own, config.knobs.swapin_groupby))
    after = len(group_by_level(sorted(own + [(level,) for level in levels]), config.knobs.swapin_groupby))
    return [source.bytes] * (after - before)
