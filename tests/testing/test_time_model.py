"""The model of time on real traced steps: a measured op profile, the link probe, plans timed and
triggered on the timeline (tflms.testing.profile, tflms.testing.link, tflms.plan.timing)."""

import math

import numpy as np
import pytest
import tensorflow as tf

import tflms
from tflms.emulate.costs import FREE_OP_TYPES, OpProfile, coverage, op_seconds
from tflms.emulate.timeline import TimelineModel
from tflms.plan.timing import plan_timeline
from tflms.testing.link import probe_link
from tflms.testing.profile import profile_once, profile_ops

import zoo
from conftest import DEVICE, HOST, SMALL_KNOBS
from helpers import check_structure

pytestmark = pytest.mark.integration


def test_the_profile_of_a_zoo_cnn_times_most_of_its_ops_and_round_trips(tmp_path):
    shared = zoo.shared("cnn")
    setup = shared.setup
    setup.reset()
    profile = profile_ops(shared.plain, (setup.x, setup.y), steps=2, device=DEVICE)
    setup.reset()
    model = tflms.GraphModel.from_func_graph(shared.cf.graph)
    # Grappler fuses or folds some ops (a Conv2D with its BiasAdd, constants): most others have a record.
    assert coverage(model, profile) > 0.8, coverage(model, profile)
    assert profile.steps == 2 and profile.device == DEVICE
    timed = [op for op, kind in model.dag.nodes(data="type") if kind not in FREE_OP_TYPES]
    # Every filter gradient ran (the input image's gradient does not: Grappler prunes it).
    convs = [op for op in timed if model.dag.nodes[op]["type"] == "Conv2DBackpropFilter"]
    assert len(convs) == 4 and all(profile.seconds(op) is not None and profile.seconds(op) > 0 for op in convs)
    assert not [op for op in profile.ops if ":" in op]  # ops (of the step, or made by Grappler), no executor records
    loaded = OpProfile.load(profile.save(tmp_path / "cnn.json"))
    assert loaded == profile
    times = op_seconds(model, loaded)
    assert all(math.isfinite(t) and t >= 0 for t in times.values())
    step = TimelineModel(model, times).run()
    assert step.step_seconds == sum(times.values()) or math.isclose(step.step_seconds, sum(times.values()))
    # Profiled once per input signature.
    setup.reset()
    first = profile_once(shared.plain, (setup.x, setup.y), steps=1, device=DEVICE)
    assert profile_once(shared.plain, (setup.x, setup.y), steps=1, device=DEVICE) is first
    setup.reset()


def test_the_link_probe_measures_both_directions_and_is_cached(tmp_path):
    probe = probe_link(DEVICE, HOST, sizes=(1 << 12, 1 << 20, 1 << 22), repeats=3, cache_dir=tmp_path)
    assert probe.to_host > 0 and probe.to_device > 0 and probe.latency >= 0
    assert {len(probe.samples["to_host"]), len(probe.samples["to_device"])} == {3}
    assert (tmp_path / "link.json").is_file()
    assert probe_link(DEVICE, HOST, cache_dir=tmp_path) is probe  # this process's copy
    knobs = probe.knobs()
    assert tflms.LMSConfig(knobs=tflms.Knobs(**knobs)).knobs.link_latency == probe.latency


def test_timeline_triggers_train_the_cnn_as_plain_does_and_fit_the_budget(tmp_path):
    setup = zoo.cnn()
    fn = setup.step_fn()
    plain = tf.function(fn)
    cf = plain.get_concrete_function(setup.x, setup.y)
    model = tflms.GraphModel.from_func_graph(cf.graph)
    # Every op 1 ms (measured times vary run to run), and a slow link (100 MB/s): a swap-in of
    # 2 MiB takes 21 ms, and triggers on the timeline differ from the level rule's.
    profile = OpProfile({op: (kind, 1e-3) for op, kind in model.dag.nodes(data="type") if kind not in FREE_OP_TYPES})
    path = profile.save(tmp_path / "cnn.json")
    budget = int(0.85 * tflms.Simulator(model, HOST).peak())
    # The case was made with split sums and dropped tiles (the default policy before they became
    # opt-in); with swap_gradients alone the timeline's triggers stall 15 ms where the levels' do not.
    policy = ("default", "split_sums", "drop_tiles")
    options = dict(
        budget=budget, policy=policy, knobs=SMALL_KNOBS.replace(link_bandwidth="100MB/s", op_profile=str(path))
    )
    by_levels = tflms.make_plan(model, tflms.LMSConfig(device=DEVICE, **options))
    lms = tflms.function(fn, device=DEVICE, **{**options, "knobs": options["knobs"].replace(triggers="timeline")})
    plan = lms.get_plan(setup.x, setup.y)
    assert plan.options["triggers"] == "timeline"
    assert plan.peak_bytes_after <= budget and plan.swaps
    assert [s.tensor for s in plan.swaps] == [s.tensor for s in by_levels.swaps]
    triggers = {(s.tensor, k): si.trigger for s in plan.swaps for k, si in enumerate(s.swap_ins)}
    level_triggers = {(s.tensor, k): si.trigger for s in by_levels.swaps for k, si in enumerate(s.swap_ins)}
    assert triggers != level_triggers
    # Just in time: no more waiting than by levels, and the swapped-in copies held for less time.
    timed, leveled = plan_timeline(plan, model), plan_timeline(by_levels, model)
    assert timed.stall_seconds <= leveled.stall_seconds

    def held(tl, p):
        return sum(min(tl.start[c] for c, _ in si.consumers) - tl.landed(s.tensor, k)
                   for s in p.swaps for k, si in enumerate(s.swap_ins))  # fmt: skip

    assert held(timed, plan) < held(leveled, by_levels)
    # split_sums re-associates sums (opt-in for that reason): what holds on any CPU is the first
    # loss bit for bit and each variable within Adam's first update of a rounded gradient.
    losses, variables = zoo.run_steps(setup, lms, n=1)
    ref_losses, ref_vars = zoo.run_steps(setup, plain, n=1)
    np.testing.assert_array_equal(losses, ref_losses)
    lr = float(setup.optimizer.learning_rate)
    for a, b in zip(variables, ref_vars, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=2 * lr * (1 + 1e-3))
    check_structure(lms.get_concrete_function(setup.x, setup.y), plan, DEVICE, HOST)
