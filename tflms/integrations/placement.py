"""``devices=[...]``: a traced step placed across devices (:mod:`tflms.plan.passes.place`), rewritten.

:func:`placed_function` is what :func:`tflms.optimize`, ``tflms.function`` and ``LMSCallback`` do
with a config whose ``devices`` is set: plan the placement on the step's graph model, set each op's
device on a copy of the graph (:func:`tflms.rewrite.apply.apply_placement`) and rebuild the
function. TensorFlow's partitioner inserts the transfers between the devices when the function is
instantiated; the step is called under ``tf.device(devices[0])``, where its arguments and variables
are expected.

With a budget (a size) that the placement's largest predicted device peak exceeds, swaps are then
planned per device (:func:`placed_swap_plan`): the planner runs on each device's model
(:func:`tflms.plan.passes.place.device_model`, every other device in the host's role), and each
device's swaps, fences and ordering edges are applied to the placed graph with that device as
the one the swap-ins land on (:func:`tflms.rewrite.apply.apply_plan`), the swap ops on the host.
A tensor a device receives from another is swapped as the sender's tensor: the host's copy is
taken from the device that makes it, and only the receiving device's readers read the swap-in. A
swap-in trigger or ordering edge that names a receive names the op that sends it instead (an
ordering edge that delays a receive delays its sender; the rewrite refuses one that closes a cycle).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from .. import _tf_internal as tfi
from .._devices import device_key
from .._util import format_bytes
from ..config import LMSConfig
from ..errors import BudgetError, LMSWarning
from ..ir.decisions import Fence, Order, Swap
from ..ir.graph import GraphModel
from ..plan.passes.place import ELSEWHERE, device_model, device_stages, placement_plan
from ..plan.planner import make_plan
from ..plan.records import SwapPlan
from ..rewrite.apply import apply_placement, apply_plan

__all__ = ["placed_function", "placed_swap_plan", "device_plans", "check_devices_exist", "refuse_xla"]

#: What :func:`tflms.plan.passes.place.device_model` appends to a producer's name to name the
#: ``_Recv`` of one of its outputs on another device.
_RECV = "/tflms_place_recv_"

log = logging.getLogger("tflms")


def check_devices_exist(config: LMSConfig) -> None:
    """Raise ``ValueError`` naming the first of ``config.devices`` that TensorFlow does not know here
    (a device of another task appears only after connecting to its cluster)."""
    known = {device_key(d.name) for d in tf.config.list_logical_devices()}
    for d in config.devices or ():
        if device_key(d) not in known:
            names = ", ".join(sorted(x.name for x in tf.config.list_logical_devices()))
            raise ValueError(
                f"devices lists {d!r}, which does not exist here (devices: {names}). Split a CPU or GPU into logical "
                "devices before TensorFlow starts, or connect to the cluster that has it "
                "(tf.config.experimental_connect_to_cluster). "
                f"Received: devices={list(config.devices or ())!r}"
            )


def refuse_xla(config: LMSConfig, compiled: bool, what: str) -> None:
    """Raise ``ValueError`` when a step compiled with XLA (``compiled``) is to be placed: XLA compiles
    the whole step for one device. ``what`` names the function in the message."""
    if config.devices and compiled:
        raise ValueError(
            "devices cannot place a step compiled with XLA: XLA compiles the whole step for one device. Pass the "
            "plain function or tf.function(fn, jit_compile=False). "
            f"Received: devices={list(config.devices)!r} with {what} and jit_compile=True"
        )


def placed_function(
    concrete_function: Any, model: GraphModel, config: LMSConfig, copy: bool, host_ops: Sequence[str] | None = None
) -> tuple[Any, SwapPlan]:
    """``(new concrete function, plan)``: ``concrete_function`` (traced, with graph model ``model``)
    placed on ``config.devices``. ``copy=False`` places the ops of ``concrete_function.graph``
    itself (see :func:`tflms.optimize`). Copy-only ops run on ``config.host`` where the placer
    predicts that this lowers the largest device peak, or, with ``host_ops`` (names of
    :func:`tflms.plan.passes.place.copy_ops`), those ops exactly."""
    check_devices_exist(config)
    plan = placed_swap_plan(model, config, host_ops)
    graph = concrete_function.graph
    new_graph = tfi.copy_graph(concrete_function) if copy else graph
    new_graph.name = f"{graph.name}_tflms"
    placed = apply_placement(new_graph, plan.placement)
    log.info("tflms: %s: %d ops placed on %s", graph.name, placed, ", ".join(config.devices or ()))
    for device, sub in device_plans(plan):
        counts = apply_plan(new_graph, sub, device, config.host)
        log.info("tflms: %s: swaps on %s: %s", graph.name, device, counts)
    return tfi.rebuild(concrete_function, new_graph), plan


def _sent(name: str) -> str:
    """The op (``'a/tflms_place_recv_1'`` -> ``'a'``) or tensor (``'a/tflms_place_recv_1:0'`` ->
    ``'a:1'``) of the step that a device model's receive stands for; other names unchanged."""
    op, colon, index = name.rpartition(":") if ":" in name else (name, "", "")
    if _RECV not in op:
        return name
    producer, _, out = op.rpartition(_RECV)
    return f"{producer}:{out}" if colon else producer


def _step_swap(model: GraphModel, swap: Swap) -> Swap:
    """``swap`` (of a device model) named by the step's tensors and ops."""
    producer = _sent(swap.producer)
    ins = tuple(
        dataclasses.replace(si, trigger=_sent(si.trigger) if si.trigger is not None else None) for si in swap.swap_ins
    )
    return dataclasses.replace(
        swap,
        tensor=_sent(swap.tensor),
        producer=producer,
        producer_type=model.dag.nodes[producer]["type"],
        swap_ins=ins,
    )


def placed_swap_plan(model: GraphModel, config: LMSConfig, host_ops: Sequence[str] | None = None) -> SwapPlan:
    """The plan of ``config.devices`` for ``model``: the placement
    (:func:`tflms.plan.passes.place.placement_plan`) and, where ``config.budget`` (a size) is below
    its largest predicted device peak, swaps planned on each device's model within the budget
    (swaps, fences and ordering edges; ``swap_gradients`` the only pass of ``config.policy`` used),
    named by the step's tensors and ops. ``peak_bytes_after`` is then the largest of the devices'
    predicted peaks after their swaps; above the budget it raises :class:`tflms.BudgetError`
    (``on_budget_miss="raise"``) or warns (``"best"``)."""
    budget = config.budget if isinstance(config.budget, int) else None
    if budget is None:
        return placement_plan(model, config, host_ops)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LMSWarning)
        placed = placement_plan(model, config.replace(on_budget_miss="best"), host_ops)
    if placed.peak_bytes_after <= budget:
        return placed
    stage = {op: k for k, st in enumerate(placed.placement) for op in st.ops}
    per_device = config.replace(
        devices=None,
        host=ELSEWHERE,
        on_budget_miss="best",
        policy=config.policy & {"swap_gradients"} or "none",
    ).with_knobs(swapout_window=None)
    swaps, fences, orders, peaks = [], [], [], []
    for k in range(len(device_stages(placed.placement, config.host))):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LMSWarning)
            sub = make_plan(device_model(model, stage, k), per_device)
        swaps += [_step_swap(model, s) for s in sub.swaps]
        fences += [Fence(_sent(f.tensor), f.op) for f in sub.fences]
        orders += [Order(_sent(o.op), _sent(o.after)) for o in sub.orders]
        peaks.append(sub.peak_bytes_after)
    largest = max(peaks)
    if largest > budget:
        if config.on_budget_miss == "raise":
            raise BudgetError(budget, largest, placed.peak_bytes_before)
        warnings.warn(
            f"tflms: the placement's largest predicted device peak with swaps ({format_bytes(largest)}) exceeds "
            f"the budget ({format_bytes(budget)}); placed anyway (on_budget_miss='best')",
            LMSWarning,
            stacklevel=3,
        )
    devices = ", ".join(f"{st.device} {format_bytes(p)}" for st, p in zip(placed.placement, peaks))
    return dataclasses.replace(
        placed,
        swaps=tuple(swaps),
        fences=tuple(fences),
        orders=tuple(orders),
        peak_bytes_after=largest,
        reason=f"{placed.reason.split(';')[0]}; then swaps planned per device (predicted peaks: {devices})",
    ).with_model(model)


def device_plans(plan: SwapPlan) -> list[tuple[str, SwapPlan]]:
    """``(device, plan)`` per device of ``plan.placement`` that has swaps or ordering edges: the
    swaps whose readers run there, their fences, the ordering edges of ops placed there (what
    :func:`tflms.rewrite.apply.apply_plan` applies for that device)."""
    where = {op: st.device for st in plan.placement for op in st.ops}
    out = []
    for st in plan.placement:
        swaps = tuple(s for s in plan.swaps if where.get(s.swap_ins[0].consumers[0][0]) == st.device)
        orders = tuple(o for o in plan.orders if where.get(o.op) == st.device)
        if not swaps and not orders:
            continue
        tensors = {s.tensor for s in swaps}
        fences = tuple(f for f in plan.fences if f.tensor in tensors)
        out.append((st.device, dataclasses.replace(plan, swaps=swaps, fences=fences, orders=orders, placement=())))
    return out
