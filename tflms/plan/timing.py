"""The planner's model of time: op times and the link from the options, plans timed on the timeline.

:func:`timeline_model` times a step's ops from ``Knobs.op_profile`` (a measured
:class:`tflms.emulate.costs.OpProfile`) or the FLOP/byte estimate (``device_flops``,
``device_bandwidth``), :func:`link_of` reads the link from ``link_bandwidth`` and
``link_latency``, and :func:`plan_timeline` gives a plan's predicted step time and the time
each swap-in lands (:mod:`tflms.emulate.timeline`). The autotuner
(:mod:`tflms.plan.autotune`) ranks the plans that fit the budget by :func:`step_seconds`, and
``Knobs.triggers='timeline'`` sets each swap-in's trigger by :func:`timed_triggers`.

Example (a plan of the CNN of the model zoo, the op times estimated):
    >>> import tensorflow as tf, tflms
    >>> from tflms.testing.measure import build
    >>> _, x, y, train_step = build("cnn", batch=8, size=32)
    >>> graph = tflms.GraphModel.from_func_graph(tf.function(train_step).get_concrete_function(x, y).graph)
    >>> plan = tflms.make_plan(graph, tflms.LMSConfig(knobs=tflms.Knobs(swapout_threshold=20)))
    >>> tl = plan_timeline(plan, graph)
    >>> tl.step_seconds >= tl.compute_seconds > 0
    True
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence

from .._devices import same_device
from ..config import LMSConfig
from ..emulate.costs import DeviceRates, OpProfile, op_seconds
from ..emulate.timeline import Link, Timeline, TimelineModel, timed_trigger_time
from ..ir.decisions import Swap, SwapIn
from ..ir.graph import CONTROL_FLOW_OP_TYPES, GraphModel
from .candidates import _ancestors_down_to, is_collective
from .profiles import AUTO_PROFILE
from .records import SwapPlan
from .registry import replay

__all__ = ["link_of", "rates_of", "load_profile", "timeline_model", "step_seconds", "timed_triggers", "plan_timeline"]


def link_of(config: LMSConfig) -> Link:
    """The link of ``config``'s knobs: ``link_bandwidth`` each way, ``link_latency`` per transfer."""
    return Link(config.knobs.link_bandwidth, config.knobs.link_bandwidth, config.knobs.link_latency)


def rates_of(config: LMSConfig) -> DeviceRates:
    """The estimate's device rates from ``config``'s knobs (``device_flops``, ``device_bandwidth``)."""
    return DeviceRates(flops=config.knobs.device_flops, bandwidth=config.knobs.device_bandwidth)


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime: float) -> OpProfile:
    return OpProfile.load(path)


def load_profile(config: LMSConfig) -> OpProfile | None:
    """The op profile ``Knobs.op_profile`` names (read once per file version), or ``None``
    (also for ``'auto'`` before a call has been profiled: :mod:`tflms.plan.profiles`)."""
    path = config.knobs.op_profile
    if path is None or path == AUTO_PROFILE:
        return None
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"op_profile names no file. Make one with tflms.testing.profile.profile_ops(...).save(path). "
            f"Received: op_profile={path!r}"
        )
    return _load(path, os.path.getmtime(path))


def timeline_model(model: GraphModel, config: LMSConfig, order: Sequence[str] | None = None) -> TimelineModel:
    """``model``'s :class:`~tflms.emulate.timeline.TimelineModel` with op times from ``config``
    (the measured profile where it has an op, else the estimate)."""
    return TimelineModel(model, op_seconds(model, load_profile(config), rates_of(config)), order)


def step_seconds(timed: TimelineModel, swaps: Sequence[Swap], config: LMSConfig, in_time: bool = True) -> float:
    """Predicted step time of ``swaps`` on the step ``timed`` models, over ``config``'s link.

    ``in_time`` (default): with each swap-in requested in time for its consumer (as far as its
    swap-out allows: :meth:`~tflms.emulate.timeline.TimelineModel.run`), not by its trigger: what
    the swaps cost once their triggers are chosen. ``False``: with the swaps' own triggers."""
    return timed.run(swaps, link_of(config), in_time=in_time).step_seconds


def plan_timeline(plan: SwapPlan, model: GraphModel | None = None, profile: OpProfile | None = None) -> Timeline:
    """The predicted timeline of ``plan`` on ``model`` (the step it was made from; default: the
    graph model the plan holds): its ``step_seconds``, the time each swap-in lands (``landed``),
    the compute stream's stalls. Its swaps and fences run on the step as the plan changes it
    (:func:`tflms.plan.registry.replay`), with the op times of ``profile`` (default: the plan's
    ``op_profile`` option, else the estimate) and the plan's link."""
    model = model if model is not None else plan.model
    if model is None:
        raise ValueError(
            "this plan holds no graph model (it was loaded from JSON or built by hand): pass "
            "model=tflms.GraphModel.from_func_graph(cf.graph) of the traced step. Received: model=None"
        )
    config = LMSConfig.from_dict(dict(plan.options))
    step = replay(model, plan)
    profile = profile if profile is not None else load_profile(config)
    timed = TimelineModel(step, op_seconds(step, profile, rates_of(config)))
    return timed.run(plan.swaps, link_of(config), plan.fences)


def timed_triggers(
    model: GraphModel, swaps: Sequence[Swap], config: LMSConfig, timed: TimelineModel | None = None
) -> list[Swap]:
    """``swaps`` with each swap-in triggered on the timeline: by the op that ends last before the
    time its first consumer starts in the plain step minus the transfer time
    (:func:`tflms.emulate.timeline.timed_trigger_time`), among the ops that may trigger it under
    :mod:`tflms.plan.planner`'s rules (backward ancestors of the consumer above the producer;
    for a tensor of the backward pass, descendants of its producer). Where no such op ends by
    then, the earliest-ending one; where there is none at all, the trigger is kept."""
    import networkx as nx

    timed = timed or timeline_model(model, config)
    plain = timed.run()
    link = link_of(config)
    nodes = model.dag.nodes
    out = []
    for s in swaps:
        producer_level = nodes[s.producer]["level"]
        new_ins = []
        for si in s.swap_ins:
            first = min((c for c, _ in si.consumers), key=lambda c: (plain.start[c], c))
            below = _ancestors_down_to(model, first, producer_level + 1)
            after = None
            if nodes[s.producer]["phase"] == "backward":
                after = nx.descendants(model.dag.subgraph([u for u, _ in below] + [s.producer]), s.producer)
            options = [
                u
                for u, _ in below
                if nodes[u]["phase"] == "backward"
                and not is_collective(nodes[u]["type"])
                and nodes[u]["type"] not in CONTROL_FLOW_OP_TYPES
                and not same_device(nodes[u]["device"], config.host)
                and (after is None or u in after)
            ]
            if not options:
                new_ins.append(si)
                continue
            by = timed_trigger_time(plain, first, s.bytes, link)
            in_time = [(plain.end[u], u) for u in options if plain.end[u] <= by]
            trigger = max(in_time)[1] if in_time else min((plain.end[u], u) for u in options)[1]
            new_ins.append(SwapIn(si.consumers, trigger, si.level, nodes[trigger]["level"]))
        out.append(dataclasses.replace(s, swap_ins=tuple(new_ins)))
    return out
