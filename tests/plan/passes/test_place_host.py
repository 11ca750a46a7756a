"""Copy-only ops on the host in a placement (``place(..., host=...)``): which ops qualify, the
automatic choice (only moves that lower the largest predicted device peak), the named choice, the
host's stage in the plan, and the errors."""

import pytest

from tflms.config import LMSConfig
from tflms.emulate.simulator import Simulator
from tflms.ir.graph import GraphModel
from tflms.plan.passes.place import copy_ops, device_stages, evaluate, place, placement_plan, with_placement

pytestmark = pytest.mark.unit

DEVICES = ["/device:GPU:0", "/device:GPU:1"]
HOST = "/device:CPU:0"
N = 1 << 19  # floats: 2 MiB tensors, above HOST_MIN_BYTES
G = "gradient_tape/"


def f32(n: int) -> list:
    return [("float32", (n,), 4 * n, False)]


def skip_concat() -> GraphModel:
    """Two layers ``a`` and ``b``, a ``ConcatV2`` of both (a U-Net's skip connection), a sum; the
    backward pass slices the concatenation's gradient back into two (``Slice``), as TensorFlow does."""
    ops = [
        {"name": "x", "type": "Placeholder", "inputs": [], "outputs": f32(16)},
        {"name": "m/a/Relu", "type": "Relu", "inputs": ["x:0"], "outputs": f32(N)},
        {"name": "m/b/Relu", "type": "Relu", "inputs": ["m/a/Relu:0"], "outputs": f32(N)},
        {"name": "m/cat/concat", "type": "ConcatV2", "inputs": ["m/b/Relu:0", "m/a/Relu:0"], "outputs": f32(2 * N)},
        {"name": "m/d/Sum", "type": "Sum", "inputs": ["m/cat/concat:0"], "outputs": f32(1)},
        {"name": G + "m/d/Sum/grad", "type": "OnesLike", "inputs": ["m/cat/concat:0"], "outputs": f32(2 * N)},
        {"name": G + "m/cat/Slice", "type": "Slice", "inputs": [G + "m/d/Sum/grad:0"], "outputs": f32(N)},
        {"name": G + "m/cat/Slice_1", "type": "Slice", "inputs": [G + "m/d/Sum/grad:0"], "outputs": f32(N)},
        {
            "name": G + "m/b/Relu/ReluGrad",
            "type": "ReluGrad",
            "inputs": [G + "m/cat/Slice:0", "m/b/Relu:0"],
            "outputs": f32(N),
        },
        {
            "name": G + "m/a/AddN",
            "type": "AddN",
            "inputs": [G + "m/b/Relu/ReluGrad:0", G + "m/cat/Slice_1:0"],
            "outputs": f32(N),
        },  # fmt: skip
        {
            "name": G + "m/a/Relu/ReluGrad",
            "type": "ReluGrad",
            "inputs": [G + "m/a/AddN:0", "m/a/Relu:0"],
            "outputs": f32(N),
        },  # fmt: skip
    ]
    return GraphModel.from_ops(ops)


COPIES = ["m/cat/concat", G + "m/cat/Slice", G + "m/cat/Slice_1"]


def test_copy_ops_are_the_large_copies_largest_first():
    model = skip_concat()
    assert copy_ops(model) == COPIES
    assert copy_ops(model, min_bytes=8 * N + 1) == []


def test_without_a_host_nothing_moves():
    stages = place(skip_concat(), DEVICES, exact=False)
    assert [st.device for st in stages] == DEVICES
    assert "m/cat/concat" in stages[1].ops  # the concatenation sits with the second layer's stage


def test_named_copies_run_on_the_host_and_lower_the_device_peak():
    model = skip_concat()
    plain = place(model, DEVICES, exact=False)
    stages = place(model, DEVICES, exact=False, host=HOST, host_ops=COPIES)
    assert [st.device for st in stages] == [*DEVICES, HOST]
    assert stages[2].ops == tuple(sorted(COPIES))
    assert not set(COPIES) & {op for st in stages[:2] for op in st.ops}
    # On one device the concatenation held its inputs (2 N floats) and its output (2 N) at once;
    # with it on the host the device holds the output it receives (and the gradient it sends).
    assert max(st.peak_bytes for st in plain) == 20 * N
    assert max(st.peak_bytes for st in device_stages(stages, HOST)) == 16 * N
    assert stages[2].received_bytes == 8 * N + 8 * N  # both inputs, then the gradient to slice


def test_automatic_choice_keeps_only_moves_that_lower_the_largest_peak():
    model = skip_concat()
    stages = place(model, DEVICES, exact=False, host=HOST)
    # The first Slice alone lowers the largest device peak; the others lower it no further.
    assert stages[-1].device == HOST and stages[-1].ops == (G + "m/cat/Slice",)
    largest = max(st.peak_bytes for st in device_stages(stages, HOST))
    assert largest < max(st.peak_bytes for st in place(model, DEVICES, exact=False))


def test_placement_plan_puts_copies_on_config_host():
    model = skip_concat()
    plan = placement_plan(model, LMSConfig(devices=DEVICES, host=HOST), host_ops=COPIES)
    assert [st.device for st in plan.placement] == [*DEVICES, HOST]
    assert plan.peak_bytes_after == max(st.peak_bytes for st in plan.placement[:2])
    assert "3 copy-only ops on the host" in plan.reason
    # As the rewrite places them: the simulator counts nothing of the host's ops on a device.
    placed = with_placement(model, plan.placement)
    assert all(placed.dag.nodes[op]["device"] == HOST for op in COPIES)
    assert Simulator(placed, HOST).requested_peak() < Simulator(model, HOST).requested_peak()


def test_host_errors():
    model = skip_concat()
    with pytest.raises(ValueError, match=r"host_ops needs host=.*Received: host_ops=\['m/cat/concat'\]"):
        place(model, DEVICES, host_ops=["m/cat/concat"])
    with pytest.raises(ValueError, match=r"'m/b/Relu' is not one.*Received: host_ops=\['m/b/Relu'\]"):
        place(model, DEVICES, host=HOST, host_ops=["m/b/Relu"])
    with pytest.raises(ValueError, match=r"host must not be one of devices. Received: host='/device:GPU:1'"):
        place(model, DEVICES, host="/device:GPU:1")
    stage = {op: 0 for op in model.dag} | {"m/cat/concat": 2}
    with pytest.raises(ValueError, match=r"without a host. Received: host=None"):
        evaluate(model, DEVICES, stage)
