"""The planner: which tensors to swap, where they come back, and what triggers them.

Rules (../shared/DESIGN.md, "Swapping, in short"; every knob comes from :class:`tflms.LMSConfig`):

* Candidates are outputs of *forward* ops that have at least one *backward*
  consumer more than ``swapout_threshold`` levels after the producer ("far"
  consumers). Excluded: tensors smaller than ``min_bytes``, of rank < 2 or unknown
  rank, with an unknown dimension other than the leading one (their size would be a
  guess), of dtype resource/variant/string/int32; outputs of ``Const``,
  ``Placeholder`` (the caller holds function arguments anyway), constant fills
  (``Fill``/``ZerosLike``/``OnesLike``: cheaper to keep than to move), variable
  reads (they alias the variable), Horovod collectives and functional control flow
  (their bodies are never edited); ops already on the host; scope and type filters.
* One swap-out per tensor. Far consumers, sorted by level, are grouped: each
  consumer within ``swapin_groupby`` levels of its group's first consumer shares
  that group's swap-in. Near consumers keep reading the device tensor.
* Not swapped either: a tensor with a far consumer in ``tflms.plan.candidates.PINNED_INPUTS``
  (the pooled output read by ``MaxPoolGrad``/``MaxPool3DGrad``, the ``LRN`` output read
  by ``LRNGrad``): oneDNN runs those gradients with its own kernel only when that input
  comes straight from the forward op, and TensorFlow's kernel gives other numbers. Only
  where ``config.device`` is not a GPU (``tflms.plan.candidates.pins_inputs``): ``device=None`` is a GPU.
* Each swap-in's trigger is a backward op on a path into the group's first
  consumer, at level >= (first consumer's level - ``swapin_ahead``) and above the
  producer; the lowest such level wins, ties broken by name. When that window
  holds none, the highest-level backward ancestor below it is used; with no
  backward ancestor at all, there is no trigger. A tensor of the backward pass
  (``swap_gradients``) takes only a trigger that descends from its producer: a sibling
  (an op reading the same gradient) may run first, and the swap-in would then come back
  as soon as it left. With no trigger, the tensor is not swapped.
* ``triggers='timeline'`` then moves each swap-in's trigger to the op that ends last before
  its first consumer starts minus the transfer time, on the step's timeline
  (:func:`tflms.plan.timing.timed_triggers`), where the predicted peak with those triggers
  still fits the budget; where it does not, only the tensors whose swap-ins that rule triggers
  later get them, if the peak then fits.
* ``n_tensors`` keeps the largest candidates (bytes, then distance, then name).
* ``budget`` (bytes) hands the choice of ``swapout_threshold``, ``swapin_ahead``,
  ``swapin_groupby`` and ``n_tensors`` to :mod:`tflms.plan.autotune`.
* ``swapout_window`` adds fences (:class:`tflms.Fence`): with the swapped tensors in
  the simulator's execution order, the producer of the k-th waits for the swap-out of
  the (k - window)-th, when it runs strictly later (several outputs of one op share it)
  and is not an op of :data:`UNFENCED_TYPES`.
* the pass ``recompute`` (in ``policy``) first takes the candidates that :mod:`tflms.plan.passes.recompute` predicts
  cheaper to recompute than to swap (with the options as given, before any tuning),
  applies them to the model (:func:`tflms.plan.passes.recompute.with_recomputes`), and plans the
  swaps, tuning included, on that model: a recompute's clones are backward consumers
  like any other, and its sources may be swapped. The predicted peak after is the
  simulator's on that model.
* ``split_sums`` first splits the backward pass's ``AddN`` sums of three or more terms
  into chains of ``AddV2`` (:mod:`tflms.plan.passes.sums`) and plans everything else on that model.
* ``drop_tiles`` then leaves out the backward pass's ``Tile`` ops whose values the ops
  that read them can broadcast (:mod:`tflms.plan.passes.tiles`), on the step with the sums split.
* ``order_updates`` then makes each in-place variable update wait for the
  ops still holding a value read from that variable (:func:`tflms.plan.passes.schedule.update_orders`),
  so that TensorFlow does not copy the variable, where the simulator predicts no higher
  plain peak with them; the plan's ``orders`` list these edges first.
* ``serialize=True`` then adds ordering edges (:class:`tflms.Order`) within the backward
  pass, chosen by :func:`tflms.plan.passes.schedule.memory_orders` on the model with the swaps
  applied; the predicted peak after, and the fences, are the simulator's with them.
  With a budget that no plan meets without orders, the autotuner first orders the
  step for the lowest plan it saw and tunes the swaps on the ordered step
  (:func:`tflms.plan.autotune.tune_ordered`); such a plan is reproduced by its JSON (its
  orders and swaps), not by its options alone.

Deterministic: the same graph and options give the same plan, byte for byte.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Mapping, Sequence

from .._util import format_bytes, format_sizes, paused_gc
from ..config import LMSConfig, resolve_budget, resolve_swapout_window
from ..emulate.costs import with_scratch
from ..emulate.simulator import BFC_FIRST_REGION, Simulator
from ..errors import LMSWarning
from ..ir.decisions import Fence, Swap
from ..ir.graph import SUM_OP_TYPES, GraphModel
from .candidates import EXCLUDED_DTYPES, EXCLUDED_PRODUCER_TYPES, candidate_swaps, is_collective
from .records import SwapPlan

#: Progress of long plans (INFO records); ``tflms plan`` shows them.
log = logging.getLogger("tflms")

__all__ = [
    "make_plan",
    "empty_plan",
    "check_placement",
    "UNFENCED_TYPES",
    "fences_for",
    "candidate_swaps",
    "is_collective",
    "EXCLUDED_PRODUCER_TYPES",
    "EXCLUDED_DTYPES",
]


def make_plan(model: GraphModel, config: LMSConfig, simulator: Simulator | None = None) -> SwapPlan:
    """Plan swaps for ``model`` under ``config``; predicted peaks included.

    With ``config.budget`` set, the swap knobs are chosen by
    :func:`tflms.plan.autotune.tune` and recorded in the plan's options. ``swapout_window='auto'``
    is resolved for ``config.device`` (:func:`tflms.config.resolve_swapout_window`; with no
    device, no fences: :func:`tflms.optimize` passes the device it rewrites for).
    ``budget="auto"`` needs a device to read a limit from: ``tflms.function``,
    :func:`tflms.optimize` and ``LMSCallback`` resolve it (:func:`tflms.config.resolve_budget`);
    here, where there is no device, it plans as ``budget=None``.
    Python's cyclic garbage collector is paused while it plans (:func:`tflms._util.paused_gc`).
    """
    with paused_gc():  # no frame of its own: warnings name the caller of make_plan
        config, _ = resolve_budget(config, None, "make_plan reads no device")
        config = resolve_swapout_window(config, config.device)
        scratch = _measured_scratch(config)
        if with_scratch(model, scratch) is not model:
            model, simulator = with_scratch(model, scratch), None
        sim = simulator or Simulator(model, config.host)
        before = sim.peak()
        original = model

        def empty(reason: str, cfg: LMSConfig = config) -> SwapPlan:
            return empty_plan(original, cfg, before, reason)

        if not model.has_backward():
            return empty(
                "the step has no backward ops (no gradient_tape/ or gradients/ scope): nothing to swap; "
                "the function runs unchanged"
            )
        if config.budget is not None and before <= config.budget:
            check_placement(sim, (), config.budget)
            return empty(
                f"the predicted peak ({format_bytes(before)}) fits the budget ({format_sizes(config.budget)}) "
                "without swapping",
                config.replace(on_budget_miss="raise").with_knobs(n_tensors=0),
            )
        from .autotune import tune_ordered
        from .registry import PASSES, prepare

        stage = _Stages(model)
        model, sim, decided = prepare(model, config, sim)  # {plan field: decisions}
        if with_scratch(model, scratch) is not model:  # a pass that rebuilt the step left it out
            model = with_scratch(model, scratch)
            sim = Simulator(model, config.host)
        names = [p.name for p in PASSES if p.field in decided]
        stage.done(f"passes before the swaps ({', '.join(names) or 'none'})")
        orders = decided.pop("orders", ())  # the update orders; the schedule's are added below
        if config.budget is not None:
            config, more, sim = tune_ordered(model, config, sim, plain=before)
            model, orders = sim.model, orders + more  # with the orders, if the budget needed them
            stage.done(f"swap knobs tuned to the budget {format_sizes(config.budget)}")
        swaps = candidate_swaps(model, config)
        if config.knobs.n_tensors is not None:
            swaps = swaps[: config.knobs.n_tensors]
        swaps.sort(key=lambda s: (s.level, s.tensor))
        if config.knobs.triggers == "timeline" and swaps:
            from .timing import timed_triggers

            timed = timed_triggers(model, swaps, config)
            if config.budget is not None and sim.peak(timed, above=config.budget) > config.budget:
                # Only the swap-ins triggered later than by levels (which hold less memory, not more).
                timed = [t if _later(t, s) else s for t, s in zip(timed, swaps)]
            if config.budget is None or sim.peak(timed, above=config.budget) <= config.budget:
                swaps = timed
        if config.knobs.serialize:  # also where no tensor qualifies: the orders alone can be the plan
            from .passes.schedule import finish

            swaps, more, sim = finish(sim, swaps, config)  # sim: of ``model`` (with the budget's orders)
            orders += more
            stage.done(f"memory-aware schedule ({len(more)} ordering edges)")
        if not swaps and not orders and not any(decided.values()):
            return empty(
                f"no tensor qualifies (forward output >= min_bytes={config.knobs.min_bytes} with a backward "
                f"consumer more than swapout_threshold={config.knobs.swapout_threshold} levels later)"
                + (" and no ordering edge lowers the predicted peak" if config.knobs.serialize else "")
            )
        if config.budget is not None:
            check_placement(sim, swaps, config.budget)
        return SwapPlan(
            function=model.name,
            options=config.to_dict(),
            swaps=tuple(swaps),
            n_ops=original.dag.number_of_nodes(),
            peak_bytes_before=before,
            peak_bytes_after=sim.peak(swaps),
            variable_bytes=model.variable_bytes,
            fences=fences_for(sim.pos, swaps, config.knobs.swapout_window) if config.knobs.swapout_window else (),
            orders=orders,
            **decided,  # the other passes decided before the swaps: sums, tiles, recomputes
        ).with_model(original)


class _Stages:
    """Progress of :func:`make_plan`: one INFO record per stage on logger ``tflms``, with its seconds."""

    def __init__(self, model: GraphModel) -> None:
        self.name, self.start = model.name, time.perf_counter()
        log.info("make_plan %s: %d ops", self.name, model.dag.number_of_nodes())

    def done(self, what: str) -> None:
        now = time.perf_counter()
        log.info("make_plan %s: %s (%.1f s)", self.name, what, now - self.start)
        self.start = now


def _measured_scratch(config: LMSConfig) -> dict[str, int]:
    """The ops' temporary buffers of the op profile ``config`` names (``Knobs.op_profile``), by
    op: the simulator counts them (:func:`tflms.emulate.costs.with_scratch`); none without a profile."""
    from .timing import load_profile

    profile = load_profile(config)
    return dict(profile.scratch) if profile is not None else {}


def check_placement(sim: Simulator, swaps: Sequence[Swap], budget: int) -> None:
    """Warn (:class:`tflms.LMSWarning`) where a plan within ``budget`` leaves less room above its
    predicted peak than the step's largest tensor (:meth:`Simulator.largest_buffer`).

    The budget check compares the predicted peak (bytes in use) with the budget; under a real cap
    TensorFlow's allocator also needs each tensor in one contiguous chunk of regions that grow by
    doubling and are never returned, so a large tensor can fail while most of the pool is free.
    The GPT of :mod:`tflms.testing.measure` at batch 16 (125 MiB logits) is such a step: its
    ``budget='320MiB'`` plan (276 MiB predicted) runs out of memory under a 320 MiB cap asking for
    the logits, with 98 MiB in use and 108 MiB the largest free chunk, and its ``'336MiB'`` plan
    under 336 MiB the same (123 MiB the largest free chunk), while the simulator's emulation of the
    capped allocator (:meth:`Simulator.unplaced`) places both: the room is what this checks. It
    warns and does not refuse, because a plan with less room can still find its chunks (the default
    plan of that step, 248 MiB predicted, trains under 320 MiB). Budgets below the allocator's first
    region (2 MiB: hand-built graphs, no real device) are not checked."""
    peak, largest = sim.peak(swaps), sim.largest_buffer()
    if budget >= BFC_FIRST_REGION and 0 <= budget - peak < largest:
        warnings.warn(
            f"the plan's predicted peak ({format_bytes(peak)}) fits budget={budget} ({format_sizes(budget)}), "
            f"but leaves less room than the step's largest tensor ({format_bytes(largest)}), which needs one "
            "contiguous chunk: with memory growth (the test bed, or a GPU with allow_growth) the step may run out "
            "of memory asking for it while most of the pool is free. Leave room for the largest tensor besides "
            "the peak, or lower the batch size.",
            LMSWarning,
            stacklevel=3,
        )


def _later(timed: Swap, by_levels: Swap) -> bool:
    """Whether every swap-in of ``timed`` is triggered at a level no lower than in ``by_levels``."""
    return all((t.trigger_level or 0) >= (s.trigger_level or 0) for t, s in zip(timed.swap_ins, by_levels.swap_ins))


#: Producers that get no fence: Grappler's arithmetic optimizer folds a tree of these into
#: one ``AddN`` (``AddOpsRewrite``) only where no member has a control input, so a fence on
#: one changes how the sum associates, and the step's numbers (a fence on a layer norm's ``AddV2``
#: moves the second loss of ``tflms.testing.measure``'s transformer by one ULP).
UNFENCED_TYPES = SUM_OP_TYPES


def fences_for(pos: Mapping[str, int], swaps: list[Swap], window: int) -> tuple[Fence, ...]:
    """The fences that keep at most ``window`` of ``swaps`` in flight (see :class:`tflms.LMSConfig`);
    ``pos``: each op's position in the execution order (:attr:`tflms.Simulator.pos`). A swap
    produced by an op of :data:`UNFENCED_TYPES` gets none: its window is open by one more."""
    ordered = sorted(swaps, key=lambda s: (pos[s.producer], s.tensor))
    return tuple(
        Fence(tensor=earlier.tensor, op=later.producer)
        for earlier, later in zip(ordered, ordered[window:])
        if pos[later.producer] > pos[earlier.producer] and later.producer_type not in UNFENCED_TYPES
    )


def empty_plan(model: GraphModel, config: LMSConfig, peak_bytes: int, reason: str) -> SwapPlan:
    """A plan that swaps nothing, saying why."""
    return SwapPlan(
        function=model.name,
        options=config.to_dict(),
        swaps=(),
        n_ops=model.dag.number_of_nodes(),
        peak_bytes_before=peak_bytes,
        peak_bytes_after=peak_bytes,
        variable_bytes=model.variable_bytes,
        reason=reason,
    ).with_model(model)
