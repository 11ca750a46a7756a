"""Ordering edges on the TensorFlow graph: the pass ``order_updates`` (:class:`OrderUpdates`), whose
decisions, the plan's ``orders``, are the update orders of a policy's ``order_updates``
(:func:`tflms.plan.passes.schedule.update_orders`) followed by the memory-aware schedule's
(:func:`tflms.plan.passes.schedule.finish`). Both are planned in :mod:`tflms.plan.passes.schedule`;
this module holds the pass and its rewrite.

Each order is a control input between two ops on the device. Two kinds of order would not survive
Grappler as a plain control edge, and go on ``Identity`` gates instead: an order on a variable
update that ``after`` already reaches through Keras's ``IdentityN`` (:func:`_order_gates`), and an
order on an op that Grappler's constant push-down rewrites, which ``after`` already reaches as
written (:func:`_implied_orders`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import networkx as nx

from ...emulate.simulator import Simulator
from ...ir.decisions import Order
from ...ir.graph import GraphModel, with_orders
from .base import Edges, GraphEdit, Pass
from .schedule import with_update_orders
from .swaps import SWAP_ATTR

if TYPE_CHECKING:
    from ...config import LMSConfig

__all__ = ["ORDER_SCOPE", "OrderUpdates", "order_gate_name"]

#: Name scope of the gates that carry an order on an ``IdentityN`` input (:func:`_order_gates`).
ORDER_SCOPE = "tflms_order"


class OrderUpdates(Pass):
    """Ordering edges (the plan's ``orders``): the update orders of the pass ``order_updates`` of a
    policy (:func:`~tflms.plan.passes.schedule.with_update_orders`), then the memory-aware
    schedule's (:func:`~tflms.plan.passes.schedule.finish`, decided with the swaps).

    The rewrite adds each as a control input between two ops on the device. Where ``after``
    already reaches the op through Keras's ``IdentityN``, the edge goes on gates in front of the
    ``IdentityN`` (:func:`_order_gates`); where it already reaches an op that Grappler's constant
    push-down rewrites, on gates in front of the inputs the op reads after the push-down
    (:func:`_implied_orders`)."""

    name, field, policy, adds_edges = "order_updates", "orders", True, True

    def prepare(
        self, model: GraphModel, config: LMSConfig, sim: Simulator | None
    ) -> tuple[GraphModel, tuple, Simulator | None]:
        return with_update_orders(model, sim if sim is not None else Simulator(model, config.host))

    def replay(self, model: GraphModel, decisions: Sequence[Any]) -> GraphModel:
        return with_orders(model, decisions)

    def rewrote(self, op: Any, attr: bytes | None) -> bool:
        return op.name.startswith(ORDER_SCOPE + "/") or bool(op.control_inputs and attr == b"order")

    def edges(self, edit: GraphEdit) -> Edges:
        """Each order's op runs after its ``after`` (a gated order's ``IdentityN`` input does). The
        gates (:func:`_order_gates`) are found here, on the graph as it is before any pass adds a
        clone, a swap or an edge, and kept for :meth:`rewrite` (which finds them itself where it
        runs without this)."""
        gates = edit.found[self.name] = _order_gates(edit)
        added: Edges = {}
        for i, order in enumerate(edit.plan.orders):
            for target in [n.name for n, _ in gates.get(i, ())] or [order.op]:
                added.setdefault((order.after, target), f"order of {order.op!r} after {order.after!r}")
        return added

    def rewrite(self, edit: GraphEdit) -> dict[str, int]:
        import tensorflow as tf

        from ... import _tf_internal as tfi
        from .swaps import mark

        graph, orders = edit.graph, edit.plan.orders
        gates = edit.found[self.name] if self.name in edit.found else _order_gates(edit)
        implied = _implied_orders(graph, orders, gates)

        def gate(source: Any, name: str, device: str, after: Any) -> Any:
            with graph.as_default(), tf.control_dependencies(None), tf.device(device or edit.device):
                made = tf.identity(source, name=name)
            tfi.add_control_input(made.op, after)
            mark(made.op, "order")
            return made

        for i, order in enumerate(orders):
            ordered, after = edit.op("ordered op", order.op), edit.op("ordered op", order.after)
            for index in implied.get(i, ()):
                source = ordered.inputs[index]
                tfi.update_input(ordered, index, gate(source, order_gate_name(source.name, i), ordered.device, after))
            if i not in gates and not implied.get(i):
                tfi.add_control_input(ordered, after)
                tfi.set_attr(ordered, SWAP_ATTR, "order")  # marks the step as rewritten (a plan may be orders only)
            for identity_n, index in gates.get(i, ()):
                made = gate(identity_n.inputs[index], f"{ORDER_SCOPE}/{order.op}/{i}", identity_n.device, after)
                tfi.update_input(identity_n, index, made)
        return {"order": len(orders)}


def order_gate_name(tensor: str, i: int) -> str:
    """Name of the ``Identity`` that gates input ``tensor`` of order ``i``'s op (see
    :func:`_implied_orders`): under the tensor's producer, as a landing is, so that Grappler's
    name sort of a commutative op's inputs is the plain step's.

    >>> order_gate_name("f/Softmax/tflms_landing_0_0:0", 3)
    'f/Softmax/tflms_landing_0_0/tflms_order_3'
    """
    op, _, index = tensor.rpartition(":")
    return f"{op}/{ORDER_SCOPE}_{i}" + (f"_{index}" if index not in ("", "0") else "")


def _implied_orders(
    graph: Any, orders: Sequence[Order], gates: dict[int, list[tuple[Any, int]]]
) -> dict[int, list[int]]:
    """Per order on an op that Grappler's constant push-down rewrites, whose ``after`` already
    reaches that op as written: the indices of the op's inputs to gate instead of a control edge.

    Such an edge is redundant as written, so Grappler's dependency optimizer drops it; the
    push-down then leaves the op reading none of the inputs through which ``after`` reached it
    (``Mul(c, Mul(sub, y))`` becomes ``Mul(sub, Mul(c, y))``, and ``Mul(c, y)`` runs as soon as
    ``y`` exists). The schedule's orders are made on the step after the push-down
    (:func:`tflms.emulate.grappler.with_constant_pushdown`), where such an order is not redundant (the
    transformer's attention gradient's scaled softmax, ordered after the gradient's ``mul``, would
    run as soon as its swap-in landed). Gated are the inputs the op reads after
    the push-down that ``after`` does not reach (not a ``Const``, a resource or a variant). Any
    other order keeps its control edge: an op the push-down leaves alone still waits through its
    inputs (an order made redundant by a swap-in's trigger, as late triggers make, for one).
    """
    todo = [i for i in range(len(orders)) if i not in gates]
    if not todo:
        return {}
    import tensorflow as tf

    from ...emulate.grappler import with_constant_pushdown
    from .base import op_dag

    dag = op_dag(graph)
    redundant = [
        i
        for i in todo
        if {orders[i].op, orders[i].after} <= dag.nodes.keys() and nx.has_path(dag, orders[i].after, orders[i].op)
    ]
    if not redundant:
        return {}
    executed, pairs = with_constant_pushdown(GraphModel.from_func_graph(graph))
    pushed = {op for pair in pairs for op in pair}
    implied = {}
    for i in redundant:
        order = orders[i]
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


def _order_gates(edit: GraphEdit) -> dict[int, list[tuple[Any, int]]]:
    """Per order (its index in ``plan.orders``) whose op updates a variable and depends on an
    ``IdentityN``: the ``(IdentityN op, input index)`` pairs to gate instead of a control edge on it.

    Keras's optimizer passes every gradient through one ``IdentityN``, so the order's ``after`` (a
    backward op) already reaches the update through it; Grappler's dependency optimizer drops a
    control edge between them as redundant, then removes the ``IdentityN``, and nothing orders them
    any more (the updates would still copy their variables). The edge goes on an ``Identity``
    in front of the ``IdentityN`` input the update depends on (the variable's gradient), which
    ``after`` does not reach.
    """
    from ...emulate.simulator import VARIABLE_WRITE_TYPES

    if not any(op.type == "IdentityN" for op in edit.graph.get_operations()):
        return {}
    gates = {}
    for i, order in enumerate(edit.plan.orders):
        op = edit.op("ordered op", order.op)
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
