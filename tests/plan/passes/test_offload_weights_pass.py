"""``offload="weights"`` on hand-built steps: what the graph-model pass places and gates, and what the
simulator counts (:mod:`tflms.plan.passes.offload_weights`)."""

import pytest

from tflms.emulate.simulator import Simulator
from tflms.ir.graph import GraphModel
from tflms.plan.passes.offload import offload_decisions, weight_landing_name, with_offload
from tflms.plan.passes.offload_weights import AHEAD, weight_in_name

from graphs import MIB, RESOURCE, mib

pytestmark = pytest.mark.unit

HOST = "/device:CPU:0"


def chain(n: int, name: str, first: str, kind: str = "Relu") -> list[dict]:
    """``n`` ops of ``kind`` after ``first`` (1 MiB each), to space the layers by levels."""
    ops, last = [], first
    for k in range(n):
        ops.append({"name": f"{name}{k}", "type": kind, "inputs": [f"{last}:0"], "outputs": mib(1)})
        last = f"{name}{k}"
    return ops


def two_layers(sum_before_w2: bool = False) -> GraphModel:
    """Two 8 MiB weights ``w1`` and ``w2`` (``w2`` read through a ``Reshape`` of its read), SGD with
    momentum (8 MiB slots ``m1``, ``m2``), and a moving statistic ``s`` that only the forward pass
    updates. Between the layers a chain of 6 ops, so that ``w2``'s copy has a trigger in the chain;
    ``w2``'s read is used by the forward ``h2`` and the backward ``dh1``."""
    ops = [
        {"name": "x", "type": "Placeholder", "inputs": [], "outputs": mib(1)},
        *(
            {"name": v, "type": "Placeholder", "inputs": [], "outputs": [RESOURCE]}
            for v in ("w1", "w2", "m1", "m2", "s")
        ),
        {"name": "w1_read", "type": "ReadVariableOp", "inputs": ["w1:0"], "outputs": mib(8)},
        {"name": "w2_read", "type": "ReadVariableOp", "inputs": ["w2:0"], "outputs": mib(8)},
        {"name": "shape", "type": "Const", "inputs": [], "outputs": [("int32", (2,), 8, False)]},
        {"name": "w2_2d", "type": "Reshape", "inputs": ["w2_read:0", "shape:0"], "outputs": mib(8)},
        {"name": "h1", "type": "MatMul", "inputs": ["x:0", "w1_read:0"], "outputs": mib(1)},
        *chain(6, "a", "h1", "AddV2" if sum_before_w2 else "Relu"),
        {"name": "h2", "type": "MatMul", "inputs": ["a5:0", "w2_2d:0"], "outputs": mib(1)},
        {"name": "s_read", "type": "ReadVariableOp", "inputs": ["s:0"], "outputs": mib(1)},
        {"name": "s_new", "type": "Sub", "inputs": ["s_read:0", "h2:0"], "outputs": mib(1)},
        {"name": "s_assign", "type": "AssignVariableOp", "inputs": ["s:0", "s_new:0"], "outputs": []},
        {"name": "loss", "type": "Sum", "inputs": ["h2:0"], "outputs": [("float32", (), 4, False)]},
        {"name": "gradient_tape/dh2", "type": "OnesLike", "inputs": ["h2:0"], "outputs": mib(1)},
        {"name": "gradient_tape/dw2", "type": "MatMul", "inputs": ["a5:0", "gradient_tape/dh2:0"], "outputs": mib(8)},
        *chain(6, "gradient_tape/b", "gradient_tape/dh2"),
        {"name": "gradient_tape/dh1", "type": "MatMul", "inputs": ["gradient_tape/b5:0", "w2_2d:0"], "outputs": mib(1)},
        {"name": "gradient_tape/dw1", "type": "MatMul", "inputs": ["x:0", "gradient_tape/dh1:0"], "outputs": mib(8)},
    ]
    for w, g, m in (("w1", "gradient_tape/dw1", "m1"), ("w2", "gradient_tape/dw2", "m2")):
        ops += [
            {"name": f"{m}_read", "type": "ReadVariableOp", "inputs": [f"{m}:0"], "outputs": mib(8)},
            {"name": f"{m}_new", "type": "AddV2", "inputs": [f"{m}_read:0", f"{g}:0"], "outputs": mib(8)},
            {"name": f"{m}_set", "type": "AssignVariableOp", "inputs": [f"{m}:0", f"{m}_new:0"], "outputs": []},
            {"name": f"{w}_step", "type": "Mul", "inputs": [f"{m}_new:0"], "outputs": mib(8)},
            {"name": f"{w}_sub", "type": "AssignSubVariableOp", "inputs": [f"{w}:0", f"{w}_step:0"], "outputs": []},
        ]
    variables = [("w1:0", 8 * MIB), ("w2:0", 8 * MIB), ("s:0", MIB), ("m1:0", 8 * MIB), ("m2:0", 8 * MIB)]
    return GraphModel.from_ops(ops, variable_bytes=sum(b for _, b in variables), variables=variables)


def test_the_weights_their_reads_and_the_weight_side_go_to_the_host():
    model = two_layers()
    d = offload_decisions(model, weights=True)
    assert d.weights == ("w1:0", "w2:0")  # not the moving statistic, which the update does not write
    assert set(d.variables) == {"w1:0", "w2:0", "m1:0", "m2:0"}
    assert {"w1_read", "w2_read", "w1_sub", "w2_sub", "m1_set"} <= set(d.resource_ops)
    assert "s_read" not in d.resource_ops and "s_assign" not in d.resource_ops
    assert "w2_2d" in d.ops  # the Reshape of a weight runs on the host: its output is what is sent
    assert {"m1_new", "w1_step", "w2_step"} <= set(d.ops)
    assert not any(op.startswith("gradient_tape/") for op in d.ops)  # the gradients are made on the device


def test_each_use_of_a_weight_gets_its_own_gated_copy():
    model = two_layers()
    transfers = {s.tensor: s for s in offload_decisions(model, weights=True).transfers}
    assert set(transfers) == {"w1_read:0", "w2_2d:0"}  # the Reshape's output, not the read, for w2
    (first,) = transfers["w1_read:0"].swap_ins
    assert first.consumers == (("h1", 1),) and first.trigger is None  # nothing on the device before it
    forward, backward = transfers["w2_2d:0"].swap_ins  # the forward and the backward use, apart
    assert forward.consumers == (("h2", 1),) and backward.consumers == (("gradient_tape/dh1", 1),)
    levels = model.levels
    assert forward.trigger.startswith("a") and levels["h2"] - levels[forward.trigger] == AHEAD
    assert (
        backward.trigger.startswith("gradient_tape/b")
        and levels["gradient_tape/dh1"] - levels[backward.trigger] == AHEAD
    )


def test_a_sum_is_never_a_trigger():
    """Grappler folds a tree of sums only where no member has a control edge (the GPT's LayerNorm
    ``add_2`` as a trigger made the step round differently): the trigger is found before the sums."""
    model = two_layers(sum_before_w2=True)
    transfers = {s.tensor: s for s in offload_decisions(model, weights=True).transfers}
    forward = transfers["w2_2d:0"].swap_ins[0]
    assert forward.trigger == "h1"  # the highest-level device ancestor that is not a sum


def test_the_graph_model_sends_each_copy_from_the_host_after_its_trigger():
    model = two_layers()
    d = offload_decisions(model, weights=True)
    placed = with_offload(model, d, HOST)
    device = dict(placed.dag.nodes(data="device"))
    send, land = weight_in_name("w2_2d:0", 1), weight_landing_name("w2_2d:0", 1)
    backward = next(s for s in d.transfers if s.tensor == "w2_2d:0").swap_ins[1]
    assert device[send] == HOST and device[land] == "" and placed.dag.nodes[land]["type"] == "_Recv"
    assert placed.inputs_of[send] == ["w2_2d:0"] and placed.dag.has_edge(backward.trigger, send)
    assert placed.inputs_of["gradient_tape/dh1"] == ["gradient_tape/b5:0", f"{land}:0"]
    assert placed.inputs_of["h2"] == ["a5:0", f"{weight_landing_name('w2_2d:0', 0)}:0"]
    assert {device[op] for op in ("w1_read", "w2_read", "w2_2d", "w1_sub", "m1_new")} == {HOST}
    assert device["s_read"] == "" and device["gradient_tape/dw1"] == ""
    assert [t for t, _ in placed.variables] == ["s:0"] and placed.variable_bytes == MIB
    assert model.dag.nodes["w2_2d"]["device"] == ""  # the given model is not changed


def test_the_simulator_holds_each_copy_from_its_trigger_to_its_last_reader():
    model = two_layers()
    placed = with_offload(model, offload_decisions(model, weights=True), HOST)
    optimizer = with_offload(model, offload_decisions(model), HOST)
    sim = Simulator(placed, HOST)
    order = list(sim.profile().schedule)
    land_f, land_b = weight_landing_name("w2_2d:0", 0), weight_landing_name("w2_2d:0", 1)

    def held(op: str) -> list[int]:
        return [p for p in range(len(order)) if any(t.startswith(op) for t, _ in sim.live(p))]

    forward, backward = held(land_f), held(land_b)
    assert forward and backward and max(forward) < min(backward)  # never both on the device
    assert min(backward) > order.index("gradient_tape/b0")  # it arrives in the backward pass
    # The device holds no weight for the whole step: below the optimizer offload by at least one weight.
    assert sim.peak() <= Simulator(optimizer, HOST).peak() - 8 * MIB
    assert sim.peak() < Simulator(model, HOST).peak() - 32 * MIB


def test_the_errors_name_the_weights_offload():
    model = two_layers()
    ops = [{"name": "x", "type": "Placeholder", "inputs": [], "outputs": mib(1)}]
    with pytest.raises(ValueError, match=r"no optimizer update.*Received: offload='weights'"):
        offload_decisions(GraphModel.from_ops(ops), weights=True)
    assert offload_decisions(model, weights=True).transfers  # the same step is fine


def test_a_trigger_is_never_among_the_nearest_inputs_of_its_copys_readers():
    """A convolution's bias is read by the ``BiasAdd`` of the convolution's output: the
    ``Conv2D`` (one level before it) is not its trigger, as Grappler fuses the two (the fused op would
    wait for its own bias: the step hung)."""
    ops = [
        {"name": "x", "type": "Placeholder", "inputs": [], "outputs": mib(1)},
        *({"name": v, "type": "Placeholder", "inputs": [], "outputs": [RESOURCE]} for v in ("k", "b")),
        {"name": "k_read", "type": "ReadVariableOp", "inputs": ["k:0"], "outputs": mib(1)},
        {"name": "b_read", "type": "ReadVariableOp", "inputs": ["b:0"], "outputs": mib(1)},
        *chain(2, "a", "x"),
        *chain(2, "s", "a1", "AddV2"),  # sums: never triggers
        {"name": "conv", "type": "Conv2D", "inputs": ["s1:0", "k_read:0"], "outputs": mib(1)},
        {"name": "bias", "type": "BiasAdd", "inputs": ["conv:0", "b_read:0"], "outputs": mib(1)},
        {"name": "loss", "type": "Sum", "inputs": ["bias:0"], "outputs": [("float32", (), 4, False)]},
        {"name": "gradient_tape/d", "type": "OnesLike", "inputs": ["bias:0"], "outputs": mib(1)},
        {
            "name": "gradient_tape/dk",
            "type": "Conv2DBackpropFilter",
            "inputs": ["s1:0", "gradient_tape/d:0"],
            "outputs": mib(1),
        },
        {"name": "gradient_tape/db", "type": "BiasAddGrad", "inputs": ["gradient_tape/d:0"], "outputs": mib(1)},
        {"name": "k_sub", "type": "AssignSubVariableOp", "inputs": ["k:0", "gradient_tape/dk:0"], "outputs": []},
        {"name": "b_sub", "type": "AssignSubVariableOp", "inputs": ["b:0", "gradient_tape/db:0"], "outputs": []},
    ]
    model = GraphModel.from_ops(ops, variable_bytes=2 * MIB, variables=[("k:0", MIB), ("b:0", MIB)])
    transfers = {s.tensor: s for s in offload_decisions(model, weights=True).transfers}
    (bias,) = transfers["b_read:0"].swap_ins
    (kernel,) = transfers["k_read:0"].swap_ins
    assert bias.trigger == "a1"  # not the Conv2D, the one op of its window that is not a sum
    assert kernel.trigger == "a1"
