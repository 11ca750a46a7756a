"""The timeline (tflms.emulate.timeline), op costs and profiles (tflms.emulate.costs) on hand-built graphs."""

import json

import pytest

from tflms import Knobs, LMSConfig, make_plan
from tflms.emulate.costs import DeviceRates, OpProfile, estimate_seconds, flops, op_seconds
from tflms.emulate.timeline import Link, timeline
from tflms.ir.decisions import Fence, Swap, SwapIn
from tflms.ir.graph import GraphModel
from tflms.plan.timing import plan_timeline, timed_triggers

from graphs import chain_model, f32, op

pytestmark = pytest.mark.unit

MB = 10**6
LINK = Link(to_host=1e9, to_device=1e9, latency=0.0)  # 1 MB moves in 1 ms


def _line(*names_and_times):
    """A chain of Relu ops of 1 MB each: name i reads name i-1; the last op reads every op in ``reads``."""
    ops, times, prev = [], {}, []
    for name, seconds in names_and_times:
        ops.append(op(name, "Relu", prev, [("float32", (250, 1000), MB, False)]))
        times[name] = seconds
        prev = [f"{name}:0"]
    return ops, times


def _model(compute_between: float, n_between: int = 4, second_reader: bool = False):
    """p -> m0..m{n-1} -> gradient_tape/use(m_last, p[, q]): p's reuse is ``compute_between`` seconds of
    compute after it (split over the m ops); with ``second_reader``, q (1 MB) is made right after p
    and read by the same op."""
    big = ("float32", (250, 1000), MB, False)
    ops = [op("p", "Relu", [], [big])]
    times = {"p": 1e-3}
    prev = "p:0"
    if second_reader:
        ops.append(op("q", "Relu", ["p:0"], [big]))
        times["q"] = 0.0
    for i in range(n_between):
        ops.append(op(f"m{i}", "Relu", [prev], [big]))
        times[f"m{i}"] = compute_between / n_between
        prev = f"m{i}:0"
    reads = [prev, "p:0"] + (["q:0"] if second_reader else [])
    ops.append(op("gradient_tape/use", "AddN", reads, [big]))
    times["gradient_tape/use"] = 1e-3
    return GraphModel.from_ops(ops), times


def _swap(tensor, consumer, index, trigger=None, level=0, nbytes=MB):
    return Swap(
        tensor,
        tensor.split(":")[0],
        "Relu",
        "float32",
        (250, 1000),
        nbytes,
        0,
        3,
        (SwapIn(((consumer, index),), trigger, level, None),),
    )


def test_a_plain_step_takes_the_sum_of_its_op_times():
    model, times = _model(4e-3)
    tl = timeline(model, times)
    assert tl.step_seconds == pytest.approx(sum(times.values()))
    assert tl.stall_seconds == 0 and tl.transfers == ()
    assert tl.start["gradient_tape/use"] == pytest.approx(5e-3)


def test_a_swap_whose_transfers_fit_between_producer_and_reuse_costs_nothing():
    model, times = _model(compute_between=4e-3)  # the round trip takes 2 ms
    plain = timeline(model, times)
    swapped = timeline(model, times, [_swap("p:0", "gradient_tape/use", 1)], LINK)
    assert swapped.step_seconds == pytest.approx(plain.step_seconds)
    assert swapped.stall_seconds == 0
    assert swapped.landed("p:0", None) == pytest.approx(2e-3)  # p ends at 1 ms, 1 ms to the host
    assert swapped.landed("p:0", 0) == pytest.approx(3e-3)  # no trigger: back as soon as it has left
    assert swapped.landed("p:0", 0) <= swapped.start["gradient_tape/use"]


def test_a_swap_that_does_not_fit_stalls_the_consumer_by_the_difference():
    model, times = _model(compute_between=0.5e-3)  # 2 ms of transfers, 0.5 ms of compute to hide them
    plain = timeline(model, times)
    swapped = timeline(model, times, [_swap("p:0", "gradient_tape/use", 1)], LINK)
    assert swapped.stall_seconds == pytest.approx(1.5e-3)
    assert swapped.stall == {"gradient_tape/use": pytest.approx(1.5e-3)}
    assert swapped.step_seconds == pytest.approx(plain.step_seconds + 1.5e-3)


def test_a_late_trigger_makes_the_swap_in_wait_for_it():
    model, times = _model(compute_between=4e-3)
    swapped = timeline(model, times, [_swap("p:0", "gradient_tape/use", 1, trigger="m3")], LINK)
    # m3 ends at 5 ms; the swap-in then takes 1 ms, and the consumer waits 1 ms.
    assert swapped.landed("p:0", 0) == pytest.approx(6e-3)
    assert swapped.stall_seconds == pytest.approx(1e-3)


def test_two_transfers_in_one_direction_serialise_and_the_directions_overlap():
    model, times = _model(compute_between=0.0, n_between=1, second_reader=True)
    swaps = [_swap("p:0", "gradient_tape/use", 1), _swap("q:0", "gradient_tape/use", 2)]
    tl = timeline(model, times, swaps, LINK)
    outs = [t for t in tl.transfers if t.swap_in is None]
    ins = [t for t in tl.transfers if t.swap_in is not None]
    # p ends at 1 ms, q at 1 ms too (no compute): q's swap-out waits for p's on the one engine.
    assert [(t.start, t.end) for t in outs] == [pytest.approx((1e-3, 2e-3)), pytest.approx((2e-3, 3e-3))]
    # p's swap-in (2-3 ms) runs while q's swap-out does: one engine per direction.
    assert [(t.tensor, t.start, t.end) for t in ins] == [
        ("p:0", pytest.approx(2e-3), pytest.approx(3e-3)),
        ("q:0", pytest.approx(3e-3), pytest.approx(4e-3)),
    ]
    assert tl.start["gradient_tape/use"] == pytest.approx(4e-3)


def test_latency_is_paid_per_transfer():
    model, times = _model(compute_between=0.0, n_between=1)
    tl = timeline(model, times, [_swap("p:0", "gradient_tape/use", 1)], Link(1e9, 1e9, latency=1e-3))
    assert tl.landed("p:0", 0) == pytest.approx(1e-3 + 2 * 2e-3)


def test_a_fence_holds_its_op_until_the_swap_out_has_landed():
    model, times = _model(compute_between=4e-3)
    tl = timeline(model, times, [_swap("p:0", "gradient_tape/use", 1)], LINK, fences=[Fence("p:0", "m0")])
    assert tl.start["m0"] == pytest.approx(2e-3) and tl.stall["m0"] == pytest.approx(1e-3)


def test_bad_inputs_name_the_argument():
    model, times = _model(1e-3)
    with pytest.raises(ValueError, match="seconds must give every op"):
        timeline(model, {"p": 1.0})
    with pytest.raises(ValueError, match="needs a link"):
        timeline(model, times, [_swap("p:0", "gradient_tape/use", 1)])
    with pytest.raises(ValueError, match="to_device must be bytes per second > 0. Received: to_device=-1"):
        Link(1e9, -1)


def test_flop_counts_of_convolutions_and_matrix_products():
    big = f32(8, 16, 16, 32)
    model = GraphModel.from_ops(
        [
            op("x", "Placeholder", outputs=[f32(8, 16, 16, 16)]),
            op("w", "Placeholder", outputs=[f32(3, 3, 16, 32)]),
            op("c", "Conv2D", ["x:0", "w:0"], [big]),
            op("s", "Placeholder", outputs=[("int32", (4,), 16, False)]),
            op("gradient_tape/di", "Conv2DBackpropInput", ["s:0", "w:0", "c:0"], [f32(8, 16, 16, 16)]),
            op("gradient_tape/dw", "Conv2DBackpropFilter", ["x:0", "s:0", "c:0"], [f32(3, 3, 16, 32)]),
            op("a", "Placeholder", outputs=[f32(4, 64, 32)]),
            op("b", "Placeholder", outputs=[f32(4, 32, 128)]),
            op("bmm", "BatchMatMulV2", ["a:0", "b:0"], [f32(4, 64, 128)]),
            op("r", "Relu", ["c:0"], [big]),
        ]
    )
    conv = 2 * (8 * 16 * 16 * 32) * (3 * 3 * 16)
    assert flops(model, "c") == flops(model, "gradient_tape/di") == flops(model, "gradient_tape/dw") == conv
    assert flops(model, "bmm") == 2 * 4 * 64 * 128 * 32
    assert flops(model, "r") is None and flops(model, "x") is None
    rates = DeviceRates(flops=1e12, bandwidth=1e11, overhead=1e-6)
    assert estimate_seconds(model, "c", rates) == pytest.approx(1e-6 + conv / 1e12)
    relu_bytes = 2 * 8 * 16 * 16 * 32 * 4  # reads and writes the tensor: memory-bound
    assert estimate_seconds(model, "r", rates) == pytest.approx(1e-6 + relu_bytes / 1e11)
    assert estimate_seconds(model, "x", rates) == 0.0


def test_profile_json_round_trip_and_fallback(tmp_path):
    model = chain_model(n_fwd=3)
    profile = OpProfile({"f0": ("Relu", 2e-3), "gradient_tape/b1": ("ReluGrad", 3e-3)}, device="/device:GPU:0",
                        device_name="test", function="chain", steps=2)  # fmt: skip
    path = profile.save(tmp_path / "sub" / "profile.json")
    data = json.loads(path.read_text())
    assert data["format"] == "tflms-op-profile" and data["ops"]["f0"] == {"type": "Relu", "seconds": 2e-3}
    loaded = OpProfile.load(path)
    assert loaded == profile
    rates = DeviceRates()
    times = op_seconds(model, loaded, rates)
    assert times["f0"] == 2e-3 and times["gradient_tape/b1"] == 3e-3
    assert times["f1"] == estimate_seconds(model, "f1", rates) > 0  # not profiled: estimated
    assert times["x"] == 0.0  # a Placeholder takes no time
    with pytest.raises(ValueError, match="not an op profile"):
        OpProfile.from_dict({"format": "something-else"})
    with pytest.raises(FileNotFoundError, match="op_profile="):
        OpProfile.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="seconds >= 0"):
        OpProfile({"a": ("Relu", -1.0)})


def test_profile_from_kernel_records_takes_the_median_over_steps():
    run = lambda t: [{"op": "a", "type": "Relu", "duration_ns": t}, {"op": "a", "type": "Relu", "duration_ns": 1}]  # noqa: E731
    profile = OpProfile.from_kernels([run(10), run(30), run(1000)])
    assert profile.seconds("a") == pytest.approx(31e-9) and profile.steps == 3 and profile.seconds("b") is None


def test_timed_triggers_bring_a_swap_in_back_just_in_time():
    model = chain_model(n_fwd=10)
    knobs = Knobs(min_bytes=0, swapout_threshold=4, swapin_ahead=1, serialize=False, link_bandwidth=4096 * 1000)
    config = LMSConfig(knobs=knobs.replace(link_latency=0.0))
    times = {n: 1e-4 for n in model.dag}
    profile = OpProfile({n: (model.dag.nodes[n]["type"], s) for n, s in times.items()})
    from tflms.emulate.timeline import TimelineModel

    timed = TimelineModel(model, op_seconds(model, profile))
    swaps = make_plan(model, config).swaps
    assert swaps
    retimed = timed_triggers(model, swaps, config, timed)
    plain = timed.run()
    link = Link(4096 * 1000, 4096 * 1000, 0.0)  # a 4 KiB activation takes 1 ms: ten ops' compute
    for before, after in zip(swaps, retimed):
        (si,), (ti,) = before.swap_ins, after.swap_ins
        consumer = si.consumers[0][0]
        need = plain.start[consumer] - 1e-3
        # The op that ends last by then, or where none does, the first backward op (the earliest one).
        ends_by = [n for n in model.dag if n.startswith("gradient_tape/") and plain.end[n] <= need + 1e-12]
        expected = max(ends_by, key=plain.end.__getitem__) if ends_by else "gradient_tape/b9"
        assert ti.trigger == expected, (consumer, ti.trigger, expected)
        assert ti.trigger_level <= si.trigger_level  # earlier than one level ahead
    assert timed.run(retimed, link).stall_seconds < timed.run(swaps, link).stall_seconds


def _spiked_chain():
    """f0..f7 (1 MB each) -> f8 (3 MB) -> g0 -> g1 -> spike (5 MB, read by no backward op) -> shrink
    -> loss, then the backward chain start, b8..b0, b_i reading f_i. The peak is at the spike."""
    ops = [op("x", "Placeholder", outputs=[f32(1, 1000)])]
    prev = "x:0"
    for i, rows in enumerate([250] * 8 + [750]):
        ops.append(op(f"f{i}", "Relu", [prev], [f32(rows, 1000)]))
        prev = f"f{i}:0"
    for name, rows in (("g0", 1), ("g1", 1), ("spike", 1250), ("shrink", 1)):
        ops.append(op(name, "Relu", [prev], [f32(rows, 1000)]))
        prev = f"{name}:0"
    ops.append(op("loss", "Sum", [prev], [f32(1, 1000)]))
    ops.append(op("gradient_tape/start", "OnesLike", ["loss:0"], [f32(1, 1000)]))
    grad = "gradient_tape/start:0"
    for i in reversed(range(9)):
        ops.append(op(f"gradient_tape/b{i}", "ReluGrad", [grad, f"f{i}:0"], [f32(1, 1000)]))
        grad = f"gradient_tape/b{i}:0"
    ops.append(op("update", "AssignSubVariableOp", [grad], []))
    return GraphModel.from_ops(ops, name="spiked_chain")


def test_the_budget_search_minimises_predicted_step_time_not_bytes_moved(tmp_path):
    """f8 (3 MB) is read again six levels after it is made, with 0.5 ms of compute between; f0..f7
    (1 MB each) later, with milliseconds of compute between. Swapping f8 alone fits the budget and
    moves the fewest bytes (the old objective's choice, least link time), but its transfers take
    6 ms; the plan of a threshold that leaves f8 alone swaps early tensors, whose transfers the
    forward and backward passes hide: it is the faster one, and the one chosen."""
    model = _spiked_chain()
    kinds = model.dag.nodes
    slow = {f"f{i}" for i in range(9)} | {f"gradient_tape/b{i}" for i in range(9)}
    times = {n: 1e-3 if n in slow else 1e-4 if kinds[n]["type"] in ("Relu", "Sum") else 0.0 for n in model.dag}
    path = OpProfile({n: (kinds[n]["type"], s) for n, s in times.items()}).save(tmp_path / "p.json")
    base = dict(knobs=Knobs(min_bytes=0, serialize=False, op_profile=str(path), link_bandwidth=10**9, link_latency=0.0))
    from tflms import Simulator
    from tflms.plan.candidates import candidate_swaps
    from tflms.plan.records import link_seconds
    from tflms.plan.timing import timeline_model

    sim = Simulator(model)
    plain = sim.peak()
    everything = candidate_swaps(
        model, LMSConfig(**base).with_knobs(swapout_threshold=0, swapin_ahead=1, swapin_groupby=0)
    )
    assert everything[0].tensor == "f8:0"
    early = candidate_swaps(model, LMSConfig(**base).with_knobs(swapout_threshold=10, swapin_ahead=1, swapin_groupby=0))
    assert [s.tensor for s in early[:3]] == ["f0:0", "f1:0", "f2:0"]
    budget = sim.peak(early[:3])  # what swapping f0, f1 and f2 gives
    assert sim.peak(everything[:1]) <= budget < plain  # swapping f8 alone fits too
    plan = make_plan(model, LMSConfig(budget=budget, **base))
    assert plan.peak_bytes_after <= budget
    assert "f8:0" not in {s.tensor for s in plan.swaps}
    assert plan.link_seconds >= link_seconds(everything[:1], 1e9, 0.0)  # as many bytes moved as f8 alone, in more swaps
    timed = timeline_model(model, LMSConfig(**base))
    f8_alone = timed.run(everything[:1], Link(1e9, 1e9, 0.0)).step_seconds
    chosen = plan_timeline(plan, model).step_seconds
    assert chosen < f8_alone


def test_two_compute_streams_run_independent_branches_side_by_side():
    big = ("float32", (250, 1000), MB, False)
    model = GraphModel.from_ops(
        [op("a", "Relu", [], [big]), op("b", "Relu", [], [big]), op("c", "AddN", ["a:0", "b:0"], [big])]
    )
    times = {"a": 2e-3, "b": 2e-3, "c": 1e-3}
    assert timeline(model, times).step_seconds == pytest.approx(5e-3)
    two = timeline(model, times, streams=2)
    assert two.step_seconds == pytest.approx(3e-3) and two.start["c"] == pytest.approx(2e-3)
    with pytest.raises(ValueError, match="streams must be an integer >= 1. Received: streams=0"):
        timeline(model, times, streams=0)


def test_a_plan_gives_its_timeline_and_a_loaded_one_needs_the_model():
    from tflms import SwapPlan

    model = chain_model(n_fwd=8)
    plan = make_plan(model, LMSConfig(knobs=Knobs(min_bytes=0, swapout_threshold=2, serialize=False)))
    assert plan.swaps
    tl = plan_timeline(plan)
    assert tl.step_seconds >= tl.compute_seconds > 0
    assert {(t.tensor, t.swap_in) for t in tl.transfers} == {(s.tensor, None) for s in plan.swaps} | {
        (s.tensor, k) for s in plan.swaps for k in range(len(s.swap_ins))
    }
    loaded = SwapPlan.from_json(plan.to_json())
    with pytest.raises(ValueError, match="Received: model=None"):
        plan_timeline(loaded)
    assert plan_timeline(loaded, model).step_seconds == tl.step_seconds
