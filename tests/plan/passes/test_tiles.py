"""Tiles left out (``drop_tiles``) on hand-built graphs: which tiles, the ops made again, the plan."""

import json

import pytest

from tflms import Knobs, LMSConfig, SwapPlan, make_plan
from tflms.emulate.simulator import Simulator
from tflms.ir.graph import GraphModel
from tflms.plan.passes.tiles import broadcast_shape, droppable_tiles, new_name, with_dropped_tiles

from graphs import f32, op

pytestmark = pytest.mark.unit

FULL = (8, 16, 16, 32)  # an activation: 256 KiB
CHANNEL = (1, 1, 1, 32)


def bn_gradient(tile_type="Tile", reader="Mul", dynamic=False):
    """The backward pass of an unfused BatchNorm's statistics, as Keras 3 traces it: a per-channel
    gradient ``r`` tiled to the activation's size, divided by the count, and (``reader``) multiplied by
    ``x`` minus the mean; the input gradient ``AddN`` sums that, the tile's quotient and ``dy``.
    ``dynamic``: the batch dimension is unknown (as traced for ``model.fit``)."""
    full = f32(*FULL)
    if dynamic:
        full = ("float32", (None, *FULL[1:]), full[2], True)
    ops = [
        op("x", "Placeholder", outputs=[full]),
        op("f", "Relu", ["x:0"], [full]),
        op("loss", "Sum", ["f:0"], [f32()]),
        op("gradient_tape/dy", "ReluGrad", ["loss:0", "f:0"], [full]),
        op("gradient_tape/r", "Sum", ["gradient_tape/dy:0"], [f32(*CHANNEL)]),
        op("gradient_tape/multiples", "Const", outputs=[("int32", (4,), 16, False)]),
        op("gradient_tape/Tile", tile_type, ["gradient_tape/r:0", "gradient_tape/multiples:0"], [full]),
        op("gradient_tape/count", "Const", outputs=[f32()]),
        op("gradient_tape/truediv", "RealDiv", ["gradient_tape/Tile:0", "gradient_tape/count:0"], [full]),
        op("gradient_tape/two", "Const", outputs=[f32()], control=["gradient_tape/truediv"]),
        op("gradient_tape/Mul", "Mul", ["gradient_tape/two:0", "gradient_tape/truediv:0"], [full]),
        op("gradient_tape/sub", "Sub", ["f:0", "x:0"], [full], control=["gradient_tape/truediv"]),
        op("gradient_tape/mul_1", reader, ["gradient_tape/Mul:0", "gradient_tape/sub:0"], [full]),
        op("gradient_tape/dy_scale", "Mul", ["gradient_tape/dy:0", "f:0"], [full]),
        op(
            "AddN",
            "AddN",
            ["gradient_tape/dy_scale:0", "gradient_tape/truediv:0", "gradient_tape/mul_1:0"],
            [full],
        ),
        op("gradient_tape/h", "ReluGrad", ["AddN:0", "f:0"], [full]),
        op("update", "AssignSubVariableOp", ["gradient_tape/h:0"], []),
    ]
    return GraphModel.from_ops(ops, name="bn")


def split(model):
    from tflms.plan.passes.sums import with_split_sums

    return with_split_sums(model)[0]


def test_broadcast_shapes():
    assert broadcast_shape((1, 1, 1, 32), FULL) == FULL
    assert broadcast_shape((), CHANNEL) == CHANNEL
    assert broadcast_shape((None, 16, 1, 32), (1, 1, 8, 32)) == (None, 16, 8, 32)
    assert broadcast_shape((2, 32), (3, 32)) is None


def test_a_tiled_mean_gradient_is_left_out_and_its_readers_broadcast_it():
    model = split(bn_gradient())
    assert droppable_tiles(model) == ["gradient_tape/Tile"]
    dropped, tiles = with_dropped_tiles(model)
    assert tiles == ["gradient_tape/Tile"] and "gradient_tape/Tile" not in dropped.dag
    t = dropped.tensors
    # The quotient and the product with 2 are per-channel now; the product with x - mean is full again.
    assert t[f"{new_name('gradient_tape/truediv')}:0"].shape == CHANNEL
    assert t[f"{new_name('gradient_tape/truediv')}:0"].bytes == 4 * 32
    assert t[f"{new_name('gradient_tape/Mul')}:0"].shape == CHANNEL
    assert t[f"{new_name('gradient_tape/mul_1')}:0"].shape == FULL
    assert dropped.inputs_of[new_name("gradient_tape/truediv")] == ["gradient_tape/r:0", "gradient_tape/count:0"]
    # The chain's step that adds the per-channel term is made again; the control edges follow the ops.
    remade = sorted(n for n in dropped.dag if n.endswith("/tflms_bcast"))
    assert any(n.startswith("AddN/tflms_sum_") for n in remade)
    assert new_name("gradient_tape/truediv") in dropped.dag.predecessors("gradient_tape/sub")
    assert "gradient_tape/truediv" not in dropped.dag
    # At the peak, two activation-sized buffers (the tile, which the quotient overwrites, and the
    # product with 2) become two per-channel ones of 128 bytes.
    before, after = Simulator(model).requested_peak(), Simulator(dropped).requested_peak()
    assert before - after == 2 * (4 * 8 * 16 * 16 * 32) - 2 * 128
    assert with_dropped_tiles(dropped) == (dropped, [])  # nothing left to leave out


def test_a_broadcast_to_of_an_unknown_batch_is_left_out_too():
    model = split(bn_gradient(tile_type="BroadcastTo", dynamic=True))
    dropped, tiles = with_dropped_tiles(model)
    assert tiles == ["gradient_tape/Tile"]
    assert dropped.tensors[f"{new_name('gradient_tape/truediv')}:0"].shape == CHANNEL
    full = dropped.tensors[f"{new_name('gradient_tape/mul_1')}:0"]
    assert full.shape == (None, *FULL[1:]) and full.bytes == 4 * 8 * 16 * 16 * 32


def test_a_tile_read_by_an_op_that_does_not_broadcast_stays():
    assert droppable_tiles(split(bn_gradient(reader="ReluGrad"))) == []
    # Without the sums split, the AddN reads the quotient: it does not broadcast.
    assert droppable_tiles(bn_gradient()) == []
    with pytest.raises(ValueError, match="tiles to leave out do not fit this model: .*'AddN'"):
        with_dropped_tiles(bn_gradient(), ["gradient_tape/Tile"])
    with pytest.raises(ValueError, match="'gradient_tape/r' is not a Tile or BroadcastTo op"):
        with_dropped_tiles(split(bn_gradient()), ["gradient_tape/r"])


def test_the_option_needs_split_sums_and_the_plan_records_its_tiles():
    with pytest.raises(ValueError, match="policy 'drop_tiles' needs 'split_sums'.*Received: policy="):
        LMSConfig(policy="drop_tiles")
    with pytest.raises(TypeError, match="drop_tiles=1, split_sums=True is not an option: .* Received: drop_tiles=1"):
        LMSConfig(drop_tiles=1, split_sums=True)
    model = bn_gradient()
    options = {"knobs": Knobs(min_bytes=0, swapout_threshold=2, serialize=False)}
    plan = make_plan(model, LMSConfig(policy=("default", "split_sums", "drop_tiles"), **options))
    assert plan.tiles == ("gradient_tape/Tile",)
    assert "tiles left out: 1 Tile/BroadcastTo ops" in plan.summary()
    sums_only = make_plan(model, LMSConfig(policy=("default", "split_sums"), **options))
    assert sums_only.tiles == () and plan.peak_bytes_after < sums_only.peak_bytes_after
    data = json.loads(plan.to_json())
    assert data["format_version"] == 7 and data["tiles"] == ["gradient_tape/Tile"]
    assert SwapPlan.from_json(plan.to_json()) == plan
    old = {k: v for k, v in data.items() if k != "tiles"}
    assert SwapPlan.from_json(json.dumps({**old, "format_version": 5})).tiles == ()


def test_the_memory_plot_of_a_plan_with_tiles_left_out_runs_the_ops_made_again():
    from tflms.report.plot import memory_plot_data

    model = bn_gradient()
    plan = make_plan(
        model, LMSConfig(policy=("default", "split_sums", "drop_tiles"), knobs=Knobs(min_bytes=0, swapout_threshold=2))
    )
    data = memory_plot_data(model, plan)
    assert int(data.before.max()) == plan.peak_bytes_before
    assert int(data.after.max()) == plan.peak_bytes_after < plan.peak_bytes_before


def test_two_tiles_that_meet_in_an_op_that_stays_full_are_both_left_out_and_an_output_is_refused():
    """A sum of two tiled values is itself per-channel; read by an op that does not broadcast, the
    pair cannot go, though each alone could (its sum with a full-sized value is full-sized)."""
    full = f32(*FULL)

    def model(reader):
        ops = [
            op("x", "Placeholder", outputs=[full]),
            op("loss", "Sum", ["x:0"], [f32()]),
            op("gradient_tape/dy", "ReluGrad", ["loss:0", "x:0"], [full]),
            op("gradient_tape/r", "Sum", ["gradient_tape/dy:0"], [f32(*CHANNEL)]),
            op("gradient_tape/m", "Const", outputs=[("int32", (4,), 16, False)]),
            op("gradient_tape/TileA", "Tile", ["gradient_tape/r:0", "gradient_tape/m:0"], [full]),
            op("gradient_tape/TileB", "Tile", ["gradient_tape/r:0", "gradient_tape/m:0"], [full]),
            op("gradient_tape/both", "AddV2", ["gradient_tape/TileA:0", "gradient_tape/TileB:0"], [full]),
            op("gradient_tape/next", reader, ["gradient_tape/both:0", "gradient_tape/dy:0"], [full]),
            op("update", "AssignSubVariableOp", ["gradient_tape/next:0"], []),
        ]
        return GraphModel.from_ops(ops)

    both = model("Mul")
    assert droppable_tiles(both) == ["gradient_tape/TileA", "gradient_tape/TileB"]
    dropped, _ = with_dropped_tiles(both)
    assert dropped.tensors[f"{new_name('gradient_tape/both')}:0"].shape == CHANNEL
    assert dropped.tensors[f"{new_name('gradient_tape/next')}:0"].shape == FULL
    assert droppable_tiles(model("ReluGrad")) == []  # together they reach the ReluGrad: neither goes
    taken = GraphModel.from_ops([*(dict(r) for r in _ops(both)), op(new_name("gradient_tape/both"), "NoOp")])
    with pytest.raises(ValueError, match="cannot name the op made again for 'gradient_tape/both'"):
        with_dropped_tiles(taken, ["gradient_tape/TileA", "gradient_tape/TileB"])


def _ops(model):
    from tflms.ir.graph import op_records

    return list(op_records(model).values())
