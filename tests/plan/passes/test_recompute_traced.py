"""Recompute (issue 8, part 2) on the one-process CPU pair: plans saved and applied again.

The zoo models' recompute steps (bit-identical, structured, kept by Grappler) are tested in
test_zoo.py, in the process that traces and trains their plain steps once (zoo.shared).
"""

import numpy as np
import pytest
import tensorflow as tf

import tflms
from tflms import _tf_internal as tfi

import zoo
from conftest import DEVICE, HOST, SMALL
from helpers import check_recomputes

pytestmark = pytest.mark.integration


def test_recompute_plan_round_trips_and_rewrites_the_same():
    """A plan with recomputes saved as JSON and applied again gives the same graph and numbers."""
    from tflms.ir.graph import GraphModel
    from tflms.plan.records import SwapPlan
    from tflms.rewrite.apply import apply_plan

    setup = zoo.cnn()
    cf = tf.function(setup.step_fn()).get_concrete_function(setup.x, setup.y)
    new_cf, plan = tflms.optimize(cf, device=DEVICE, policy=("default", "recompute"), **SMALL)
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
    same_cf, same_plan = tflms.optimize(new_cf, device=DEVICE, policy=("default", "recompute"), **SMALL)
    assert same_cf is new_cf and same_plan == plan
    # The recomputed model the planner simulated is the one the rewrite built (names and wiring).
    rebuilt = GraphModel.from_func_graph(new_cf.graph)
    for rc in plan.recomputes:
        for k, group in enumerate(rc.groups):
            for consumer, index in group.consumers:
                assert rebuilt.inputs_of[consumer][index] == rc.output(k)


def test_the_callbacks_short_summary_counts_the_recomputes():
    """LMSCallback(verbose=1) prints tflms.integrations.keras.short_summary: a plan with
    recomputes says so, one without does not."""
    from tflms.integrations.keras import short_summary

    from graphs import bn_relu_model

    cfg = {"knobs": tflms.Knobs(swapout_threshold=2, min_bytes=0)}
    plan = tflms.make_plan(bn_relu_model(), tflms.LMSConfig(policy=("default", "recompute"), **cfg))
    [rc] = plan.recomputes
    first = short_summary(plan).splitlines()[0]
    assert first.endswith(f"; 1 tensor recomputed ({len(rc.ops) * len(rc.groups)} op clones)"), first
    assert "recomputed" not in short_summary(tflms.make_plan(bn_relu_model(), tflms.LMSConfig(**cfg)))
