"""Structural checks shared by the rewrite tests."""

import networkx as nx

from tflms import _tf_internal as tfi
from tflms._devices import same_device
from tflms.rewrite.apply import (
    ORDER_SCOPE,
    RECOMPUTE_SCOPE,
    SWAP_ATTR,
    SWAP_IN_SCOPE,
    SWAP_OUT_SCOPE,
    is_landing,
    landing_name,
    order_gate_name,
)

from conftest import DEVICE


def through_order_gates(tensor):
    """``tensor``, or what the order gates in front of it read (:func:`tflms.rewrite.apply.order_gate_name`)."""
    while tensor.op.type == "Identity" and f"/{ORDER_SCOPE}_" in tensor.op.name:
        assert tensor.op.get_attr(SWAP_ATTR) == b"order"
        tensor = tensor.op.inputs[0]
    return tensor


def swap_ops(graph):
    outs = [op for op in graph.get_operations() if op.name.startswith(SWAP_OUT_SCOPE + "/")]
    ins = [op for op in graph.get_operations() if op.name.startswith(SWAP_IN_SCOPE + "/")]
    return outs, ins


def check_structure(cf, plan, device, host):
    """Assert the rewritten graph matches the plan exactly; return (n_out, n_in)."""
    graph = cf.graph
    outs, ins = swap_ops(graph)
    assert len(outs) == len(plan.swaps)
    assert len(ins) == plan.n_swap_ins
    for op in outs:
        assert op.type == "Identity" and op.device == host
        assert op.get_attr("_grappler_do_not_remove") is True
        assert op.inputs[0].device != host
    by_tensor = {op.inputs[0].name: op for op in outs}
    for swap in plan.swaps:
        out = by_tensor[swap.tensor]
        for k, si in enumerate(swap.swap_ins):
            back = graph.get_operation_by_name(f"{SWAP_IN_SCOPE}/{swap.tensor.replace(':', '_')}/{k}")
            # Gated on the host: the copy to the device can only start after the trigger.
            assert back.type == "Identity" and back.device == host
            assert back.inputs[0].op is out
            assert back.get_attr("_grappler_do_not_remove") is True
            controls = [c.name for c in back.control_inputs]
            assert controls == ([si.trigger] if si.trigger else [])
            # The consumers read the swap-in through an Identity on the device (the landing).
            land = graph.get_operation_by_name(landing_name(swap.tensor, k))
            assert land.type == "Identity" and land.device == device
            assert land.inputs[0] is back.outputs[0]
            assert land.get_attr("_grappler_do_not_remove") is True
            for consumer, index in si.consumers:
                op = graph.get_operation_by_name(consumer)
                assert through_order_gates(op.inputs[index]) is land.outputs[0]
                assert op.device != host
    # Fences: the forward op waits for the swap-out (a control input from the host Identity).
    for fence in plan.fences:
        op = graph.get_operation_by_name(fence.op)
        assert by_tensor[fence.tensor] in op.control_inputs and op.device != host
    # Orders: an op waits for another: a control input on the device; or (an update whose ``after``
    # reaches it through the optimizer's IdentityN) on an Identity gate in front of that IdentityN;
    # or (an order ``after`` already reaches) on Identity gates in front of the inputs it does not.
    dag = nx.DiGraph()
    for op in graph.get_operations():
        dag.add_edges_from((t.op.name, op.name) for t in op.inputs)
        dag.add_edges_from((c.name, op.name) for c in op.control_inputs)
    for i, order in enumerate(plan.orders):
        op = graph.get_operation_by_name(order.op)
        after = graph.get_operation_by_name(order.after)
        implied = [t.op for t in op.inputs if t.op.inputs and t.op.name == order_gate_name(t.op.inputs[0].name, i)]
        if implied:
            assert after not in op.control_inputs and op.device != host
            for gate in implied:
                assert gate.type == "Identity" and after in gate.control_inputs
                assert same_device(gate.device, op.device or device), (gate.device, op.device)
                assert gate.get_attr("_grappler_do_not_remove") is True and gate.get_attr(SWAP_ATTR) == b"order"
                assert not nx.has_path(dag, after.name, gate.inputs[0].op.name)  # it waits only through the gate
            others = [t.op for t in op.inputs if t.op not in implied] + list(op.control_inputs)
            assert any(nx.has_path(dag, after.name, o.name) for o in others)  # the edge was redundant
            continue
        base = f"{ORDER_SCOPE}/{order.op}/{i}"
        gates = [g for g in graph.get_operations() if g.name == base or g.name.startswith(base + "_")]
        if not gates:
            assert after in op.control_inputs and op.device != host
            continue
        assert after not in op.control_inputs
        for gate in gates:
            assert gate.type == "Identity" and gate.device != host and after in gate.control_inputs
            assert gate.get_attr("_grappler_do_not_remove") is True
            assert [c.type for c in gate.outputs[0].consumers()] == ["IdentityN"]
    return len(outs), len(ins)


def check_orders_hold_when_run(ran, plan):
    """Assert every order of ``plan`` still holds in the graphs TensorFlow ran (``ran``: name ->
    NodeDef of :func:`tflms._tf_internal.ran_graphs`): its ``after`` reaches its op through data and
    control inputs, and from each send to the receive of the same transfer (another partition's).
    (Grappler drops an edge that another path implies: the path must be there.)"""
    dag = nx.DiGraph()
    sends: dict[bytes, list[str]] = {}
    for node in ran.values():
        dag.add_edges_from((i.lstrip("^").split(":")[0], node.name) for i in node.input)
        if node.op in ("_Send", "_HostSend"):
            sends.setdefault(node.attr["tensor_name"].s, []).append(node.name)
    for node in ran.values():
        if node.op in ("_Recv", "_HostRecv"):
            dag.add_edges_from((send, node.name) for send in sends.get(node.attr["tensor_name"].s, ()))
    lost = [o for o in plan.orders if not (o.op in dag and o.after in dag and nx.has_path(dag, o.after, o.op))]
    assert not lost, f"{len(lost)} of {len(plan.orders)} orders do not hold in the graphs TensorFlow ran: {lost[:3]}"


def check_survives_grappler(cf, device, optimized=None):
    """Every swap op is still in the graph Grappler makes of the function (``optimized``, if
    already made: :func:`tflms._tf_internal.grappler_optimize`)."""
    outs, ins = swap_ops(cf.graph)
    lands = [op for op in cf.graph.get_operations() if is_landing(op.name)]
    optimized = {n.name: n for n in (optimized if optimized is not None else tfi.grappler_optimize(cf, device)).node}
    missing = [op.name for op in outs + ins + lands if op.name not in optimized]
    assert not missing, f"Grappler removed {len(missing)} swap ops, e.g. {missing[:3]}"
    for op in outs + ins + lands:
        assert optimized[op.name].op == "Identity"


#: The ops Grappler's memory optimizer (at its default level) makes of a large AddN.
ACCUMULATION = {"TemporaryVariable", "AssignAdd"}


def ran_op_types(call):
    """Call ``call()`` once; the op types of every graph partition the runtime ran for it."""
    return {n.op for g in tfi.ran_graphs(call) for n in g.node}


def check_recomputes(cf, plan):
    """Assert the rewritten graph holds exactly the plan's clones, gated and wired."""
    graph = cf.graph
    clones = [op for op in graph.get_operations() if op.name.startswith(RECOMPUTE_SCOPE + "/")]
    assert len(clones) == sum(len(r.ops) * len(r.groups) for r in plan.recomputes)
    for rc in plan.recomputes:
        for k, group in enumerate(rc.groups):
            for name in rc.ops:
                clone, original = graph.get_operation_by_name(rc.clone(name, k)), graph.get_operation_by_name(name)
                assert clone.type == original.type and clone.get_attr(SWAP_ATTR) == b"recompute"
                assert [c.name for c in clone.control_inputs] == [group.trigger]
                assert clone.device == (original.device or DEVICE)
            out = graph.get_tensor_by_name(rc.output(k))
            for consumer, index in group.consumers:
                op = graph.get_operation_by_name(consumer)
                # Read through a landing when the consumer is also fed by a swap: never the original.
                assert through_order_gates(op.inputs[index]) is out, (consumer, index)


def check_clones_survive_grappler(cf, plan, optimized=None):
    """Assert Grappler keeps every clone, of its op type, still after its group's trigger (Grappler
    drops a control edge that a path through the chain's earlier clones already implies).
    ``optimized``: Grappler's graph of ``cf`` if already made."""
    optimized = {n.name: n for n in (optimized if optimized is not None else tfi.grappler_optimize(cf, DEVICE)).node}
    dag = nx.DiGraph((i.lstrip("^").split(":")[0], n.name) for n in optimized.values() for i in n.input)
    graph = cf.graph
    missing, changed = [], []
    for rc in plan.recomputes:
        for k, group in enumerate(rc.groups):
            for op in rc.ops:
                node = optimized.get(rc.clone(op, k))
                if node is None:
                    missing.append(rc.clone(op, k))
                elif node.op != graph.get_operation_by_name(op).type or not nx.has_path(dag, group.trigger, node.name):
                    changed.append((node.name, node.op, group.trigger))
    assert not missing, f"Grappler removed {len(missing)} recompute clones, e.g. {missing[:3]}"
    assert not changed, f"Grappler changed {len(changed)} recompute clones' type or gating, e.g. {changed[:3]}"
