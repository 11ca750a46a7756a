"""Apply a :class:`~tflms.SwapPlan` to a (copied) FuncGraph: :func:`apply_plan` runs the rewrite
of each pass of :data:`tflms.plan.registry.PASSES`, in registry order, on the graph. What each pass
adds is documented with its class (:mod:`tflms.plan.passes`): the chains of ``AddV2`` of
``split_sums`` first (:class:`~tflms.plan.passes.sums.SplitSums`) and the ops made again for the
left-out tiles of ``drop_tiles`` (:class:`~tflms.plan.passes.tiles.DropTiles`), which the other
decisions name; then the recompute clones (:class:`~tflms.plan.passes.recompute.RecomputePass`),
the swap-outs, swap-ins and landings (:class:`~tflms.plan.passes.swaps.Swaps`), the fences
(:class:`~tflms.plan.passes.swaps.Fences`) and the ordering edges
(:class:`~tflms.plan.passes.orders.OrderUpdates`).

Before the first pass that adds control edges (:attr:`~tflms.plan.passes.base.Pass.adds_edges`)
edits the graph, every such pass says which edges it will add
(:meth:`~tflms.plan.passes.base.Pass.edges`), and a plan whose edges would make a cycle is refused
(:func:`_check_acyclic`). The offload of the optimizer or the weights (:func:`apply_offload`) and a
placement (:func:`apply_placement`) are applied by their own functions: they are no passes.
"""

from __future__ import annotations

import logging
from typing import Any

import networkx as nx
import tensorflow as tf

from .. import _tf_internal as tfi
from ..ir.decisions import RECOMPUTE_SCOPE
from ..plan.passes.base import Edges, GraphEdit, op_dag
from ..plan.passes.orders import ORDER_SCOPE, order_gate_name
from ..plan.passes.swaps import LANDING_SCOPE, SWAP_ATTR, SWAP_IN_SCOPE, SWAP_OUT_SCOPE, is_landing, landing_name
from ..plan.records import SwapPlan
from ..plan.registry import PASSES

log = logging.getLogger("tflms.passes")

__all__ = [
    "apply_plan",
    "SWAP_OUT_SCOPE",
    "SWAP_IN_SCOPE",
    "LANDING_SCOPE",
    "RECOMPUTE_SCOPE",
    "SWAP_ATTR",
    "ORDER_SCOPE",
    "is_landing",
    "is_rewritten",
    "landing_name",
    "order_gate_name",
    "apply_offload",
    "apply_placement",
]


def is_rewritten(graph: Any) -> bool:
    """True if ``graph`` already holds an op that a pass's rewrite added or changed
    (:meth:`~tflms.plan.passes.base.Pass.rewrote`: swap ops, recompute clones, split sums, ops made
    again for left-out tiles, ordering edges), or that an offload or a placement placed."""
    for op in graph.get_operations():
        attr = _swap_attr(op)
        if attr in (b"offload", b"place") or any(p.rewrote(op, attr) for p in PASSES):
            return True
    return False


def apply_offload(graph: Any, ops: Any, host: str, transfers: Any = (), device: str | None = None) -> int:
    """Place the update ops ``ops`` (names, :attr:`tflms.plan.passes.offload.OffloadDecisions.ops`)
    of ``graph`` on ``host``, in place, for ``offload="optimizer"`` or ``"weights"``; return how
    many were placed.

    Each op is marked ``_tflms_swap="offload"``. The ops on variables (reads, assigns) are not
    given a device: TensorFlow's placer puts each beside its variable, so a weight's assign stays
    beside the weight and reads the change computed on the host.

    ``transfers`` (:attr:`~tflms.plan.passes.offload.OffloadDecisions.transfers`, with
    ``offload="weights"``): for each swap-in of each, a host ``Identity`` (the send, named
    :func:`tflms.plan.passes.offload_weights.weight_in_name`) reads the weight's host tensor with a
    control input from the swap-in's trigger, and an ``Identity`` on ``device`` (the landing,
    :func:`tflms.plan.passes.offload.weight_landing_name`) reads it; the group's consumers are
    rewired to the landing. The gate sits on the host side of the transfer, as a swap-in's does
    (see the module doc), so the copy leaves the host only after the trigger ran.
    """
    from ..plan.passes.offload import weight_landing_name
    from ..plan.passes.offload_weights import weight_in_name

    def op_named(name: str) -> Any:
        try:
            return graph.get_operation_by_name(name)
        except (KeyError, ValueError):
            raise ValueError(
                f"offload does not fit this function: no op {name!r}. Decide it on the same traced "
                f"function. Received: graph {graph.name!r}"
            ) from None

    for name in ops:
        op = op_named(name)
        tfi.set_device(op, host)
        tfi.set_attr(op, SWAP_ATTR, "offload")
    n_in = 0
    for swap in transfers:
        tensor = op_named(swap.producer).outputs[int(swap.tensor.rpartition(":")[2])]
        for k, swap_in in enumerate(swap.swap_ins):
            with graph.as_default(), tf.control_dependencies(None):
                with tf.device(host):
                    send = tf.identity(tensor, name=weight_in_name(swap.tensor, k))
                with tf.device(device or ""):
                    land = tf.identity(send, name=weight_landing_name(swap.tensor, k))
            for op, kind in ((send.op, "offload"), (land.op, "landing")):
                tfi.set_attr(op, "_grappler_do_not_remove", True)
                tfi.set_attr(op, SWAP_ATTR, kind)
            if swap_in.trigger is not None:
                tfi.add_control_input(send.op, op_named(swap_in.trigger))
            for op_name, index in swap_in.consumers:
                consumer = op_named(op_name)
                if index >= len(consumer.inputs) or consumer.inputs[index].name != tensor.name:
                    raise ValueError(
                        f"offload does not fit this function: input {index} of {op_name!r} is not {swap.tensor!r}. "
                        f"Decide it on the same traced function. Received: graph {graph.name!r}"
                    )
                tfi.update_input(consumer, index, land)
            n_in += 1
    if ops or n_in:
        log.info("tflms offload on %s: %d ops placed on %s, %d weight copies gated", graph.name, len(ops), host, n_in)
    return len(ops)


def apply_placement(graph: Any, placement: Any) -> int:
    """Place each op of ``graph`` on its stage's device (``placement``: the
    :class:`~tflms.ir.decisions.Stage` records of a plan, :mod:`tflms.plan.passes.place`), in place;
    return how many ops were given a device. TensorFlow's partitioner then sends each tensor that
    crosses devices.

    Each placed op is marked ``_tflms_swap="place"``. The ``Placeholder`` ops (the arguments and the
    variables' handles) and the ops that read a resource (a variable's reads and writes) are not given a
    device: TensorFlow's placer puts each beside its variable. Placing a graph again sets the same
    devices: it changes nothing.
    """
    count = 0
    for stage in placement:
        for name in stage.ops:
            try:
                op = graph.get_operation_by_name(name)
            except (KeyError, ValueError):
                raise ValueError(
                    f"the placement does not fit this function: no op {name!r}. Make the plan from the same traced "
                    f"function. Received: graph {graph.name!r}"
                ) from None
            if op.type == "Placeholder" or any(t.dtype == tf.resource for t in op.inputs):
                continue
            tfi.set_device(op, stage.device)
            tfi.set_attr(op, SWAP_ATTR, "place")
            count += 1
    if count:
        log.info("tflms placement on %s: %d ops placed on %d devices", graph.name, count, len(placement))
    return count


def _swap_attr(op: Any) -> bytes | None:
    try:
        return op.get_attr(SWAP_ATTR)
    except ValueError:
        return None


def apply_plan(graph: Any, plan: SwapPlan, device: str, host: str, *, swap_in_on: str = "host") -> dict[str, int]:
    """Edit ``graph`` in place, the rewrite of one pass of :data:`tflms.plan.registry.PASSES` after
    the other, in registry order; return op-count changes, e.g.
    ``{'sum': 0, 'tile': 0, 'recompute': 0, 'swap_out': 3, 'swap_in': 4, 'landing': 4, 'fence': 0, 'order': 0}``.
    Each pass logs the ops it added (logger ``tflms.passes``).

    ``device`` is where the step runs (its unplaced ops and the consumers of swap-ins);
    every swap op is placed on ``host``. ``swap_in_on='device'`` instead places the
    swap-ins on ``device``: the copy back then happens right after the
    swap-out and frees nothing (and there is no landing). It exists only so that a test
    can pin that TensorFlow fact; never use it to train.
    """
    if swap_in_on not in ("host", "device"):
        raise ValueError(f"swap_in_on must be 'host' or 'device'. Received: swap_in_on={swap_in_on!r}")
    edit = GraphEdit(graph, plan, device, host, swap_in_on)
    counts: dict[str, int] = {}
    first_edges = next(i for i, p in enumerate(PASSES) if p.adds_edges)
    for i, p in enumerate(PASSES):
        if i == first_edges:
            _check_acyclic(edit, [q.edges(edit) for q in PASSES[i:] if q.adds_edges])
        n_ops = len(graph.get_operations())
        counts.update(p.rewrite(edit))
        if getattr(plan, p.field):
            log.info("tflms pass %s on %s: ops +%d", p.name, graph.name, len(graph.get_operations()) - n_ops)
    return counts


def _check_acyclic(edit: GraphEdit, edges: list[Edges]) -> None:
    """Refuse, before any pass that adds control edges edits the graph, a plan whose edges
    (``edges``: each such pass's :meth:`~tflms.plan.passes.base.Pass.edges`) would make a cycle.

    Each trigger runs before its group's consumers (through the swap-in or the clones),
    each fence's op after the producer of its tensor (through the swap-out), and each
    order's op after its ``after``. A hand-edited plan can break that (a fence op upstream of
    its tensor, a trigger after a consumer); TensorFlow would only refuse the graph when the
    step first runs. Names the graph does not have are left to the lookups that report them.
    """
    dag = op_dag(edit.graph)
    added: Edges = {}
    for found in edges:
        for edge, what in found.items():
            added.setdefault(edge, what)
    dag.add_edges_from(edge for edge in added if edge[0] in dag and edge[1] in dag)
    if nx.is_directed_acyclic_graph(dag):  # linear; nx.find_cycle on a whole step takes minutes
        return
    loops = list(nx.selfloop_edges(dag))
    if loops:
        cycle = loops[:1]
    else:
        component = next(c for c in nx.strongly_connected_components(dag) if len(c) > 1)
        cycle = nx.find_cycle(dag.subgraph(component))
    culprits = [added[(u, v)] for u, v in cycle if (u, v) in added]
    path = " -> ".join([u for u, _ in cycle][:6] + ["..."] * (len(cycle) > 6))
    raise edit.error(f"its {'; '.join(culprits) or 'ordering edges'} would make a cycle ({path})")
