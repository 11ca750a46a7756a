"""Placement (``devices=[...]``) on hand-built steps: the plan record, the placer's rules, its
objective against an even split by layer count, and the option's errors."""

import json

import pytest

from tflms.config import Knobs, LMSConfig
from tflms.emulate.simulator import Simulator
from tflms.ir.decisions import Stage
from tflms.ir.graph import GraphModel
from tflms.plan.passes.place import (
    ELSEWHERE,
    StagePeaks,
    anchors,
    device_model,
    evaluate,
    forward_order,
    place,
    placement_plan,
    stage_of,
    with_placement,
)
from tflms.plan.planner import make_plan
from tflms.plan.records import SwapPlan
from tflms.plan.registry import replay

pytestmark = pytest.mark.unit

DEVICES = ["/device:GPU:0", "/device:GPU:1"]
RES = [("resource", (), 0, False)]


def f32(n: int) -> list:
    return [("float32", (n,), 4 * n, False)]


def layered(sizes: list[int]) -> GraphModel:
    """A chain of layers ``l{i}`` (a MatMul on a weight, then a Relu of ``sizes[i]`` floats), the
    loss, the backward pass in reverse (each layer's gradient reads its activation), and an update
    of each weight: as TensorFlow names a ``GradientTape`` step."""
    ops = [{"name": "x", "type": "Placeholder", "inputs": [], "outputs": f32(16)}]
    variables = []
    prev = "x:0"
    for i, n in enumerate(sizes):
        ops += [
            {"name": f"w{i}", "type": "Placeholder", "inputs": [], "outputs": RES},
            {"name": f"model/l{i}/read", "type": "ReadVariableOp", "inputs": [f"w{i}:0"], "outputs": f32(64)},
            {"name": f"model/l{i}/MatMul", "type": "MatMul", "inputs": [prev, f"model/l{i}/read:0"], "outputs": f32(n)},
            {"name": f"model/l{i}/Relu", "type": "Relu", "inputs": [f"model/l{i}/MatMul:0"], "outputs": f32(n)},
        ]
        variables.append((f"w{i}:0", 256))
        prev = f"model/l{i}/Relu:0"
    ops.append({"name": "loss", "type": "Sum", "inputs": [prev], "outputs": f32(1)})
    ops.append({"name": "gradient_tape/loss/grad", "type": "OnesLike", "inputs": [prev], "outputs": f32(sizes[-1])})
    grad = "gradient_tape/loss/grad:0"
    for i in reversed(range(len(sizes))):
        relu, mm = f"gradient_tape/model/l{i}/Relu/ReluGrad", f"gradient_tape/model/l{i}/MatMul/MatMul"
        ops += [
            {"name": relu, "type": "ReluGrad", "inputs": [grad, f"model/l{i}/Relu:0"], "outputs": f32(sizes[i])},
            {"name": mm, "type": "MatMul", "inputs": [f"{relu}:0", f"model/l{i}/read:0"], "outputs": f32(64)},
            {"name": f"adam/Mul_{i}", "type": "Mul", "inputs": [f"{mm}:0"], "outputs": f32(64)},
            {"name": f"adam/Assign_{i}", "type": "AssignSubVariableOp", "inputs": [f"w{i}:0", f"adam/Mul_{i}:0"],
             "outputs": []},
        ]  # fmt: skip
        grad = f"{mm}:0"
    return GraphModel.from_ops(ops, variable_bytes=256 * len(sizes), name="step", variables=variables)


def test_backward_ops_go_with_their_forward_op_and_the_update_with_the_variables():
    model = layered([100] * 6)
    forward = forward_order(model)
    assert forward == [f"model/l{i}/{op}" for i in range(6) for op in ("MatMul", "Relu")] + ["loss"]
    stage = stage_of(anchors(model, forward), [6])  # layers 0-2 | 3-5
    for i in range(6):
        k = 0 if i < 3 else 1
        assert stage[f"model/l{i}/Relu"] == stage[f"gradient_tape/model/l{i}/Relu/ReluGrad"] == k
        assert stage[f"gradient_tape/model/l{i}/MatMul/MatMul"] == k
        assert stage[f"adam/Mul_{i}"] == stage[f"adam/Assign_{i}"] == stage[f"model/l{i}/read"] == 0
    assert stage["x"] == 0 and stage["loss"] == 1 and stage["gradient_tape/loss/grad"] == 1


def test_a_device_model_allocates_only_its_ops_and_receives_what_it_reads():
    model = layered([1000, 10, 10, 10])
    forward = forward_order(model)
    stage = stage_of(anchors(model, forward), [2])  # layer 0 | layers 1-3
    dev1 = device_model(model, stage, 1)
    # Layer 1 reads layer 0's activation and its weight from device 0: both received on device 1.
    assert dev1.inputs_of["model/l1/MatMul"] == [
        "model/l0/Relu/tflms_place_recv_0:0",
        "model/l1/read/tflms_place_recv_0:0",
    ]
    assert dev1.variable_bytes == 0 and dev1.dag.nodes["model/l0/Relu"]["device"] == ELSEWHERE
    # The fast count of the search agrees with the simulator on each device model (requested bytes).
    fast = StagePeaks(model).peaks(stage, 2)
    exact = [Simulator(device_model(model, stage, k), ELSEWHERE).requested_peak() for k in range(2)]
    assert list(fast) == exact
    # Device 1 holds layer 0's activation (received) but not the variables; device 0 holds both.
    assert exact[1] >= 4000 and exact[0] >= 4000 + model.variable_bytes


def test_placer_beats_an_even_split_by_layer_count_by_20_percent_on_uneven_layers():
    sizes = [8000, 500, 8000, 500, 500, 500, 500, 500]
    model = layered(sizes)
    forward = forward_order(model)
    even = stage_of(anchors(model, forward), [forward.index("model/l4/MatMul")])  # 4 layers each
    even_peak = max(st.peak_bytes for st in evaluate(model, DEVICES, even))
    stages = place(model, DEVICES)
    placed_peak = max(st.peak_bytes for st in stages)
    assert placed_peak <= 0.8 * even_peak, (placed_peak, even_peak)
    # Every op is in exactly one stage, the stages in the order of the devices.
    names = [op for st in stages for op in st.ops]
    assert sorted(names) == sorted(model.dag) and [st.device for st in stages] == DEVICES
    # The chosen peaks are what the simulator predicts per device, not the search's count.
    chosen = {op: k for k, st in enumerate(stages) for op in st.ops}
    assert [st.peak_bytes for st in stages] == [
        Simulator(device_model(model, chosen, k), ELSEWHERE).peak() for k in range(2)
    ]


def test_placer_with_four_devices_is_no_worse_than_with_two():
    model = layered([8000, 500, 8000, 500, 6000, 500, 500, 500])
    two = max(st.peak_bytes for st in place(model, DEVICES))
    four = place(model, [f"/device:GPU:{i}" for i in range(4)])
    assert len(four) == 4 and all(st.ops for st in four)
    assert max(st.peak_bytes for st in four) <= two


def test_placement_is_deterministic():
    model = layered([8000, 500, 8000, 500, 500, 500])
    assert place(model, DEVICES) == place(layered([8000, 500, 8000, 500, 500, 500]), DEVICES)


def test_plan_holds_the_placement_in_json_format_7_and_reads_version_6():
    model = layered([8000, 500, 8000, 500, 500, 500])
    plan = placement_plan(model, LMSConfig(devices=DEVICES))
    assert plan.swaps == () and len(plan.placement) == 2
    assert plan.peak_bytes_after == max(st.peak_bytes for st in plan.placement) < plan.peak_bytes_before
    data = json.loads(plan.to_json())
    assert data["format_version"] == 7 and data["options"]["devices"] == DEVICES
    assert data["placement"][0]["device"] == DEVICES[0] and "model/l0/Relu" in data["placement"][0]["ops"]
    again = SwapPlan.from_json(plan.to_json())
    assert again == plan and isinstance(again.placement[0], Stage)
    assert LMSConfig.from_dict(again.options).devices == tuple(DEVICES)
    # A version-6 plan (no placement) is still read, without one.
    old = json.loads(make_plan(model, LMSConfig(budget=None)).to_json())
    del old["placement"]
    assert SwapPlan.from_json(json.dumps({**old, "format_version": 6})).placement == ()
    text = plan.summary()
    assert "placement on 2 devices" in text and f"{DEVICES[1]}:" in text


def test_replay_puts_each_op_on_its_stage_device():
    model = layered([8000, 500, 8000, 500, 500, 500])
    plan = placement_plan(model, LMSConfig(devices=DEVICES))
    placed = replay(model, plan)
    where = {op: st.device for st in plan.placement for op in st.ops}
    for op, device in placed.dag.nodes(data="device"):
        if placed.dag.nodes[op]["type"] in ("Placeholder", "ReadVariableOp", "AssignSubVariableOp"):
            assert device == ""  # beside the variable, where TensorFlow's placer puts it
        else:
            assert device == where[op]
    assert with_placement(model, ()) is model


def test_a_budget_below_the_largest_device_peak_raises_or_warns():
    from tflms.errors import BudgetError, LMSWarning

    model = layered([8000, 500, 8000, 500, 500, 500])
    with pytest.raises(BudgetError):
        placement_plan(model, LMSConfig(devices=DEVICES, budget=1024))
    with pytest.warns(LMSWarning, match="exceeds the budget"):
        plan = placement_plan(model, LMSConfig(devices=DEVICES, budget=1024, on_budget_miss="best"))
    assert plan.placement


@pytest.mark.parametrize(
    "value, match",
    [
        (["/device:GPU:0"], "two or more devices"),
        ("/device:GPU:0", "must be a list"),
        (["/device:GPU:0", "/device:GPU:0"], "distinct"),
        (["/device:GPU:0", "/gpu:0"], "distinct"),
        (["/device:GPU:0", "gpu zero"], r"devices\[1\] is not a device string"),
        (["/device:GPU:0", "/device:GPU"], r"devices\[1\] is not a device string"),
        (["/device:GPU:0", 3], r"devices\[1\] is not a device string"),
        (["/device:GPU:0", "/device:CPU:0"], "must not list the host"),
    ],
)
def test_bad_devices_are_refused_naming_the_value(value, match):
    with pytest.raises(ValueError, match=match) as err:
        LMSConfig(devices=value)
    assert f"Received: devices={value!r}" in str(err.value)


def test_devices_do_not_combine_with_device_or_offload():
    with pytest.raises(ValueError, match="device and devices cannot both be given"):
        LMSConfig(devices=DEVICES, device="/device:GPU:0")
    with pytest.raises(ValueError, match="offload cannot be combined with devices") as err:
        LMSConfig(devices=DEVICES, offload="optimizer")
    assert "offload='optimizer'" in str(err.value)
    with pytest.raises(ValueError, match="two or more devices"):
        place(layered([10, 10]), DEVICES[:1])


def test_default_is_no_placement():
    cfg = LMSConfig()
    assert cfg.devices is None and "devices" not in cfg.to_dict()
    plan = make_plan(layered([100, 100]), LMSConfig(budget=None))
    assert plan.placement == () and "placement" not in plan.summary()
    short = LMSConfig(devices=["/gpu:0", "/gpu:1"]).devices
    assert LMSConfig(devices=tuple(DEVICES)).devices == short == tuple(DEVICES)


def test_summary_gives_the_predicted_step_time_of_the_placement():
    model = layered([8000, 500, 8000, 500, 500, 500])
    plan = placement_plan(model, LMSConfig(devices=DEVICES, knobs=Knobs(link_bandwidth=10**9)))
    expected = sum(st.compute_seconds + st.received_bytes / 1e9 for st in plan.placement)
    assert plan.placement_seconds == pytest.approx(expected) and expected > 0
    assert f"predicted step time {expected * 1e3:.2f} ms" in plan.summary()
