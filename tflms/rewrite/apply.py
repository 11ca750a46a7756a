"""Apply a :class:`~tflms.SwapPlan` to a (copied) FuncGraph.

For each swap: one ``Identity`` on ``host`` (the swap-out) reading the device
tensor; for each swap-in a second ``Identity`` **on the host** reading the
swap-out, with a control input from its trigger, then an ``Identity`` on the device
(the landing) reading the swap-in; the consumers of the group (on the device)
rewired to the landing. Every swap op carries ``_grappler_do_not_remove=True`` and
``_tflms_swap`` ("out"/"in"/"landing"). Swap-outs and swap-ins are named under
``tflms_swapout/`` and ``tflms_swapin/``; a landing under the swapped tensor's producer
(:func:`landing_name`), so that Grappler's name sort of a commutative op's inputs keeps
the plain step's order (a three-term ``AddN`` in another order rounds differently).

Why the swap-in sits on the host: TensorFlow's partitioner turns each edge between
devices into a send on the producing side and a receive on the consuming side,
and a receive has no inputs. A swap-in on the device would therefore receive the
tensor as soon as the swap-out holds it, and the trigger would delay only the
``Identity`` after the copy: the tensor would be back on the device for the whole
forward-to-backward gap, freeing nothing. Gated on the host, the send of each
swap-in runs only after its trigger, so the device buffer exists only from the
trigger to the group's last consumer. Each swap-in is its own host tensor, so
each group gets its own transfer (TensorFlow makes one send/receive pair per
tensor and destination device).

Sums (:class:`~tflms.ir.decisions.Sum`, ``split_sums``) are applied first: each ``AddN`` becomes a
chain of ``AddV2`` ops (:func:`tflms.plan.passes.sums.apply_sums`), which the other decisions name. Tiles
(``drop_tiles``) come next: the ops that read a left-out ``Tile``'s value are made again under
``<op>/tflms_bcast`` with its input (:func:`tflms.plan.passes.tiles.apply_tiles`).

Recomputes (:class:`~tflms.ir.decisions.Recompute`) are applied next: for each consumer group
a clone of each op of the chain, on the device (or the original op's device), named
``tflms_recompute/<producer>/<group>/<op>``, reading the clones before it and the
original tensors otherwise, with a control input from the group's trigger on every
clone; the group's consumers are rewired to the last clone. Clones carry
``_tflms_swap="recompute"`` but, unlike swap ops, not ``_grappler_do_not_remove``: with
it, Grappler's arithmetic optimizer rewrote the original BatchNorm-ReLU chain of ResNet50
and not its clones, and the step drifted from step 2 on; without it the clones get the
same rewrites, and their control input from the trigger keeps them distinct from the
originals, so they survive (``tests/rewrite/test_zoo.py`` checks both). A swap whose
consumer is a clone then rewires the clone's input, as for any consumer.

Fences (:class:`~tflms.ir.decisions.Fence`) are control inputs from a swap-out (on the host) to a
forward op on the device: TensorFlow's partitioner turns such an edge into a send of a
control signal after the host's ``Identity`` has its copy, so the op waits for the transfer.
Orders (:class:`~tflms.ir.decisions.Order`) are control inputs between two backward ops on the device;
where ``after`` already reaches an op that Grappler's constant push-down rewrites, on ``Identity``
gates in front of the inputs the op reads after the push-down (see :func:`_implied_orders`).

Why the landing: the consumers then read a tensor of their own device, as in the
plain step. Grappler leaves alone some rewrites whose inputs sit on another device:
constant folding's push-down (``Mul(C, Mul(x, y))`` -> ``Mul(x, Mul(C, y))``) checks
that the parent and both leaves share a device, so with ``y`` read straight from the
host swap-in the constant stays where it was and the product rounds differently (one
ULP in the transformer of ``tests/zoo.py``, seen on an earlier machine; on a 2-CPU AMD
EPYC the direct read was bit-identical too). The landing is an ``Identity``: it
forwards the received buffer and does not change when the tensor arrives.
"""

from __future__ import annotations

import logging
from typing import Any

import networkx as nx
import tensorflow as tf

from .. import _tf_internal as tfi
from ..ir.decisions import RECOMPUTE_SCOPE
from ..plan.passes.sums import apply_sums
from ..plan.passes.tiles import SUFFIX as TILE_SUFFIX
from ..plan.passes.tiles import apply_tiles
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
    "is_rewritten",
    "apply_offload",
    "apply_placement",
]

SWAP_OUT_SCOPE = "tflms_swapout"
SWAP_IN_SCOPE = "tflms_swapin"
LANDING_SCOPE = "tflms_landing"
SWAP_ATTR = "_tflms_swap"
ORDER_SCOPE = "tflms_order"


def landing_name(tensor: str, k: int) -> str:
    """Name of the device-side landing ``Identity`` of swap-in ``k`` of ``tensor``: under the
    producer's name, so that Grappler's name sort of a commutative op's inputs (an ``AddN``
    of three terms) keeps the order of the plain step, and the sum rounds the same.

    >>> landing_name("gradient_tape/bn/mul_1/Mul:0", 1)
    'gradient_tape/bn/mul_1/Mul/tflms_landing_0_1'
    """
    op, _, index = tensor.rpartition(":")
    return f"{op}/{LANDING_SCOPE}_{index}_{k}"


def is_landing(name: str) -> bool:
    """Whether op ``name`` is a landing ``Identity`` (see :func:`landing_name`)."""
    return f"/{LANDING_SCOPE}_" in name


def is_rewritten(graph: Any) -> bool:
    """True if ``graph`` already holds tflms swap ops, recompute clones, split sums, ops made again
    for left-out tiles or ordering edges."""
    scopes = (SWAP_OUT_SCOPE + "/", SWAP_IN_SCOPE + "/", RECOMPUTE_SCOPE + "/", ORDER_SCOPE + "/")
    ops = graph.get_operations()
    return any(op.name.startswith(scopes) or op.name.endswith(f"/{TILE_SUFFIX}") for op in ops) or any(
        (op.control_inputs and _swap_attr(op) == b"order")
        or (op.type == "AddV2" and _swap_attr(op) == b"sum")
        or _swap_attr(op) in (b"offload", b"place")
        for op in ops
    )


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


def _plan_error(plan: SwapPlan, what: str) -> ValueError:
    return ValueError(
        f"The plan does not fit this function: {what}. Make the plan from the same traced "
        f"function (same model, input signature and options). Received: plan for {plan.function!r}"
    )


def apply_plan(graph: Any, plan: SwapPlan, device: str, host: str, *, swap_in_on: str = "host") -> dict[str, int]:
    """Edit ``graph`` in place, one pass of :data:`tflms.plan.registry.PASSES` after the other,
    in registry order; return op-count changes, e.g.
    ``{'swap_out': 3, 'swap_in': 4, 'landing': 4, 'recompute': 0, 'fence': 0, 'order': 0, 'sum': 0, 'tile': 0}``.
    Each pass logs the ops it added (logger ``tflms.passes``).

    ``device`` is where the step runs (its unplaced ops and the consumers of swap-ins);
    every swap op is placed on ``host``. ``swap_in_on='device'`` instead places the
    swap-ins on ``device``, as tflms 0.1 did: the copy back then happens right after the
    swap-out and frees nothing (and there is no landing). It exists only so that a test
    can pin that TensorFlow fact; never use it to train.
    """
    if swap_in_on not in ("host", "device"):
        raise ValueError(f"swap_in_on must be 'host' or 'device'. Received: swap_in_on={swap_in_on!r}")

    def lookup(kind: str, get: Any, name: str) -> Any:
        try:
            return get(name)
        except (KeyError, ValueError):
            raise _plan_error(plan, f"no {kind} {name!r}") from None

    swapped = {s.tensor for s in plan.swaps}
    for fence in plan.fences:
        if fence.tensor not in swapped:
            raise _plan_error(plan, f"fence on {fence.tensor!r}, which the plan does not swap")
    rewrite = _Rewrite(graph, plan, device, host, swap_in_on, lookup)
    for p in PASSES:
        n_ops = len(graph.get_operations())
        getattr(rewrite, p.name)()
        if getattr(plan, p.field):
            log.info("tflms pass %s on %s: ops +%d", p.name, graph.name, len(graph.get_operations()) - n_ops)
    return rewrite.counts


class _Rewrite:
    """The appliers of the registry's passes to one TensorFlow graph, one method a pass (named
    as the pass), sharing what a later pass needs of an earlier one."""

    def __init__(self, graph: Any, plan: SwapPlan, device: str, host: str, swap_in_on: str, lookup: Any) -> None:
        self.graph, self.plan, self.device, self.host, self.swap_in_on, self.lookup = (
            graph, plan, device, host, swap_in_on, lookup,
        )  # fmt: skip
        self.counts = dict.fromkeys(("swap_out", "swap_in", "landing", "recompute", "fence", "order", "sum", "tile"), 0)
        self.gates: dict[int, list[tuple[Any, int]]] = {}
        self.swapped_out: dict[str, Any] = {}

    def split_sums(self) -> None:
        # The other decisions name the chains' ops.
        self.counts["sum"] = apply_sums(self.graph, self.plan.sums, self.device, self.lookup)

    def drop_tiles(self) -> None:
        # The other decisions name the ops made again.
        gone = [s.op for s in self.plan.sums]
        self.counts["tile"] = apply_tiles(self.graph, self.plan.tiles, self.device, self.lookup, gone)

    def recompute(self) -> None:
        # The orders' gates are found, and the orders with the triggers checked for a cycle,
        # on the graph before any clone, swap or order edge is added.
        self.gates = _order_gates(self.graph, self.plan, self.lookup)
        _check_acyclic(self.graph, self.plan, self.gates)
        self.counts["recompute"] = _apply_recomputes(self.graph, self.plan, self.device, self.lookup)

    def swaps(self) -> None:
        graph, plan, device, host, lookup = self.graph, self.plan, self.device, self.host, self.lookup
        tensors = [lookup("tensor", graph.get_tensor_by_name, s.tensor) for s in plan.swaps]
        with graph.as_default(), tf.control_dependencies(None):
            with tf.device(host):
                outs = [
                    tf.identity(t, name=f"{SWAP_OUT_SCOPE}/{s.tensor.replace(':', '_')}")
                    for s, t in zip(plan.swaps, tensors)
                ]
            with tf.device(host if self.swap_in_on == "host" else device):
                backs = [
                    [
                        tf.identity(out, name=f"{SWAP_IN_SCOPE}/{s.tensor.replace(':', '_')}/{k}")
                        for k in range(len(s.swap_ins))
                    ]
                    for s, out in zip(plan.swaps, outs)
                ]
            if self.swap_in_on == "host":
                with tf.device(device):
                    lands = [
                        [tf.identity(b, name=landing_name(s.tensor, k)) for k, b in enumerate(group)]
                        for s, group in zip(plan.swaps, backs)
                    ]
            else:
                lands = backs
        for swap, tensor, out, group, landed in zip(plan.swaps, tensors, outs, backs, lands):
            tfi.set_attr(out.op, "_grappler_do_not_remove", True)
            tfi.set_attr(out.op, SWAP_ATTR, "out")
            for swap_in, back, land in zip(swap.swap_ins, group, landed):
                tfi.set_attr(back.op, "_grappler_do_not_remove", True)
                tfi.set_attr(back.op, SWAP_ATTR, "in")
                if land is not back:
                    tfi.set_attr(land.op, "_grappler_do_not_remove", True)
                    tfi.set_attr(land.op, SWAP_ATTR, "landing")
                if swap_in.trigger is not None:
                    tfi.add_control_input(back.op, lookup("trigger op", graph.get_operation_by_name, swap_in.trigger))
                for op_name, index in swap_in.consumers:
                    op = lookup("consumer op", graph.get_operation_by_name, op_name)
                    if index >= len(op.inputs) or op.inputs[index].name != tensor.name:
                        raise _plan_error(plan, f"input {index} of {op_name!r} is not {swap.tensor!r}")
                    tfi.update_input(op, index, land)
        self.swapped_out = {s.tensor: out for s, out in zip(plan.swaps, outs)}
        n_in = sum(len(g) for g in backs)
        self.counts.update(swap_out=len(outs), swap_in=n_in, landing=n_in if self.swap_in_on == "host" else 0)

    def fences(self) -> None:
        for fence in self.plan.fences:
            op = self.lookup("fence op", self.graph.get_operation_by_name, fence.op)
            tfi.add_control_input(op, self.swapped_out[fence.tensor].op)
        self.counts["fence"] = len(self.plan.fences)

    def order_updates(self) -> None:
        """Every ordering edge of ``plan.orders``: the update orders', then the memory-aware schedule's."""
        graph, plan, device, lookup, gates = self.graph, self.plan, self.device, self.lookup, self.gates
        implied = _implied_orders(graph, plan, gates)
        for i, order in enumerate(plan.orders):
            get = graph.get_operation_by_name
            ordered = lookup("ordered op", get, order.op)
            after = lookup("ordered op", get, order.after)
            for index in implied.get(i, ()):
                source = ordered.inputs[index]
                with graph.as_default(), tf.control_dependencies(None), tf.device(ordered.device or device):
                    gate = tf.identity(source, name=order_gate_name(source.name, i))
                tfi.add_control_input(gate.op, after)
                tfi.set_attr(gate.op, "_grappler_do_not_remove", True)
                tfi.set_attr(gate.op, SWAP_ATTR, "order")
                tfi.update_input(ordered, index, gate)
            if i not in gates and not implied.get(i):
                tfi.add_control_input(ordered, after)
                tfi.set_attr(ordered, SWAP_ATTR, "order")  # marks the step as rewritten (a plan may be orders only)
            for identity_n, index in gates.get(i, ()):
                source = identity_n.inputs[index]
                with graph.as_default(), tf.control_dependencies(None), tf.device(identity_n.device or device):
                    gate = tf.identity(source, name=f"{ORDER_SCOPE}/{order.op}/{i}")
                tfi.add_control_input(gate.op, after)
                tfi.set_attr(gate.op, "_grappler_do_not_remove", True)
                tfi.set_attr(gate.op, SWAP_ATTR, "order")
                tfi.update_input(identity_n, index, gate)
        self.counts["order"] = len(plan.orders)


def order_gate_name(tensor: str, i: int) -> str:
    """Name of the ``Identity`` that gates input ``tensor`` of order ``i``'s op (see
    :func:`_implied_orders`): under the tensor's producer, as a landing is, so that Grappler's
    name sort of a commutative op's inputs is the plain step's.

    >>> order_gate_name("f/Softmax/tflms_landing_0_0:0", 3)
    'f/Softmax/tflms_landing_0_0/tflms_order_3'
    """
    op, _, index = tensor.rpartition(":")
    return f"{op}/{ORDER_SCOPE}_{i}" + (f"_{index}" if index not in ("", "0") else "")


def _implied_orders(graph: Any, plan: SwapPlan, gates: dict[int, list[tuple[Any, int]]]) -> dict[int, list[int]]:
    """Per order on an op that Grappler's constant push-down rewrites, whose ``after`` already
    reaches that op as written: the indices of the op's inputs to gate instead of a control edge.

    Such an edge is redundant as written, so Grappler's dependency optimizer drops it; the
    push-down then leaves the op reading none of the inputs through which ``after`` reached it
    (``Mul(c, Mul(sub, y))`` becomes ``Mul(sub, Mul(c, y))``, and ``Mul(c, y)`` runs as soon as
    ``y`` exists). The schedule's orders are made on the step after the push-down
    (:func:`tflms.emulate.grappler.with_constant_pushdown`), where such an order is not redundant: measured on
    the test bed, the transformer's attention gradient's scaled softmax, ordered after the
    gradient's ``mul``, ran as soon as its swap-in landed. Gated are the inputs the op reads after
    the push-down that ``after`` does not reach (not a ``Const``, a resource or a variant). Any
    other order keeps its control edge: an op the push-down leaves alone still waits through its
    inputs (an order made redundant by a swap-in's trigger, as late triggers make, for one).
    """
    todo = [i for i in range(len(plan.orders)) if i not in gates]
    if not todo:
        return {}
    dag = _op_dag(graph)
    redundant = [
        i
        for i in todo
        if {plan.orders[i].op, plan.orders[i].after} <= dag.nodes.keys()
        and nx.has_path(dag, plan.orders[i].after, plan.orders[i].op)
    ]
    if not redundant:
        return {}
    from ..emulate.grappler import with_constant_pushdown
    from ..ir.graph import GraphModel

    executed, pairs = with_constant_pushdown(GraphModel.from_func_graph(graph))
    pushed = {op for pair in pairs for op in pair}
    implied = {}
    for i in redundant:
        order = plan.orders[i]
        if order.op not in pushed:  # its inputs stay: it still waits through them
            continue
        op = graph.get_operation_by_name(order.op)
        reads = set(executed.inputs_of[order.op])  # what it reads after the push-down
        implied[i] = [
            k
            for k, t in enumerate(op.inputs)
            if t.name in reads
            and t.op.type != "Const"
            and t.dtype not in (tf.resource, tf.variant)
            and not nx.has_path(dag, order.after, t.op.name)
        ]
    return implied


def _order_gates(graph: Any, plan: SwapPlan, lookup: Any) -> dict[int, list[tuple[Any, int]]]:
    """Per order (its index in ``plan.orders``) whose op updates a variable and depends on an
    ``IdentityN``: the ``(IdentityN op, input index)`` pairs to gate instead of a control edge on it.

    Keras's optimizer passes every gradient through one ``IdentityN``, so the order's ``after`` (a
    backward op) already reaches the update through it; Grappler's dependency optimizer drops a
    control edge between them as redundant, then removes the ``IdentityN``, and nothing orders them
    any more (measured: the updates still copied their variables). The edge goes on an ``Identity``
    in front of the ``IdentityN`` input the update depends on (the variable's gradient), which
    ``after`` does not reach.
    """
    from ..emulate.simulator import VARIABLE_WRITE_TYPES

    if not any(op.type == "IdentityN" for op in graph.get_operations()):
        return {}
    gates = {}
    for i, order in enumerate(plan.orders):
        op = lookup("ordered op", graph.get_operation_by_name, order.op)
        if op.type in VARIABLE_WRITE_TYPES and (found := _identity_n_inputs(op)):
            gates[i] = found
    return gates


def _identity_n_inputs(op: Any) -> list[tuple[Any, int]]:
    """``(IdentityN op, input index)`` of each ``IdentityN`` output that ``op`` depends on, through
    data and control inputs (the walk stops at an ``IdentityN``; Adam reads its slots after
    updating them, which TensorFlow orders with control edges)."""
    found, seen, stack = [], {op.name}, [op]
    while stack:
        current = stack.pop()
        for t in current.inputs:
            if t.op.type == "IdentityN":
                if (t.op.name, t.value_index) not in seen:
                    seen.add((t.op.name, t.value_index))
                    found.append((t.op, t.value_index))
            elif t.op.name not in seen:
                seen.add(t.op.name)
                stack.append(t.op)
        for c in current.control_inputs:
            if c.type != "IdentityN" and c.name not in seen:
                seen.add(c.name)
                stack.append(c)
    return found


def _op_dag(graph: Any) -> nx.DiGraph:
    """The ops of ``graph`` (by name) with their data and control edges."""
    dag = nx.DiGraph()
    for op in graph.get_operations():
        dag.add_node(op.name)
        dag.add_edges_from((t.op.name, op.name) for t in op.inputs)
        dag.add_edges_from((c.name, op.name) for c in op.control_inputs)
    return dag


def _check_acyclic(graph: Any, plan: SwapPlan, gates: dict[int, list[tuple[Any, int]]] | None = None) -> None:
    """Refuse, before any edit but the sums', a plan whose ordering edges would make a cycle.

    Each trigger runs before its group's consumers (through the swap-in or the clones),
    each fence's op after the producer of its tensor (through the swap-out), and each
    order's op after its ``after`` (a gated order's ``IdentityN``: see :func:`_order_gates`). A
    hand-edited plan can break that (a fence op upstream of its tensor, a trigger after
    a consumer); TensorFlow would only refuse the graph when the step first runs. Names
    the graph does not have are left to the lookups that report them.
    """
    dag = _op_dag(graph)
    added: dict[tuple[str, str], str] = {}
    for s in plan.swaps:
        for si in s.swap_ins:
            for consumer, _ in si.consumers if si.trigger is not None else ():
                added.setdefault((si.trigger, consumer), f"swap-in trigger {si.trigger!r} of {s.tensor!r}")
    for rc in plan.recomputes:
        for group in rc.groups:
            for consumer, _ in group.consumers:
                added.setdefault((group.trigger, consumer), f"recompute trigger {group.trigger!r} of {rc.tensor!r}")
    for fence in plan.fences:
        added.setdefault((fence.tensor.rpartition(":")[0], fence.op), f"fence on {fence.tensor!r} at {fence.op!r}")
    for i, order in enumerate(plan.orders):
        # A gated order (see _order_gates): its op's IdentityN input waits for ``after``.
        for target in [n.name for n, _ in (gates or {}).get(i, ())] or [order.op]:
            added.setdefault((order.after, target), f"order of {order.op!r} after {order.after!r}")
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
    raise _plan_error(plan, f"its {'; '.join(culprits) or 'ordering edges'} would make a cycle ({path})")


def _apply_recomputes(graph: Any, plan: SwapPlan, device: str, lookup: Any) -> int:
    """Add the clones of ``plan.recomputes`` and rewire their consumers; return the number of clones."""
    n = 0
    for rc in plan.recomputes:
        target = lookup("tensor", graph.get_tensor_by_name, rc.tensor)
        originals = [lookup("recomputed op", graph.get_operation_by_name, name) for name in rc.ops]
        for k, group in enumerate(rc.groups):
            trigger = lookup("trigger op", graph.get_operation_by_name, group.trigger)
            clones: dict[str, Any] = {}
            for op in originals:
                inputs = [clones[t.op.name].outputs[t.value_index] if t.op.name in clones else t for t in op.inputs]
                with graph.as_default(), tf.control_dependencies(None), tf.device(op.device or device):
                    clone = tfi.clone_op(graph, op, inputs, rc.clone(op.name, k))
                tfi.set_attr(clone, SWAP_ATTR, "recompute")
                tfi.add_control_input(clone, trigger)
                clones[op.name] = clone
                n += 1
            out = clones[rc.producer].outputs[target.value_index]
            for op_name, index in group.consumers:
                consumer = lookup("consumer op", graph.get_operation_by_name, op_name)
                if index >= len(consumer.inputs) or consumer.inputs[index].name != target.name:
                    raise _plan_error(plan, f"input {index} of {op_name!r} is not {rc.tensor!r}")
                tfi.update_input(consumer, index, out)
    return n
