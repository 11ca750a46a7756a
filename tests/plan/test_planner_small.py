"""The planner on hand-built graphs: candidates, triggers, groups, filters, the plan's JSON."""

import dataclasses
import json

import pytest

from tflms import Knobs, LMSConfig, SwapPlan, make_plan
from tflms.emulate.simulator import Simulator
from tflms.ir.graph import GraphModel
from tflms.plan.planner import UNFENCED_TYPES, fences_for

from graphs import chain_model, f32, op, relu_chain

pytestmark = pytest.mark.unit

NOFILTER = Knobs(min_bytes=0, swapin_groupby=0)


def test_candidates_respect_threshold_and_distance():
    m = chain_model(n_fwd=6)  # f_i at level i+1; b_i at level 8 + (5 - i)
    plan = make_plan(m, LMSConfig(knobs=NOFILTER.replace(swapout_threshold=6, swapin_ahead=1)))
    # distance(f_i -> b_i) = 8 + 5 - i - (i + 1) = 12 - 2i > 6  <=>  i < 3
    assert [s.tensor for s in plan.swaps] == ["f0:0", "f1:0", "f2:0"]
    assert [s.distance for s in plan.swaps] == [12, 10, 8]
    # Placeholder x is never a candidate (the caller holds it anyway).
    assert all(s.producer != "x" for s in plan.swaps)


def test_swapin_ahead_picks_a_backward_ancestor_deterministically():
    m = chain_model(n_fwd=6)
    plan = make_plan(m, LMSConfig(knobs=NOFILTER.replace(swapout_threshold=6, swapin_ahead=2)))
    f0 = plan.swaps[0]
    (si,) = f0.swap_ins
    assert si.consumers == (("gradient_tape/b0", 1),)
    assert si.level == 13 and si.trigger == "gradient_tape/b2" and si.trigger_level == 11
    # Too far ahead would reach the forward pass: the earliest backward ancestor is used instead.
    plan = make_plan(m, LMSConfig(knobs=NOFILTER.replace(swapout_threshold=6, swapin_ahead=50)))
    assert plan.swaps[0].swap_ins[0].trigger == "gradient_tape/b5"


def test_no_backward_ancestor_means_no_swap():
    # Nothing in the backward pass could hold the swap-in back: it would come straight
    # back after the swap-out, freeing nothing, so the tensor is not a candidate.
    ops = [
        op("a", "Relu", outputs=[f32(64, 64)]),
        op("f1", "Relu", ["a:0"], [f32(2, 2)]),
        op("f2", "Relu", ["f1:0"], [f32(2, 2)]),
        op("gradient_tape/g", "Mul", ["f2:0", "a:0"], [f32(64, 64)]),
    ]
    plan = make_plan(GraphModel.from_ops(ops), LMSConfig(knobs=NOFILTER.replace(swapout_threshold=1)))
    assert plan.swaps == ()
    # The same tensor with a backward op before its consumer is swapped, with that trigger.
    ops[3:] = [
        op("gradient_tape/g0", "Relu", ["f2:0"], [f32(2, 2)]),
        op("gradient_tape/g", "Mul", ["gradient_tape/g0:0", "a:0"], [f32(64, 64)]),
    ]
    plan = make_plan(GraphModel.from_ops(ops), LMSConfig(knobs=NOFILTER.replace(swapout_threshold=1)))
    assert [s.tensor for s in plan.swaps] == ["a:0"] and plan.swaps[0].swap_ins[0].trigger == "gradient_tape/g0"


def test_consumers_grouped_by_swapin_groupby():
    ops = [op("x", "Placeholder", outputs=[f32(32, 32)]), op("a", "Relu", ["x:0"], [f32(32, 32)])]
    prev = relu_chain(ops, "a:0", "f", 10, f32(2, 2))
    grad = prev
    for i in range(10):  # each reading a
        ops.append(op(f"gradient_tape/g{i}", "Mul", [grad, "a:0"], [f32(2, 2)]))
        grad = f"gradient_tape/g{i}:0"
    m = GraphModel.from_ops(ops)
    plan = make_plan(m, LMSConfig(knobs=Knobs(swapout_threshold=11, swapin_groupby=3, swapin_ahead=1, min_bytes=0)))
    (swap,) = [s for s in plan.swaps if s.tensor == "a:0"]
    # Far consumers: g1..g9 (levels 13..21); g0 (distance 12) keeps the device tensor.
    groups = [[c for c, _ in si.consumers] for si in swap.swap_ins]
    assert groups == [
        ["gradient_tape/g1", "gradient_tape/g2", "gradient_tape/g3", "gradient_tape/g4"],
        ["gradient_tape/g5", "gradient_tape/g6", "gradient_tape/g7", "gradient_tape/g8"],
        ["gradient_tape/g9"],
    ]
    assert [si.trigger for si in swap.swap_ins] == ["gradient_tape/g0", "gradient_tape/g4", "gradient_tape/g8"]


@pytest.mark.parametrize(
    "options, expected",
    [
        ({"n_tensors": 2}, ["f0:0", "f1:0"]),  # equal bytes: the longest distances win
        ({"n_tensors": 0}, []),
        ({"min_bytes": 10**9}, []),
        ({"incl_scopes": ["f1"]}, ["f1:0"]),
        ({"excl_scopes": ["f1", "f2"]}, ["f0:0"]),
    ],
)
def test_filters(options, expected):
    # The op-type filters (validated against TensorFlow's op registry) are in tests/test_planner.py.
    m = chain_model(n_fwd=6)
    cfg = LMSConfig(knobs=Knobs(swapout_threshold=6, swapin_groupby=0, min_bytes=0)).with_knobs(**options)
    assert [s.tensor for s in make_plan(m, cfg).swaps] == expected


def test_excluded_dtypes_ranks_and_host_tensors():
    ops = [
        op("a", "Relu", outputs=[f32(64, 64)], device="/device:CPU:0"),
        op("v", "Relu", outputs=[f32(4096)]),
        op("i", "Shape", outputs=[("int32", (64, 64), 4 * 64 * 64, False)]),
        op("f", "Relu", ["a:0", "v:0", "i:0"], [f32(2, 2)]),
        op("f2", "Relu", ["f:0"], [f32(2, 2)]),
        op("gradient_tape/g", "Mul", ["f2:0", "a:0", "v:0", "i:0"], [f32(2, 2)]),
    ]
    plan = make_plan(GraphModel.from_ops(ops), LMSConfig(knobs=Knobs(swapout_threshold=1, min_bytes=0)))
    assert plan.swaps == ()
    assert "no tensor qualifies" in plan.reason


def test_tensors_with_an_unknown_inner_dimension_are_not_swapped():
    # Traced with an unknown batch, BERT's Tensordot Reshapes are (None, None): such a size
    # is a guess (batch x 4 bytes here), so the tensor is never planned.
    unsized, sized = ("float32", (None, None), 64 * 4, True), ("float32", (None, 256), 64 * 256 * 4, True)
    ops = [
        op("x", "Placeholder", outputs=[sized]),
        op("a", "Relu", ["x:0"], [sized]),
        op("r", "BatchMatMulV2", ["a:0"], [unsized]),
        op("b", "Relu", ["r:0"], [sized]),
        op("c", "Relu", ["b:0"], [sized]),
        op("gradient_tape/g0", "Relu", ["c:0"], [sized]),
        op("gradient_tape/g1", "Relu", ["gradient_tape/g0:0"], [sized]),
        op("gradient_tape/g2", "Mul", ["gradient_tape/g1:0", "a:0", "r:0"], [sized]),
    ]
    plan = make_plan(GraphModel.from_ops(ops), LMSConfig(knobs=Knobs(swapout_threshold=1, min_bytes=0)))
    assert [s.tensor for s in plan.swaps] == ["a:0"]


def test_no_backward_ops_gives_an_empty_plan_with_a_reason():
    ops = [op("a", "Relu", outputs=[f32(64, 64)]), op("b", "Relu", ["a:0"], [f32(64, 64)])]
    plan = make_plan(GraphModel.from_ops(ops), LMSConfig())
    assert plan.swaps == () and "no backward ops" in plan.reason
    assert plan.peak_bytes_after == plan.peak_bytes_before


def test_plan_json_is_deterministic_and_roundtrips():
    cfg = LMSConfig(knobs=Knobs(swapout_threshold=4, swapin_ahead=2, min_bytes=0))
    p1 = make_plan(chain_model(n_fwd=6), cfg)
    p2 = make_plan(chain_model(n_fwd=6), cfg)
    assert p1.to_json() == p2.to_json() and p1.fingerprint() == p2.fingerprint()
    data = json.loads(p1.to_json())
    assert (
        data["format_version"] == 7
        and data["recomputes"] == data["fences"] == data["orders"] == data["sums"] == data["tiles"] == []
    )
    assert {"swaps", "peak_bytes_before", "peak_bytes_after", "options"} <= set(data)
    assert data["options"]["swapout_threshold"] == 4
    assert SwapPlan.from_json(p1.to_json()) == p1
    with pytest.raises(ValueError, match="format_version"):
        SwapPlan.from_json(json.dumps({**data, "format_version": 99}))
    # Versions 1 (before recompute), 2 (before fences), 3 (before orders) and 4 (before sums) are still read.
    old = {k: v for k, v in data.items() if k not in ("recomputes", "fences", "orders", "sums")}
    for version in (1, 2, 3, 4):
        assert SwapPlan.from_json(json.dumps({**old, "format_version": version})) == p1


def test_swapout_window_fences_each_swap_on_the_one_window_before_it():
    model = chain_model(n_fwd=8)
    plain = make_plan(model, LMSConfig(knobs=Knobs(swapout_threshold=2, swapin_ahead=1, min_bytes=0)))
    assert plain.fences == () and len(plain.swaps) >= 4
    for window in (1, 2):
        plan = make_plan(
            model, LMSConfig(knobs=Knobs(swapout_threshold=2, swapin_ahead=1, min_bytes=0, swapout_window=window))
        )
        assert plan.swaps == plain.swaps and plan.peak_bytes_after == plain.peak_bytes_after
        pos = Simulator(model).pos  # the simulator's execution order
        ordered = sorted(plan.swaps, key=lambda s: pos[s.producer])
        # The producer of each swapped tensor waits for the swap-out `window` swaps before it.
        assert [(f.tensor, f.op) for f in plan.fences] == [
            (a.tensor, b.producer) for a, b in zip(ordered, ordered[window:])
        ]
        assert f"swap-out fences: {len(plan.fences)}" in plan.summary()
        data = json.loads(plan.to_json())
        assert data["fences"][0] == {"tensor": ordered[0].tensor, "op": ordered[window].producer}
        assert SwapPlan.from_json(plan.to_json()) == plan
    with pytest.raises(ValueError, match=r"swapout_window must be.*Received: swapout_window=0"):
        LMSConfig(knobs=Knobs(swapout_window=0))


def test_swapout_window_auto_fences_on_a_gpu_only():
    """The default, ``'auto'``, is GPU_SWAPOUT_WINDOW where the device is a GPU (measured there: the
    forward pass runs ahead of the link without fences) and no fences elsewhere; the plan records
    the window it used, and an explicit value is kept whatever the device."""
    from tflms.config import GPU_SWAPOUT_WINDOW

    model = chain_model(n_fwd=8)
    knobs = Knobs(swapout_threshold=2, swapin_ahead=1, min_bytes=0)
    assert LMSConfig().knobs.swapout_window == "auto"
    two = make_plan(model, LMSConfig(knobs=knobs.replace(swapout_window=GPU_SWAPOUT_WINDOW)))
    assert two.fences
    for device, window, fences in [
        ("/device:GPU:0", GPU_SWAPOUT_WINDOW, two.fences),
        ("/job:worker/replica:0/task:1/device:GPU:1", GPU_SWAPOUT_WINDOW, two.fences),
        ("/device:CPU:1", None, ()),
        (None, None, ()),
    ]:
        plan = make_plan(model, LMSConfig(knobs=knobs, device=device))
        assert (plan.options["swapout_window"], plan.fences) == (window, fences), device
        assert plan.swaps == two.swaps
    explicit = make_plan(model, LMSConfig(knobs=knobs.replace(swapout_window=None), device="/device:GPU:0"))
    assert explicit.fences == () and explicit.options["swapout_window"] is None
    assert make_plan(model, LMSConfig(knobs=knobs.replace(swapout_window=1), device="/device:CPU:1")).fences


def test_no_fence_on_a_sum_that_grappler_may_fold():
    """A fence is a control input, and Grappler's AddOpsRewrite leaves out sums with one: the
    producer of a swapped tensor that is an Add, AddV2 or AddN gets no fence."""
    plan = make_plan(chain_model(n_fwd=8), LMSConfig(knobs=Knobs(swapout_threshold=2, swapin_ahead=1, min_bytes=0)))
    pos = {s.producer: i for i, s in enumerate(plan.swaps)}
    fenced = fences_for(pos, list(plan.swaps), 1)
    assert [f.op for f in fenced] == [s.producer for s in plan.swaps[1:]]
    summed = [dataclasses.replace(s, producer_type=t) for s, t in zip(plan.swaps, ["Relu", "AddV2", "Mul", "AddN"])]
    summed += plan.swaps[4:]
    fenced = fences_for(pos, summed, 1)
    assert [f.op for f in fenced] == [s.producer for s in summed[1:] if s.producer_type not in UNFENCED_TYPES]
    assert len(fenced) == len(summed) - 3 and UNFENCED_TYPES == {"Add", "AddV2", "AddN"}


def test_summary_lists_every_swap_and_the_peaks():
    plan = make_plan(chain_model(n_fwd=6), LMSConfig(knobs=Knobs(swapout_threshold=4, swapin_ahead=2, min_bytes=0)))
    text = plan.summary()
    assert "predicted device peak (simulator)" in text
    for s in plan.swaps:
        assert s.tensor in text
        assert all(si.trigger in text for si in s.swap_ins)


def test_plan_predicts_its_link_time_from_the_link_options():
    model = chain_model(n_fwd=8, size=(256, 256))
    base = Knobs(swapout_threshold=2, swapin_groupby=0)
    plan = make_plan(model, LMSConfig(knobs=base))
    transfers = len(plan.swaps) + plan.n_swap_ins
    assert transfers > len(plan.swaps) > 0
    # Defaults: 25 GB/s and 10 us per transfer; every transfer here moves 256 KiB.
    assert plan.link_seconds == pytest.approx(transfers * (10e-6 + 256 * 1024 / 25e9))
    assert f"predicted link time per step: {plan.link_seconds * 1e3:.2f} ms at 25 GB/s and 10 us" in plan.summary()
    slow = make_plan(model, LMSConfig(knobs=base.replace(link_bandwidth="1GB/s", link_latency=1e-3)))
    assert slow.swaps == plan.swaps  # the link options change predictions, not the plan
    assert slow.link_seconds == pytest.approx(transfers * (1e-3 + 256 * 1024 / 1e9))
    assert SwapPlan.from_json(slow.to_json()).link_seconds == slow.link_seconds
    # A plan saved before the link options existed is read with their defaults.
    data = json.loads(plan.to_json())
    del data["options"]["link_bandwidth"], data["options"]["link_latency"]
    assert SwapPlan.from_dict(data).link_seconds == pytest.approx(plan.link_seconds)


def test_trigger_falls_back_below_an_empty_window():
    # The consumer's only recent input comes from a forward op; the nearest backward
    # ancestor lies below the window and is used rather than no trigger.
    ops = [op("x", "Placeholder", outputs=[f32(64, 64)]), op("a", "Relu", ["x:0"], [f32(64, 64)])]
    prev = relu_chain(ops, "a:0", "f", 8, f32(2, 2))
    ops.append(op("gradient_tape/g0", "Mul", [prev], [f32(2, 2)]))  # level 10
    prev = "gradient_tape/g0:0"
    for i in range(6):  # forward-phase side chain f7 -> s0..s5, levels 10..15
        ops.append(op(f"s{i}", "Relu", ["f7:0" if i == 0 else f"s{i - 1}:0"], [f32(2, 2)]))
    ops.append(op("gradient_tape/g1", "Mul", ["s5:0", "a:0", prev], [f32(2, 2)]))  # level 16
    m = GraphModel.from_ops(ops)
    plan = make_plan(m, LMSConfig(knobs=Knobs(swapout_threshold=5, swapin_ahead=2, min_bytes=0)))
    (swap,) = [s for s in plan.swaps if s.tensor == "a:0"]
    assert swap.swap_ins[0].consumers == (("gradient_tape/g1", 1),)
    assert swap.swap_ins[0].trigger == "gradient_tape/g0"


def test_plan_is_really_frozen_hashable_and_round_trips():
    import pickle

    plan = make_plan(chain_model(n_fwd=6), LMSConfig(knobs=NOFILTER.replace(swapout_threshold=6, swapin_ahead=1)))
    assert plan.swaps
    with pytest.raises(TypeError):
        plan.options["budget"] = 1  # read-only view
    again = SwapPlan.from_json(plan.to_json())
    assert again == plan and hash(again) == hash(plan) and len({plan, again}) == 1
    assert pickle.loads(pickle.dumps(plan)) == plan


# ------------------------------------------------------------- only swaps that free something
def _with_far_reader(forward_ops, tensor, shape=(64, 64)):
    """``forward_ops``, then a backward chain long enough that ``tensor``'s reader is far."""
    ops = list(forward_ops)
    prev = forward_ops[-1]["name"] + ":0"
    for i in range(6):
        ops.append(op(f"gradient_tape/g{i}", "Relu", [prev], [f32(2, 2)]))
        prev = f"gradient_tape/g{i}:0"
    ops.append(op("gradient_tape/use", "Mul", [prev, tensor], [f32(*shape)]))
    return GraphModel.from_ops(ops)


def test_views_of_weights_inputs_and_constants_are_never_swapped():
    # A Reshape of a variable read, of the step's input, of a constant: the buffer stays
    # on the device (the variable, the caller's input, the constant), so a swap frees
    # nothing and its swap-in would add a second copy.
    for source_type in ("Placeholder", "Const", "_Arg"):
        ops = [
            op("w", source_type, outputs=[f32(64, 64)]),
            op("view", "Reshape", ["w:0"], [f32(64, 64)]),
            op("f", "Relu", ["view:0"], [f32(2, 2)]),
        ]
        assert (
            make_plan(_with_far_reader(ops, "view:0"), LMSConfig(knobs=NOFILTER.replace(swapout_threshold=2))).swaps
            == ()
        )
    ops = [
        op("w", "Placeholder", outputs=[("resource", (), 0, False)]),
        op("read", "ReadVariableOp", ["w:0"], [f32(64, 64)]),
        op("kernel", "Reshape", ["read:0"], [f32(64, 64)]),
        op("f", "Relu", ["kernel:0"], [f32(2, 2)]),
    ]
    assert (
        make_plan(_with_far_reader(ops, "kernel:0"), LMSConfig(knobs=NOFILTER.replace(swapout_threshold=2))).swaps == ()
    )
    # A view of an activation is swapped as before.
    ops = [
        op("x", "Placeholder", outputs=[f32(64, 64)]),
        op("a", "Relu", ["x:0"], [f32(64, 64)]),
        op("view", "Reshape", ["a:0"], [f32(64, 64)]),
        op("f", "Relu", ["view:0"], [f32(2, 2)]),
    ]
    plan = make_plan(_with_far_reader(ops, "view:0"), LMSConfig(knobs=NOFILTER.replace(swapout_threshold=2)))
    assert [s.tensor for s in plan.swaps] == ["view:0"]


def _shape_graph(dims=(64, 64), use_data=True, late=True):
    """``a``, read far away by a Shape op and, if ``use_data``, by a Mul. The Shape op waits
    for ``gradient_tape/g4`` if ``late``, else only for the last forward op ``f3``."""
    t = ("float32", dims, 4 * 64 * 64, None in dims)
    ops = [op("x", "Placeholder", outputs=[t]), op("a", "Relu", ["x:0"], [t])]
    prev = relu_chain(ops, "a:0", "f", 4, f32(2, 2))
    for i in range(6):
        ops.append(op(f"gradient_tape/g{i}", "Relu", [prev], [f32(2, 2)]))
        prev = f"gradient_tape/g{i}:0"
    after = ["gradient_tape/g4"] if late else ["f3"]
    ops.append(op("gradient_tape/shape", "Shape", ["a:0"], [("int32", (2,), 8, False)], control=after))
    if use_data:
        ops.append(op("gradient_tape/use", "Mul", [prev, "a:0"], [t]))
    ops.append(op("gradient_tape/end", "Reshape", [prev, "gradient_tape/shape:0"], [f32(2, 2)]))
    return GraphModel.from_ops(ops)


def test_shape_readers_need_no_swap_in():
    cfg = LMSConfig(knobs=NOFILTER.replace(swapout_threshold=2))
    data_readers = lambda plan: [c for s in plan.swaps for si in s.swap_ins for c, _ in si.consumers]  # noqa: E731
    # Shape readers keep reading the device copy; only the data reader gets a swap-in.
    # (A static shape is folded into a constant by Grappler.)
    assert data_readers(make_plan(_shape_graph(), cfg)) == ["gradient_tape/use"]
    # An unknown dimension, but the Shape op runs in the forward pass: it does not hold
    # the device copy for long, so the swap stays.
    assert data_readers(make_plan(_shape_graph(dims=(None, 64), late=False), cfg)) == ["gradient_tape/use"]
    # Only a shape reader far away: nothing to bring back, so nothing to swap.
    assert make_plan(_shape_graph(use_data=False), cfg).swaps == ()
    # An unknown dimension and a Shape op that waits for the backward pass: it would keep
    # the device copy alive until then, so swapping frees nothing.
    assert make_plan(_shape_graph(dims=(None, 64)), cfg).swaps == ()


def test_min_bytes_leaves_out_tensors_too_small_for_a_transfer():
    from tflms.config import LINK_BANDWIDTH, LINK_LATENCY, MIN_BYTES

    # The default is the size whose transfer time equals the fixed cost of a transfer.
    assert LMSConfig().knobs.min_bytes == MIN_BYTES == 256 * 1024
    assert 0.9 < MIN_BYTES / (LINK_BANDWIDTH * LINK_LATENCY) < 1.1
    small = chain_model(n_fwd=8, size=(8, 64))  # 2 KiB activations
    bn_like = chain_model(n_fwd=8, size=(1, 2048))  # 8 KiB, a ResNet50 [1, 1, 1, 2048] BatchNorm tensor
    below = chain_model(n_fwd=8, size=(256, 255))  # 1 KiB under 256 KiB
    large = chain_model(n_fwd=8, size=(256, 256))  # 256 KiB activations
    for model in (small, bn_like, below):
        assert make_plan(model, LMSConfig(knobs=Knobs(swapout_threshold=2))).swaps == ()
    assert len(make_plan(large, LMSConfig(knobs=Knobs(swapout_threshold=2))).swaps) > 0
    assert make_plan(large, LMSConfig(knobs=Knobs(swapout_threshold=2, min_bytes=256 * 1024 + 1))).swaps == ()
    assert len(make_plan(small, LMSConfig(knobs=Knobs(swapout_threshold=2, min_bytes=0))).swaps) > 0


def test_swap_gradients_adds_backward_tensors_that_wait_across_a_branch():
    """A residual block's backward pass: the gradient ``g`` reaching the block feeds its main
    branch (eight ops) and, at the shortcut, the ``AddN`` after it. With ``swap_gradients``
    ``g`` is swapped (freed during the main branch, back before the ``AddN``) and the
    requested bytes at the peak drop by ``g``'s; without it only forward tensors are candidates."""
    big = f32(64, 64)
    ops = [op("x", "Placeholder", outputs=[big]), op("loss", "Sum", ["x:0"], [f32(1)])]
    ops.append(op("gradient_tape/g", "ReluGrad", ["loss:0", "x:0"], [big]))
    prev = "gradient_tape/g:0"
    for i in range(8):  # the main branch: each op's output is twice the size, then halved back
        ops.append(op(f"gradient_tape/main{i}", "Mul", [prev, "x:0"], [f32(64, 128) if i % 2 == 0 else big]))
        prev = f"gradient_tape/main{i}:0"
    ops.append(op("gradient_tape/addn", "AddN", [prev, "gradient_tape/g:0"], [big]))
    ops.append(op("update", "AssignSubVariableOp", ["gradient_tape/addn:0"], []))
    m = GraphModel.from_ops(ops, name="residual_backward")
    options = {"policy": "none", "knobs": NOFILTER.replace(swapout_threshold=4, swapin_ahead=1, serialize=False)}
    assert make_plan(m, LMSConfig(**options)).swaps == ()
    plan = make_plan(m, LMSConfig(**{**options, "policy": "swap_gradients"}))
    (swap,) = plan.swaps
    assert swap.tensor == "gradient_tape/g:0" and swap.swap_ins[0].consumers == (("gradient_tape/addn", 1),)
    assert swap.swap_ins[0].trigger.startswith("gradient_tape/main")
    sim = Simulator(m)
    assert sim.requested_peak(plan.swaps) == sim.requested_peak() - swap.bytes
    assert "swap_gradients" in plan.options["policy"]
