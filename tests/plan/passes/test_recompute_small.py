"""Recompute decisions on hand-built graphs (issue 8, part 2): which tensors, which ops, the cost model."""

import json

import pytest

from tflms import Knobs, LMSConfig, SwapPlan, make_plan
from tflms.emulate.simulator import Simulator
from tflms.ir.decisions import RECOMPUTE_SCOPE
from tflms.plan.passes.recompute import plan_recomputes, recompute_cost, swap_cost, with_recomputes

from graphs import bn_relu_model, two_group_model

pytestmark = pytest.mark.unit

CFG = {"knobs": Knobs(swapout_threshold=2, min_bytes=0), "policy": "none"}
RECOMPUTE = {**CFG, "policy": "recompute"}


def test_a_cheap_chain_over_a_swapped_input_is_recomputed_not_swapped():
    model = bn_relu_model()
    cfg = LMSConfig(**RECOMPUTE)
    [rc] = plan_recomputes(model, cfg)
    assert rc.tensor == "r:0" and rc.ops == ("m", "a", "r")
    assert rc.groups[0].trigger == "gradient_tape/g5"
    assert {c for c, _ in rc.groups[0].consumers} == {"gradient_tape/filter", "gradient_tape/rg"}
    plan = make_plan(model, cfg)
    assert [r.tensor for r in plan.recomputes] == ["r:0"]
    # r is not swapped; c is, and its one swap-in also feeds the clone of m.
    [swap] = plan.swaps
    assert swap.tensor == "c:0" and len(swap.swap_ins) == 1
    assert {c for c, _ in swap.swap_ins[0].consumers} == {f"{RECOMPUTE_SCOPE}/r/0/m", "gradient_tape/bn"}
    # Fewer bytes over the link than swapping both, for a little compute.
    swap_only = make_plan(model, LMSConfig(**CFG))
    assert {s.tensor for s in swap_only.swaps} == {"c:0", "r:0"}
    assert plan.link_seconds < swap_only.link_seconds and plan.recompute_seconds > 0
    assert plan.step_seconds < swap_only.step_seconds
    assert "recompute 3 ops" in plan.summary() and "predicted recompute time per step" in plan.summary()


def test_the_model_with_recomputes_is_what_the_rewrite_builds():
    model = bn_relu_model()
    plan = make_plan(model, LMSConfig(**RECOMPUTE))
    new = with_recomputes(model, plan.recomputes)
    rc = plan.recomputes[0]
    assert new.inputs_of["gradient_tape/rg"] == ["gradient_tape/g5:0", rc.output(0)]
    assert new.inputs_of[rc.clone("a", 0)] == [rc.clone("m", 0) + ":0", "o:0"]
    for name in rc.ops:
        clone = rc.clone(name, 0)
        assert new.dag.nodes[clone]["phase"] == "backward"
        assert new.dag.edges["gradient_tape/g5", clone]["control"]
    # The plan's predicted peak is the simulator's on that model, with the swaps.
    assert plan.peak_bytes_after == Simulator(new).peak(plan.swaps)
    assert with_recomputes(model, ()) is model


@pytest.mark.parametrize("cheap", ["StatelessRandomUniformV2", "RandomUniform", "Conv2D"])
def test_random_stateful_and_costly_producers_are_never_recomputed(cheap):
    assert plan_recomputes(bn_relu_model(cheap=cheap), LMSConfig(**RECOMPUTE)) == []


def test_a_chain_needing_a_tensor_that_is_not_there_is_not_recomputed():
    # The scale s is a large forward activation read by nothing in the backward pass: the clone
    # would need it, and it is gone (and not cheap to make again: a Conv2D made it).
    model = bn_relu_model(scale_type="Conv2D")
    assert model.tensors["s:0"].consumers == (("m", 1),)
    assert (
        plan_recomputes(
            model, LMSConfig(policy=("default", "recompute"), knobs=Knobs(swapout_threshold=2, min_bytes=0))
        )
        == []
    )
    # Under min_bytes it is kept until the backward pass, and the chain is recomputed.
    [rc] = plan_recomputes(
        model, LMSConfig(policy=("default", "recompute"), knobs=Knobs(swapout_threshold=2, min_bytes=4096))
    )
    assert rc.ops == ("m", "a", "r")


def test_the_cost_model_decides():
    model = bn_relu_model()
    cfg = LMSConfig(**RECOMPUTE)
    [rc] = plan_recomputes(model, cfg)
    [swap] = [s for s in make_plan(model, LMSConfig(**CFG)).swaps if s.tensor == "r:0"]
    assert recompute_cost(rc, [], cfg) < swap_cost(swap, cfg)
    # A slow device (or a fast link) makes the swap cheaper: nothing is recomputed.
    assert plan_recomputes(model, LMSConfig(**RECOMPUTE).with_knobs(device_bandwidth=10**6)) == []
    assert plan_recomputes(model, LMSConfig(**RECOMPUTE).with_knobs(link_bandwidth=10**15, link_latency=0.0)) == []
    assert make_plan(model, LMSConfig(**RECOMPUTE).with_knobs(device_bandwidth=10**6)).recomputes == ()


def test_recompute_is_off_by_default_and_plans_round_trip():
    model = bn_relu_model()
    assert make_plan(model, LMSConfig(**CFG)).recomputes == ()
    plan = make_plan(model, LMSConfig(**RECOMPUTE))
    data = json.loads(plan.to_json())
    assert data["format_version"] == 7 and data["recomputes"][0]["ops"] == ["m", "a", "r"]
    assert SwapPlan.from_json(plan.to_json()) == plan
    assert make_plan(bn_relu_model(), LMSConfig(**RECOMPUTE)).to_json() == plan.to_json()


def test_recompute_options_are_validated():
    with pytest.raises(TypeError, match=r"recompute='yes' is not an option: .*policy=\('default', 'recompute'\)"):
        LMSConfig(recompute="yes")
    with pytest.raises(ValueError, match=r"device_bandwidth .*Received: device_bandwidth=-1"):
        LMSConfig(knobs=Knobs(device_bandwidth=-1))
    assert LMSConfig(knobs=Knobs(device_bandwidth="2TB/s")).knobs.device_bandwidth == 2 * 10**12


@pytest.mark.parametrize("late_u", [False, True])
def test_every_group_of_clones_is_charged_the_swap_ins_it_causes(late_u):
    # r's chain m = x * u, a = m + u, r = Relu(a) runs again for two groups, far apart. u is
    # swapped for its own backward read du, which falls in one group's reach only: the other
    # group's clones need one more swap-in of u (charged once, though m and a both read u).
    model = two_group_model(late_u=late_u)
    swap_only = {s.tensor: s for s in make_plan(model, LMSConfig(**CFG)).swaps}
    assert [len(s.swap_ins) for s in swap_only.values()] == [1, 2]  # u, r
    # With the default link, recomputing r (2 x 3 ops, 30 us) plus that swap-in of u (11 us)
    # costs more than swapping r (3 transfers, 32 us).
    assert plan_recomputes(model, LMSConfig(**RECOMPUTE)) == []
    # With a slower link's latency (20 us) recomputing is cheaper, and the plan holds that swap-in.
    cfg = LMSConfig(**RECOMPUTE).with_knobs(link_latency=20e-6)
    [rc] = plan_recomputes(model, cfg)
    assert rc.tensor == "r:0" and [g.level for g in rc.groups] == [13, 24]
    plan = make_plan(model, cfg)
    [swap] = plan.swaps
    assert swap.tensor == "u:0" and len(swap.swap_ins) == 2
    assert swap_cost(swap, cfg) + recompute_cost(rc, [], cfg) == pytest.approx(plan.step_seconds)
    assert plan.step_seconds < make_plan(model, LMSConfig(**CFG).with_knobs(link_latency=20e-6)).step_seconds


@pytest.mark.parametrize("late_u", [False, True])
def test_a_chain_input_that_is_not_swapped_must_be_there_for_the_last_group(late_u):
    # Only r may be swapped: u stays on the device until its last read du. The late group's
    # clones read it at level 24, so du must come at or after that.
    model = two_group_model(late_u=late_u)
    cfg = LMSConfig(**RECOMPUTE)
    r_only = [s for s in make_plan(model, LMSConfig(**CFG)).swaps if s.tensor == "r:0"]
    found = plan_recomputes(model, cfg, swaps=r_only)
    assert [rc.ops for rc in found] == ([("m", "a", "r")] if late_u else [])
