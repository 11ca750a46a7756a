"""``offload="optimizer"`` on hand-built steps: what the graph-model pass places, and what the simulator counts."""

import pytest

from tflms.emulate.simulator import Simulator
from tflms.ir.graph import GraphModel
from tflms.plan.passes.offload import offload_decisions, recv_name, with_offload

from graphs import MIB, RESOURCE, mib

pytestmark = pytest.mark.unit

HOST = "/device:CPU:0"


def step(fused: bool = False, flow: bool = False, moving_stat: bool = True) -> GraphModel:
    """A weight ``w`` (8 MiB) and an Adam-like update with two 8 MiB slots ``m`` and ``v``; a
    moving statistic ``s`` (1 MiB) updated from the forward pass, as a BatchNorm's is."""
    ops = [
        {"name": "x", "type": "Placeholder", "inputs": [], "outputs": mib(4)},
        {"name": "w", "type": "Placeholder", "inputs": [], "outputs": [RESOURCE]},
        {"name": "m", "type": "Placeholder", "inputs": [], "outputs": [RESOURCE]},
        {"name": "v", "type": "Placeholder", "inputs": [], "outputs": [RESOURCE]},
        {"name": "w_read", "type": "ReadVariableOp", "inputs": ["w:0"], "outputs": mib(8)},
        {"name": "h", "type": "MatMul", "inputs": ["x:0", "w_read:0"], "outputs": mib(4)},
        {"name": "loss", "type": "Sum", "inputs": ["h:0"], "outputs": [("float32", (), 4, False)]},
        {"name": "gradient_tape/dh", "type": "OnesLike", "inputs": ["h:0"], "outputs": mib(4)},
        {"name": "gradient_tape/dw", "type": "MatMul", "inputs": ["x:0", "gradient_tape/dh:0"], "outputs": mib(8)},
        {"name": "m_read", "type": "ReadVariableOp", "inputs": ["m:0"], "outputs": mib(8)},
        {"name": "m_new", "type": "Sub", "inputs": ["gradient_tape/dw:0", "m_read:0"], "outputs": mib(8)},
        {"name": "m_add", "type": "AssignAddVariableOp", "inputs": ["m:0", "m_new:0"], "outputs": []},
        {"name": "g2", "type": "Square", "inputs": ["gradient_tape/dw:0"], "outputs": mib(8)},
        {"name": "v_add", "type": "AssignAddVariableOp", "inputs": ["v:0", "g2:0"], "outputs": []},
        {
            "name": "m_again",
            "type": "ReadVariableOp",
            "inputs": ["m:0"],
            "outputs": mib(8),
            "control_inputs": ["m_add"],
        },
        {
            "name": "v_again",
            "type": "ReadVariableOp",
            "inputs": ["v:0"],
            "outputs": mib(8),
            "control_inputs": ["v_add"],
        },
        {"name": "delta", "type": "RealDiv", "inputs": ["m_again:0", "v_again:0"], "outputs": mib(8)},
        {"name": "w_sub", "type": "AssignSubVariableOp", "inputs": ["w:0", "delta:0"], "outputs": []},
    ]
    variables = [("w:0", 8 * MIB), ("m:0", 8 * MIB), ("v:0", 8 * MIB)]
    if moving_stat:
        ops += [
            {"name": "s", "type": "Placeholder", "inputs": [], "outputs": [RESOURCE]},
            {"name": "s_read", "type": "ReadVariableOp", "inputs": ["s:0"], "outputs": mib(1)},
            {"name": "batch_mean", "type": "Mean", "inputs": ["h:0"], "outputs": mib(1)},
            {"name": "s_new", "type": "Sub", "inputs": ["s_read:0", "batch_mean:0"], "outputs": mib(1)},
            {"name": "s_assign", "type": "AssignVariableOp", "inputs": ["s:0", "s_new:0"], "outputs": []},
        ]
        variables.append(("s:0", MIB))
    if fused:
        ops.append(
            {
                "name": "apply",
                "type": "ResourceApplyAdam",
                "inputs": ["w:0", "m:0", "v:0", "gradient_tape/dw:0"],
                "outputs": [],
            }  # fmt: skip
        )
    if flow:
        ops.append({"name": "finite", "type": "StatelessIf", "inputs": ["gradient_tape/dw:0"], "outputs": mib(8)})
    return GraphModel.from_ops(ops, variable_bytes=sum(b for _, b in variables), variables=variables)


def test_the_slots_and_the_update_math_go_to_the_host():
    model = step()
    d = offload_decisions(model)
    assert set(d.variables) == {"m:0", "v:0"}  # not the weight, not the moving statistic
    assert set(d.ops) == {"m_new", "g2", "delta"}  # no op on a resource, no forward or gradient op
    assert set(d.resource_ops) == {"m_read", "m_add", "v_add", "m_again", "v_again"}
    placed = with_offload(model, d, HOST)
    assert placed.variable_bytes == model.variable_bytes - 16 * MIB
    assert [t for t, _ in placed.variables] == ["w:0", "s:0"]
    assert {n for n, dev in placed.dag.nodes(data="device") if dev == HOST} == set(d.ops) | set(d.resource_ops)
    assert model.dag.nodes["delta"]["device"] == ""  # the given model is not changed


def test_the_simulator_counts_neither_the_slots_nor_the_update_temporaries():
    model = step()
    placed = with_offload(model, offload_decisions(model), HOST)
    before, after = Simulator(model, HOST).peak(), Simulator(placed, HOST).peak()
    # The two slots (16 MiB) leave the device; the update's temporaries (8 MiB each) run on the host,
    # and the weight's change (8 MiB) is received on the device for its assign.
    assert before - after >= 16 * MIB
    recv = recv_name("delta:0")
    assert placed.inputs_of["w_sub"] == ["w:0", f"{recv}:0"] and placed.dag.nodes[recv]["device"] == ""
    assert placed.tensors[f"{recv}:0"].bytes == 8 * MIB
    # What stays: the weight, the moving statistic, the input, the gradient and the change received.
    assert after >= 8 * MIB + 1 * MIB + 4 * MIB + 8 * MIB + 8 * MIB


def test_a_fused_update_or_control_flow_is_refused():
    with pytest.raises(ValueError, match=r"fused update ops.*ResourceApplyAdam.*Received: offload='optimizer'"):
        offload_decisions(step(fused=True))
    with pytest.raises(ValueError, match=r"control flow.*StatelessIf.*Received: offload='optimizer'"):
        offload_decisions(step(flow=True))


def test_a_step_without_an_update_is_refused():
    ops = [
        {"name": "x", "type": "Placeholder", "inputs": [], "outputs": mib(1)},
        {"name": "gradient_tape/y", "type": "Neg", "inputs": ["x:0"], "outputs": mib(1)},
    ]
    with pytest.raises(ValueError, match=r"no optimizer update.*Received: offload='optimizer'"):
        offload_decisions(GraphModel.from_ops(ops))
