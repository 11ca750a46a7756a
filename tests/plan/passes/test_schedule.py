"""The memory-aware schedule (``serialize``) on hand-built graphs."""

import json

import pytest

from tflms import Knobs, LMSConfig, Order, SwapPlan, make_plan
from tflms.emulate.simulator import Simulator
from tflms.ir.graph import GraphModel
from tflms.plan.passes.schedule import memory_orders

from graphs import f32, op

pytestmark = pytest.mark.unit

G = "gradient_tape/"


def fork_ops(b1_type="Mul"):
    """A forward chain x -> f0 -> f1 -> f2 -> loss, then a backward pass whose gradient dy feeds two
    branches with big temporaries a1 and b1. The executor's depth-first order runs b1 while a1
    waits for the small c, so both are live at once; the last backward op reads f0."""
    big = f32(64, 256)
    ops = [op("x", "Placeholder", outputs=[f32(8, 128)])]
    prev = "x:0"
    for i in range(3):
        ops.append(op(f"f{i}", "Relu", [prev], [f32(8, 128)]))
        prev = f"f{i}:0"
    ops += [
        op("loss", "Sum", [prev], [f32(8, 128)]),
        op(G + "dy", "ReluGrad", ["loss:0", "f2:0"], [f32(8, 128)]),
        op(G + "a1", "Mul", [G + "dy:0"], [big]),
        op(G + "a3", "Neg", [G + "a2:0"], [f32(8, 128)]),
        op(G + "b1", b1_type, [G + "dy:0"], [big]),
        op(G + "c", "Neg", [G + "dy:0"], [f32(1)]),
        op(G + "a2", "Sum", [G + "a1:0", G + "c:0"], [f32(8, 128)]),
    ]
    if b1_type == "Mul":
        ops += [
            op(G + "b2", "Sum", [G + "b1:0"], [f32(8, 128)]),
            op(G + "g1", "ReluGrad", [G + "a3:0", "f1:0"], [f32(8, 128)]),
            op(G + "g0", "ReluGrad", [G + "g1:0", "f0:0"], [f32(8, 128)]),
            op(G + "out", "AddV2", [G + "g0:0", G + "b2:0"], [f32(8, 128)]),
            op("update", "AssignSubVariableOp", [G + "out:0"], []),
        ]
    else:  # b1 is a weight gradient: the optimizer's IdentityN, then the update
        ops += [
            op(G + "g1", "ReluGrad", [G + "a3:0", "f1:0"], [f32(8, 128)]),
            op(G + "g0", "ReluGrad", [G + "g1:0", "f0:0"], [f32(8, 128)]),
            op("IdentityN", "IdentityN", [G + "g0:0", G + "b1:0"], [f32(8, 128), big]),
            op("update", "ResourceApplyAdam", ["IdentityN:0"], []),
            op("update_1", "ResourceApplyAdam", ["IdentityN:1"], []),
        ]
    return ops


def test_memory_orders_make_one_branch_wait_for_the_other():
    model = GraphModel.from_ops(fork_ops())
    sim = Simulator(model)
    assert sim.order.index(G + "b1") < sim.order.index(G + "a2")  # side by side: a1 and b1 both live
    orders, ordered = memory_orders(model)
    assert orders == (Order(op=G + "b1", after=G + "a2"),)
    assert ordered.dag.edges[G + "a2", G + "b1"]["control"]
    after = Simulator(ordered)
    assert after.order.index(G + "b1") > after.order.index(G + "a2")
    big = 64 * 256 * 4
    assert sim.requested_peak() - after.requested_peak() == big  # one temporary fewer at the peak
    assert memory_orders(model)[0] == orders  # deterministic


def test_the_searchs_simulator_of_an_ordered_step_agrees_with_building_that_step():
    """``memory_orders`` tries each candidate with ``Simulator._ordered_requested_peak`` and
    moves on with ``Simulator._ordered`` (no new push-down pass, no levels): the same order,
    peaks and push-downs as a simulator of ``with_orders(model, orders)``."""
    from tflms.ir.graph import with_orders

    # A constant push-down in the backward pass (Grappler's C * (dy * f2) -> dy * (C * f2)).
    ops = fork_ops() + [
        op("k", "Const", [], [f32()]),
        op(G + "p1", "Mul", [G + "dy:0", "f2:0"], [f32(8, 128)]),
        op(G + "p2", "Mul", [G + "p1:0", "k:0"], [f32(8, 128)]),
        op(G + "p3", "Sum", [G + "p2:0"], [f32(1)]),
    ]
    model = GraphModel.from_ops(ops)
    orders = (Order(op=G + "b1", after=G + "a2"),)
    sim = Simulator(model)
    slow, fast = Simulator(with_orders(model, orders)), sim._ordered(orders)  # noqa: SLF001
    assert sim.pushdowns == slow.pushdowns == fast.pushdowns == [(G + "p2", G + "p1")]
    assert fast.order == slow.order != sim.order
    assert set(fast.executed.dag.edges) == set(slow.executed.dag.edges)
    assert (fast.requested_peak(), fast.peak()) == (slow.requested_peak(), slow.peak())
    assert sim._ordered_requested_peak(orders) == slow.requested_peak() < sim.requested_peak()  # noqa: SLF001
    more = (Order(op=G + "a3", after=G + "b2"),)  # orders on orders
    assert fast._ordered(more).order == Simulator(with_orders(model, orders + more)).order  # noqa: SLF001


def test_weight_gradients_and_forward_ops_are_never_ordered():
    # Delaying a weight gradient lowers only the prediction (the simulator holds weight
    # gradients until the IdentityN has them all; the executor does not).
    weight_grad = GraphModel.from_ops(fork_ops(b1_type="Conv2DBackpropFilter"))
    assert memory_orders(weight_grad)[0] == ()
    # The same fork outside the gradient scope is forward: not ordered either.
    forward = [{**o, "name": o["name"].replace(G, "fwd_")} for o in fork_ops()]
    for o in forward:
        o["inputs"] = [t.replace(G, "fwd_") for t in o["inputs"]]
    assert memory_orders(GraphModel.from_ops(forward))[0] == ()


def test_make_plan_with_serialize_adds_orders_to_the_same_swaps():
    model = GraphModel.from_ops(fork_ops())
    options = {"knobs": Knobs(swapout_threshold=2, swapin_ahead=1, min_bytes=0)}
    plain = make_plan(model, LMSConfig(**options).with_knobs(serialize=False))
    plan = make_plan(model, LMSConfig(**options))  # serialize=True is the default
    assert LMSConfig().knobs.serialize is True
    assert plain.orders == () and plain.swaps and plan.swaps == plain.swaps
    assert plan.orders == (Order(op=G + "b1", after=G + "a2"),)
    assert plan.peak_bytes_after < plain.peak_bytes_after
    assert "memory-aware schedule: 1 ordering edge (an op waits for another" in plan.summary()
    data = json.loads(plan.to_json())
    assert data["orders"] == [{"op": G + "b1", "after": G + "a2"}]
    assert SwapPlan.from_json(plan.to_json()) == plan
    with pytest.raises(ValueError, match=r"serialize must be True or False. Received: serialize='yes'"):
        LMSConfig(knobs=Knobs(serialize="yes"))


def test_orders_alone_are_the_plan_where_no_tensor_qualifies_for_a_swap():
    model = GraphModel.from_ops(fork_ops())
    options = {"knobs": Knobs(swapout_threshold=10**6, min_bytes=0)}  # no backward consumer is that far: no swap
    plan = make_plan(model, LMSConfig(**options))
    assert plan.swaps == () and plan.orders == (Order(op=G + "b1", after=G + "a2"),)
    assert plan.peak_bytes_after < plan.peak_bytes_before and not plan.reason
    empty = make_plan(model, LMSConfig(**options).with_knobs(serialize=False))
    assert empty.swaps == empty.orders == () and "no tensor qualifies" in empty.reason


def test_a_budget_met_only_with_orders_gets_them_from_the_autotuner():
    """With ``serialize=True`` and a budget that no plan meets unordered, the autotuner orders
    the step for its lowest plan and tunes again on the ordered step (``tune_ordered``)."""
    from tflms.errors import BudgetError
    from tflms.ir.graph import with_orders
    from tflms.plan.autotune import tune_ordered

    model = GraphModel.from_ops(fork_ops())
    order = Order(op=G + "b1", after=G + "a2")
    ordered_peak = Simulator(with_orders(model, [order])).peak()
    assert ordered_peak < Simulator(model).peak()
    budget = ordered_peak + 1024  # above the ordered step's peak, below every unordered plan's
    with pytest.raises(BudgetError, match=r"Received: budget=") as unordered:
        make_plan(model, LMSConfig(knobs=Knobs(min_bytes=0, serialize=False), budget=budget))
    assert unordered.value.best_peak_bytes > budget
    config, orders, ordered = tune_ordered(model, LMSConfig(knobs=Knobs(min_bytes=0, serialize=True), budget=budget))
    assert orders == (order,) and config.knobs.n_tensors == 0 and ordered.model.dag.has_edge(G + "a2", G + "b1")
    assert ordered.peak() == ordered_peak
    plan = make_plan(model, LMSConfig(knobs=Knobs(min_bytes=0, serialize=True), budget=budget))
    assert plan.orders == (order,) and plan.swaps == ()  # the orders alone are the plan, not an empty plan
    assert plan.peak_bytes_after == ordered_peak <= budget < plan.peak_bytes_before
    assert SwapPlan.from_json(plan.to_json()) == plan
    # Below what the ordered step can reach, the error reports the lowest peak with orders.
    with pytest.raises(BudgetError) as lowest:
        make_plan(model, LMSConfig(knobs=Knobs(min_bytes=0, serialize=True), budget=ordered_peak // 2))
    assert lowest.value.best_peak_bytes < unordered.value.best_peak_bytes


def _two_forks():
    """Two forks like fork_ops' one after the other, the second fed by the first's output: two
    positions of the same peak (a plateau), so ordering either fork alone lowers nothing."""
    big, small = f32(64, 256), f32(8, 128)
    ops = [op("x", "Placeholder", outputs=[small]), op("loss", "Sum", ["x:0"], [small])]
    grad = "loss:0"
    for k in ("p", "q"):
        ops += [
            op(G + k + "dy", "Neg", [grad], [small]),
            op(G + k + "a1", "Mul", [G + k + "dy:0"], [big]),
            op(G + k + "a3", "Neg", [G + k + "a2:0"], [small]),
            op(G + k + "b1", "Mul", [G + k + "dy:0"], [big]),
            op(G + k + "c", "Neg", [G + k + "dy:0"], [f32(1)]),
            op(G + k + "a2", "Sum", [G + k + "a1:0", G + k + "c:0"], [small]),
            op(G + k + "b2", "Sum", [G + k + "b1:0"], [small]),
            op(G + k + "out", "AddV2", [G + k + "a3:0", G + k + "b2:0"], [small]),
        ]
        grad = G + k + "out:0"
    ops.append(op("update", "AssignSubVariableOp", [grad], []))
    return GraphModel.from_ops(ops)


def test_a_plateau_is_crossed_by_tentative_rounds(monkeypatch):
    model = _two_forks()
    sim = Simulator(model)
    requested = sim.profile().requested
    big = 64 * 256 * 4
    peaks = [i for i, v in enumerate(requested) if v == requested.max()]
    assert [sim.order[i] for i in peaks] == [G + "pc", G + "qc"]  # both forks' a1 and b1 live at once
    orders, ordered = memory_orders(model)
    assert orders == (Order(op=G + "pb1", after=G + "pa2"), Order(op=G + "qb1", after=G + "qa2"))
    # Before: a1 and b1 of one fork live at once; after: one of them and three small buffers;
    # x, the step's argument, is held by the caller throughout (one more small buffer).
    assert sim.requested_peak() == 2 * big + 3 * 4096 + 4 and Simulator(ordered).requested_peak() == big + 4 * 4096
    # Without look-ahead (one tentative round and no more) the first round pays nothing: no orders.
    monkeypatch.setattr("tflms.plan.passes.schedule.LOOKAHEAD", 1)
    assert memory_orders(model) == ((), model)


def _stem_ops(m1_type="Sum"):
    """DenseNet121's stem in miniature: the forward ``c`` (the stem convolution) is read again by
    ``m1`` (a BatchNorm scale gradient) together with ``g`` (the ReLU gradient). The trigger rule
    (an op on a path into the consumer, ``swapin_ahead`` levels before it) can only pick ``g``,
    so ``c`` arrives while ``p`` (MaxPoolGrad's output, read by ``s``, the padding's gradient) is
    still held; ``m``, which the executor runs between ``g`` and ``m1``, frees ``p`` first. The
    plain step's peak is at ``t``, a backward temporary made while ``c`` waits on the device."""
    big, bigger, small = f32(64, 256), f32(128, 256), f32(8)
    return [
        op("x", "Placeholder", outputs=[small]),
        op("c", "Relu", ["x:0"], [big]),
        op("f", "Sum", ["c:0"], [small]),
        op("loss", "Sum", ["f:0"], [small]),
        op(G + "t", "Tile", ["loss:0"], [f32(224, 256)]),
        op(G + "t1", "Sum", [G + "t:0"], [small]),
        op(G + "t2", "Neg", [G + "t1:0"], [small]),
        op(G + "p", "Tile", [G + "t2:0"], [bigger]),
        op(G + "s", "Slice", [G + "p:0"], [big]),
        op(G + "g", "Neg", [G + "s:0"], [big]),
        op(G + "m", "Mul", [G + "g:0"], [big]),
        op(G + "m1", m1_type, [G + "g:0", "c:0"], [small]),
        op(G + "out", "AddV2", [G + "m:0", G + "m1:0"], [big]),
        op("update", "AssignSubVariableOp", [G + "out:0"], []),
    ]


def test_late_triggers_wait_for_the_op_that_runs_before_the_consumer():
    from tflms.plan.passes.schedule import late_triggers

    model = GraphModel.from_ops(_stem_ops())
    plan = make_plan(model, LMSConfig(knobs=Knobs(min_bytes=0, serialize=False, swapout_threshold=1, swapin_ahead=1)))
    [swap] = plan.swaps
    assert swap.tensor == "c:0" and [si.trigger for si in swap.swap_ins] == [G + "g"]
    sim = Simulator(model)
    order = sim.order
    assert order.index(G + "g") + 1 == order.index(G + "m") == order.index(G + "m1") - 1
    kib = lambda swaps, s=sim: [int(b) // 1024 for b in s.profile(swaps).requested]  # noqa: E731 (32-byte sums left out)
    at = {name: order.index(G + name) for name in ("t", "g", "m", "m1")}
    assert kib(())[at["t"]] == 64 + 224  # plain: c waits on the device while t is made
    # Swapped: at g, p (freed one position after its reader s), g (in place of s) and c's swap-in.
    assert kib(plan.swaps)[at["t"]] == 224 and kib(plan.swaps)[at["g"]] == 128 + 64 + 64
    swaps, orders, late = late_triggers(sim, plan.swaps)
    assert [si.trigger for s in swaps for si in s.swap_ins] == [G + "m"]
    assert orders == (Order(op=G + "m1", after=G + "m"),)
    assert late.model.dag.has_edge(G + "m", G + "m1") and late.order == order
    # c's swap-in now arrives at m, where p is gone: g, m's output and the swap-in.
    assert [kib(swaps, late)[at[k]] for k in ("g", "m", "m1")] == [128 + 64, 3 * 64, 3 * 64]
    assert late.peak(swaps) < sim.peak(plan.swaps) and late.requested_peak_position(swaps)[0] == at["t"]
    assert late_triggers(late, swaps)[1] == ()  # nothing left to move
    # A budget the plan meets already: nothing moves.
    assert late_triggers(sim, plan.swaps, budget=sim.peak(plan.swaps)) == (list(plan.swaps), (), sim)
    # A swap-in that feeds a sum keeps its trigger (an order there could change how Grappler adds).
    summed = GraphModel.from_ops(_stem_ops(m1_type="AddN"))
    summed_plan = make_plan(
        summed, LMSConfig(knobs=Knobs(min_bytes=0, serialize=False, swapout_threshold=1, swapin_ahead=1))
    )
    assert [si.trigger for s in summed_plan.swaps for si in s.swap_ins] == [G + "g"]
    assert late_triggers(Simulator(summed), summed_plan.swaps)[1] == ()


def test_late_triggers_never_join_a_filter_gradient_and_its_bias_gradient(monkeypatch):
    """:func:`_stem_ops` as a convolution's gradients: ``m1`` is the filter gradient (it reads the
    swapped ``c`` and the gradient ``g``) and ``m``, which runs right before it, the bias gradient
    of ``g``. oneDNN runs the two as one kernel unless a path joins them, and then the bias
    gradient's bits change (tests/test_tf_internals.py): ``m`` triggers nothing for ``m1``."""
    from tflms.plan.passes.schedule import _later_trigger, late_triggers

    small = f32(8)
    ops = [op("sizes", "Const", outputs=[f32(4)])] + [o for o in _stem_ops() if o["name"] not in (G + "m", G + "m1")]
    ops += [
        op(G + "m", "BiasAddGrad", [G + "g:0"], [f32(64, 256)]),
        op(G + "m1", "Conv2DBackpropFilter", ["c:0", "sizes:0", G + "g:0"], [small]),
    ]
    model = GraphModel.from_ops(ops)
    plan = make_plan(model, LMSConfig(knobs=Knobs(min_bytes=0, serialize=False, swapout_threshold=1, swapin_ahead=1)))
    [swap] = plan.swaps
    [swap_in] = swap.swap_ins
    sim = Simulator(model)
    order = sim.order
    pos = {o: i for i, o in enumerate(order)}
    assert swap.tensor == "c:0" and swap_in.trigger == G + "g" and pos[G + "m"] + 1 == pos[G + "m1"]
    assert _later_trigger(model, order, pos, swap_in, pos[G + "g"], None) is None  # g already triggers it
    swaps, orders, _ = late_triggers(sim, plan.swaps)
    assert swaps == list(plan.swaps) and orders == ()
    # Without the rule m would be the trigger, with an order of m1 after it.
    monkeypatch.setattr("tflms.plan.passes.schedule.joins_fused", lambda *args: False)
    assert _later_trigger(model, order, pos, swap_in, pos[G + "g"], None) == G + "m"
    assert late_triggers(sim, plan.swaps)[1] == (Order(op=G + "m1", after=G + "m"),)


def test_a_budget_met_only_with_late_triggers_gets_them_from_make_plan(monkeypatch):
    from tflms.errors import BudgetError
    from tflms.plan.passes import schedule

    model = GraphModel.from_ops(_stem_ops())
    early = make_plan(model, LMSConfig(knobs=Knobs(min_bytes=0, serialize=False, swapout_threshold=1, swapin_ahead=1)))
    budget = early.peak_bytes_after - 1
    with pytest.raises(BudgetError):
        make_plan(model, LMSConfig(knobs=Knobs(min_bytes=0, serialize=False), budget=budget))
    late = []
    monkeypatch.setattr(schedule, "late_triggers", lambda *a, f=schedule.late_triggers: late.append(1) or f(*a))
    plan = make_plan(model, LMSConfig(knobs=Knobs(min_bytes=0, serialize=True), budget=budget))
    # The budget is met only with late triggers, so the autotuner's step 5 finished this plan (or
    # make_plan would have raised); make_plan reuses that instead of finishing it again.
    assert late == [1]
    assert [s.tensor for s in plan.swaps] == ["c:0"]
    assert [si.trigger for si in plan.swaps[0].swap_ins] == [G + "m"]
    assert plan.orders == (Order(op=G + "m1", after=G + "m"),)
    assert plan.peak_bytes_after <= budget < plan.peak_bytes_before
    assert SwapPlan.from_json(plan.to_json()) == plan
    # Without a budget (or one the plan meets) the triggers stay where the planner put them.
    assert (
        make_plan(model, LMSConfig(knobs=Knobs(min_bytes=0, swapout_threshold=1, swapin_ahead=1))).swaps == early.swaps
    )


def _tight_stem_ops():
    """:func:`_stem_ops` where the executor runs the swap-in's consumer ``m1`` (now ``dy * c``, as
    large as ``c``, then summed) right after ``g``: nothing to trigger the swap-in on in between.
    ``b`` sums ``g`` (a BatchNorm's beta gradient) and ``m`` (``g`` times a scale) could write
    into ``g``'s buffer if it read it last."""
    big, small = f32(64, 256), f32(8)
    ops = [o for o in _stem_ops() if o["name"] not in (G + "m", G + "m1", G + "out", "update")]
    return ops + [
        op("scale", "Placeholder", outputs=[small]),
        op(G + "m1", "Mul", [G + "g:0", "c:0"], [big]),
        op(G + "m", "Mul", [G + "g:0", "scale:0"], [big]),
        op(G + "m2", "Sum", [G + "m1:0"], [small]),
        op(G + "b", "Sum", [G + "g:0"], [small]),
        op(G + "out", "Mul", [G + "m:0", G + "m2:0"], [big]),
        op(G + "out2", "Mul", [G + "out:0", G + "b:0"], [big]),
        op("update", "AssignSubVariableOp", [G + "out2:0"], []),
    ]


def test_room_for_a_later_trigger_is_made_by_orders():
    from tflms.plan.passes.schedule import _room_orders, finish, late_triggers

    model = GraphModel.from_ops(_tight_stem_ops())
    options = dict(knobs=Knobs(min_bytes=0, serialize=False, swapout_threshold=1, swapin_ahead=1))
    plan = make_plan(model, LMSConfig(**options))
    [swap] = plan.swaps
    assert swap.tensor == "c:0" and [si.trigger for si in swap.swap_ins] == [G + "g"]
    sim = Simulator(model)
    assert sim.order.index(G + "g") + 1 == sim.order.index(G + "m1")
    assert late_triggers(sim, plan.swaps)[1] == ()  # nothing runs between g and m1
    # m1 waits for b, which can then trigger c's swap-in; m waits for b and m1, and reads g last.
    assert _room_orders(sim, plan.swaps) == (
        Order(op=G + "m", after=G + "b"),
        Order(op=G + "m", after=G + "m1"),
        Order(op=G + "m1", after=G + "b"),
    )
    from tflms.plan.passes.schedule import _acyclic

    assert _acyclic(sim, plan.swaps, _room_orders(sim, plan.swaps))
    assert not _acyclic(sim, plan.swaps, (Order(op=G + "g", after=G + "m"),))  # m reads g
    budget = sim.peak(plan.swaps) - 1
    swaps, orders, done = finish(sim, list(plan.swaps), LMSConfig(budget=budget, **options).with_knobs(serialize=True))
    assert [si.trigger for s in swaps for si in s.swap_ins] == [G + "b"]
    assert set(_room_orders(sim, plan.swaps)) <= set(orders)
    assert done.peak(swaps) <= budget
    # From g on: four 64 KiB buffers before (p, g, c's swap-in, then m's output), three after (c
    # arrives once p is gone, and m writes into g). The peak moves to t, made before (224 KiB).
    kib = lambda s, swaps: [int(b) // 1024 for b in s.profile(swaps).requested]  # noqa: E731 (32-byte sums left out)
    before, after = kib(sim, plan.swaps), kib(done, swaps)
    assert max(before[sim.order.index(G + "g") :]) == 4 * 64 == max(before)
    assert max(after[done.order.index(G + "g") :]) == 3 * 64 and max(after) == 224
    order = done.order
    assert order.index(G + "b") < order.index(G + "m1") < order.index(G + "m")
