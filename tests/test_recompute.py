"""Recompute (issue 8, part 2) on the one-process CPU pair: numerics, structure, Grappler.

Each rewritten step with ``recompute=True`` must train bit-identically to the plain step,
hold the clones the plan names (each gated by its trigger, its group's consumers reading
it) and keep them through Grappler.
"""

import networkx as nx
import numpy as np
import pytest
import tensorflow as tf

import tflms
from tflms import _tf_internal as tfi
from tflms.rewrite import RECOMPUTE_SCOPE, SWAP_ATTR

import zoo
from conftest import DEVICE, HOST, SMALL
from helpers import check_structure, check_survives_grappler


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
                assert op.inputs[index] is out, (consumer, index)


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


@pytest.mark.parametrize("name", ["cnn", "transformer", pytest.param("resnet50", marks=pytest.mark.slow)])
def test_recompute_is_bit_identical_and_structured(name):
    shared = zoo.shared(name)  # its plain step traced and trained once per process
    setup = shared.setup
    cf, plan = tflms.optimize(shared.cf, device=DEVICE, recompute=True, **SMALL)
    losses_plain, vars_plain = shared.plain_run(3)
    losses_lms, vars_lms = zoo.run_steps(setup, cf, n=3)
    np.testing.assert_array_equal(losses_lms, losses_plain)
    for a, b in zip(vars_lms, vars_plain):
        np.testing.assert_array_equal(a, b)
    setup.reset()
    assert any(not np.array_equal(a, b.numpy()) for a, b in zip(vars_plain, setup.state()))

    assert plan.recomputes, plan.summary()
    check_recomputes(cf, plan)
    check_structure(cf, plan, DEVICE, HOST)
    optimized = tfi.grappler_optimize(cf, DEVICE)
    check_survives_grappler(cf, DEVICE, optimized)
    check_clones_survive_grappler(cf, plan, optimized)
    # A recomputed tensor is not swapped too, and every recompute reads only what is there.
    assert not {s.tensor for s in plan.swaps} & {r.tensor for r in plan.recomputes}
    # Recomputing instead of swapping moves fewer bytes over the link than swapping alone.
    _, swap_only = tflms.optimize(shared.cf, device=DEVICE, **SMALL)
    assert plan.swapped_bytes < swap_only.swapped_bytes
    assert plan.link_seconds < swap_only.link_seconds
    assert plan.step_seconds < swap_only.step_seconds


def test_recompute_plan_round_trips_and_rewrites_the_same():
    """A plan with recomputes saved as JSON and applied again gives the same graph and numbers."""
    from tflms.graph import GraphModel
    from tflms.plan import SwapPlan
    from tflms.rewrite import apply_plan

    setup = zoo.cnn()
    cf = tf.function(setup.step_fn()).get_concrete_function(setup.x, setup.y)
    new_cf, plan = tflms.optimize(cf, device=DEVICE, recompute=True, **SMALL)
    assert plan.recomputes
    loaded = SwapPlan.from_json(plan.to_json())
    assert loaded == plan and loaded.fingerprint() == plan.fingerprint()
    graph = tfi.copy_graph(cf)
    counts = apply_plan(graph, loaded, device=DEVICE, host=HOST)
    assert counts["recompute"] == sum(len(r.ops) * len(r.groups) for r in plan.recomputes)
    again = tfi.rebuild(cf, graph)
    losses, weights = zoo.run_steps(setup, again, n=2)
    losses_new, weights_new = zoo.run_steps(setup, new_cf, n=2)
    np.testing.assert_array_equal(losses, losses_new)
    for a, b in zip(weights, weights_new):
        np.testing.assert_array_equal(a, b)
    check_recomputes(again, loaded)
    # Rewriting twice changes nothing.
    same_cf, same_plan = tflms.optimize(new_cf, device=DEVICE, recompute=True, **SMALL)
    assert same_cf is new_cf and same_plan == plan
    # The recomputed model the planner simulated is the one the rewrite built (names and wiring).
    rebuilt = GraphModel.from_func_graph(new_cf.graph)
    for rc in plan.recomputes:
        for k, group in enumerate(rc.groups):
            for consumer, index in group.consumers:
                assert rebuilt.inputs_of[consumer][index] == rc.output(k)


def test_the_callbacks_short_summary_counts_the_recomputes():
    """LMSCallback(verbose=1) prints tflms.keras.short_summary: a plan with recomputes says so, one without does not."""
    from tflms.keras import short_summary

    from graphs import bn_relu_model

    cfg = {"swapout_threshold": 2, "min_bytes": 0}
    plan = tflms.make_plan(bn_relu_model(), tflms.LMSConfig(recompute=True, **cfg))
    [rc] = plan.recomputes
    first = short_summary(plan).splitlines()[0]
    assert first.endswith(f"; 1 tensor recomputed ({len(rc.ops) * len(rc.groups)} op clones)"), first
    assert "recomputed" not in short_summary(tflms.make_plan(bn_relu_model(), tflms.LMSConfig(**cfg)))
