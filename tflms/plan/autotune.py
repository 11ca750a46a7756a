"""Autotuning to a memory budget, and the largest batch that fits one.

:func:`tune` picks ``swapout_threshold``, ``swapin_ahead``, ``swapin_groupby`` and
``n_tensors`` for ``LMSConfig(budget=...)``:

1. If the plain step's predicted peak fits, nothing is swapped (``n_tensors=0``).
2. For each threshold and groupby of a small grid (:data:`THRESHOLDS`,
   :data:`GROUPBYS`), with the latest prefetch (``swapin_ahead=1``), and for the
   config's own ``swapout_threshold``, ``swapin_ahead`` and ``swapin_groupby`` (so a
   budget that the plan of those knobs meets is met), the peak of
   every largest-first prefix of the candidates is predicted
   (:meth:`Simulator.prefix_peaks`, a fast lower bound), and the shortest fitting
   prefix, the first and the last of the lowest ones (and for the config's own knobs
   all candidates) are checked with :meth:`Simulator.peak`; the fitting
   combination with the least predicted step time wins (:func:`tflms.plan.timing.step_seconds`:
   the step's timeline, :mod:`tflms.emulate.timeline`, with each op's measured or estimated
   compute time, ``Knobs.op_profile``, and each swap-out and swap-in a transfer of
   ``link_latency + bytes / link_bandwidth`` on the copy engine of its direction, each swap-in
   requested in time for its consumer as far as its swap-out allows, since step 3 chooses the
   prefetch; a transfer hidden behind compute costs nothing), ties going to fewer tensors
   (nothing is swapped that need not be), then larger thresholds and groups. If none fits,
   :class:`BudgetError` carries the lowest predicted peak of all those prefixes.
   Swapping more is not always lower (a tensor read by several backward ops gets
   one swap-in copy per consumer group, and overlapping copies can cost more
   than the device copy they replace), so no prefix is assumed best.
3. With those fixed, the largest ``swapin_ahead`` (earliest prefetch) that still
   fits is kept.
4. With ``serialize=True`` (:func:`tune_ordered`, what ``make_plan`` and
   :func:`max_batch_size` use), when nothing fits: ordering edges for the lowest plan
   of step 2 (:func:`tflms.plan.passes.schedule.memory_orders`), then steps 1-3 again on the step
   with those orders.
5. Still with ``serialize=True``, when nothing fits after step 4: the lowest plan as
   ``make_plan`` finishes it (its own ordering edges, then later triggers for the swap-ins
   that arrive by the peak and are read after it: :func:`tflms.plan.passes.schedule.late_triggers`, and
   orders that make room for more of them); its knobs are the tuned ones if that fits. If
   it does not, the plans of each threshold (latest prefetch, the config's grouping, all
   candidates) finished the same way on the step without step 4's orders, fewest swaps
   first: the first that fits wins.

A plan fits when its predicted peak is within the budget. With ``on_budget_miss='best'`` a
budget that nothing fits gets a warning (:class:`tflms.LMSWarning`, with the lowest predicted
peak) and the lowest plan of steps 2-4 instead of :class:`BudgetError`.

Every number is a simulator prediction (:mod:`tflms.emulate.simulator`). The chosen
values are recorded in the plan's options, so ``make_plan`` with them (and no
budget) reproduces the plan, except one that needed step 4 or 5: its JSON (orders and
swaps) reproduces it, and so do its options with the budget.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sequence

import numpy as np

from ..config import LMSConfig
from ..emulate.simulator import Simulator
from ..errors import BudgetError, LMSWarning
from ..ir.decisions import Order, Swap
from ..ir.graph import GraphModel, TensorInfo, with_orders
from .candidates import _eligible, _swaps
from .timing import step_seconds, timeline_model

__all__ = [
    "tune",
    "tune_ordered",
    "serialized_search",
    "THRESHOLDS",
    "GROUPBYS",
    "AHEADS",
]

THRESHOLDS = (0, 5, 10, 20, 40, 80, 160, 320, 640, 1280)
GROUPBYS = (0, 5, 20, 80)
AHEADS = (64, 32, 16, 8, 4, 2, 1)


def _knobs(config: LMSConfig, threshold: int, ahead: int, groupby: int) -> LMSConfig:
    return config.replace(budget=None).with_knobs(
        n_tensors=None, swapout_threshold=threshold, swapin_ahead=ahead, swapin_groupby=groupby
    )


def _own_knobs(config: LMSConfig) -> tuple[int, int, int]:
    """``config``'s (threshold, ahead, groupby): the grid entry of the plan ``make_plan`` gives without a budget."""
    return config.knobs.swapout_threshold, config.knobs.swapin_ahead, config.knobs.swapin_groupby


def _thresholds(everything: list[Swap]) -> list[int]:
    """The grid's thresholds: those of :data:`THRESHOLDS` below the largest distance of
    ``everything`` (the swaps of threshold 0), where each leaves some swap."""
    max_distance = max((s.distance for s in everything), default=0)
    return [t for t in THRESHOLDS if t < max_distance]


def _grid(model: GraphModel, config: LMSConfig, eligible: list[TensorInfo]) -> list[tuple[int, int, int, list[Swap]]]:
    """(threshold, ahead, groupby, the candidate swaps) of the search grid: each threshold and
    groupby with the latest prefetch (``ahead=1``), and ``config``'s own three knobs.
    ``eligible``: the tensors ``config`` lets be swapped (the knobs do not change them)."""
    return list(_grid_entries(model, config, eligible))


def _grid_entries(
    model: GraphModel, config: LMSConfig, eligible: list[TensorInfo]
) -> Iterator[tuple[int, int, int, list[Swap]]]:
    """:func:`_grid`'s entries, in its order, each made when asked for."""
    everything = _swaps(model, _knobs(config, 0, 1, 0), eligible)
    made = set()
    for threshold in _thresholds(everything):
        for groupby in GROUPBYS:
            swaps = (
                everything
                if threshold == 0 and groupby == 0
                else _swaps(model, _knobs(config, threshold, 1, groupby), eligible)
            )
            if swaps:
                made.add((threshold, 1, groupby))
                yield threshold, 1, groupby, swaps
    own = _own_knobs(config)
    if own not in made:
        swaps = _swaps(model, _knobs(config, *own), eligible)
        if swaps:
            yield (*own, swaps)


def _search(
    model: GraphModel, config: LMSConfig, sim: Simulator, budget: int, exists_only: bool = False
) -> tuple[LMSConfig | None, int, list[Swap], LMSConfig | None]:
    """(tuned config or None when nothing fits, lowest predicted peak the search saw, the swaps
    of that lowest plan when nothing fits, else ``[]``, and the knobs of those swaps then, else None).

    The grid is searched with the fast requested-bytes peaks (:meth:`Simulator.prefix_peaks`,
    a lower bound of :meth:`Simulator.peak`); the candidates it finds are then checked
    with the allocator-accurate :meth:`Simulator.peak`, best key first.
    ``exists_only``: for callers that only ask whether some plan fits (:func:`max_batch_size`):
    the candidates are not timed (any order finds one that fits if one does), and a fitting
    plan's config is returned as it fitted, its prefetch not tuned; the rest is the same.
    """
    lowest = sim.peak()
    if lowest <= budget:
        return config.replace(budget=budget).with_knobs(n_tensors=0), lowest, [], None
    eligible = _eligible(model, config)
    grid, candidates, deepest = _scan_grid(model, config, sim, budget, eligible, exists_only)
    best = None
    for _key, knobs, n in sorted(candidates):
        if _fits(sim, grid[knobs][:n], budget):
            best = (knobs, n)
            break
    if best is None:
        return (None, *_lowest_plan(config, sim, budget, grid, deepest, lowest))
    (threshold, fitted, groupby), n = best
    if exists_only:
        return _tuned(config, budget, threshold, fitted, groupby, n), lowest, [], None
    # Earliest prefetch first; the last one tried is the one that fitted above.
    for ahead in sorted({a for a in AHEADS if a > fitted} | {fitted}, reverse=True):
        if _fits(sim, _swaps(model, _knobs(config, threshold, ahead, groupby), eligible)[:n], budget):
            break
    return _tuned(config, budget, threshold, ahead, groupby, n), lowest, [], None


#: A grid entry's knobs: ``(swapout_threshold, swapin_ahead, swapin_groupby)``.
_Knobs = tuple[int, int, int]


def _scan_grid(
    model: GraphModel, config: LMSConfig, sim: Simulator, budget: int, eligible: list[TensorInfo], exists_only: bool
) -> tuple[
    dict[_Knobs, list[Swap]],
    set[tuple[tuple[float, int, int, int, int], _Knobs, int]],
    list[tuple[int, _Knobs, int]],
]:
    """The grid's swaps by knobs, the ``(key, knobs, n)`` of the prefixes whose fast peaks fit
    ``budget`` (the key orders them: predicted step time, then fewer swaps), and the ``(fast peak,
    knobs, n)`` of each entry's lowest prefixes, for :func:`_search`."""
    candidates: set[tuple[tuple[float, int, int, int, int], _Knobs, int]] = set()
    deepest: list[tuple[int, _Knobs, int]] = []  # (fast peak, knobs, n): the lowest prefixes
    grid = {}
    own = _own_knobs(config)
    timed = None  # the step's timeline model, built for the first fitting plan
    for threshold, ahead, groupby, swaps in _grid(model, config, eligible):
        knobs = (threshold, ahead, groupby)
        grid[knobs] = swaps
        peaks = sim.prefix_peaks(swaps)
        # The fast peaks often stay at their minimum over many prefixes while the accurate ones
        # differ, so both ends of that plateau are tried.
        ends = {int(np.argmin(peaks)), len(peaks) - 1 - int(np.argmin(peaks[::-1]))}
        if knobs == own:  # the plan make_plan gives for these knobs without a budget
            ends.add(len(swaps))
        deepest += [(int(peaks[n]), knobs, n) for n in sorted(ends)]
        fitting = np.flatnonzero(peaks <= budget)
        for n in {int(fitting[0]), *ends} if len(fitting) else ():
            if peaks[n] <= budget:
                if exists_only:
                    cost = 0.0
                else:
                    if timed is None:
                        timed = timeline_model(model, config)
                    cost = round(step_seconds(timed, swaps[:n], config), 9)  # to the ns: ties go to fewer swaps
                candidates.add(((cost, n, -threshold, -groupby, ahead), knobs, n))
    return grid, candidates, deepest


def _lowest_plan(
    config: LMSConfig,
    sim: Simulator,
    budget: int,
    grid: dict[_Knobs, list[Swap]],
    deepest: list[tuple[int, _Knobs, int]],
    lowest: int,
) -> tuple[int, list[Swap], LMSConfig | None]:
    """(lowest peak, its swaps, their knobs) when no plan fits: the lowest accurate peak among the
    deepest prefixes of each grid entry (best fast peaks first), or ``lowest``, ``[]`` and None when
    none is below ``lowest``; each emulation stops once it is over the lowest so far."""
    lowest_swaps: list[Swap] = []
    lowest_knobs = None
    for fast, knobs, n in sorted(deepest):
        if fast >= lowest:
            break
        peak = sim.peak(grid[knobs][:n], above=lowest)
        if peak < lowest:
            lowest, lowest_swaps, lowest_knobs = peak, grid[knobs][:n], _tuned(config, budget, *knobs, n)
    return lowest, lowest_swaps, lowest_knobs


def _tuned(config: LMSConfig, budget: int, threshold: int, ahead: int, groupby: int, n: int) -> LMSConfig:
    return config.replace(budget=budget).with_knobs(
        swapout_threshold=threshold, swapin_ahead=ahead, swapin_groupby=groupby, n_tensors=n
    )


def _fits(sim: Simulator, swaps: list[Swap], budget: int) -> bool:
    """Whether the predicted peak of ``swaps`` is within ``budget`` (the emulation stops at the
    first position over it, so that most misses cost part of one step)."""
    return sim.peak(swaps, above=budget) <= budget


#: The lowest plan of a search that found none within the budget: ``(knobs, orders, simulator)``.
_Lowest = tuple[LMSConfig | None, tuple[Order, ...], Simulator]


def serialized_search(
    model: GraphModel,
    config: LMSConfig,
    sim: Simulator,
    budget: int,
    exists_only: bool = False,
    first: Sequence[int] = (),
) -> tuple[LMSConfig | None, int, tuple[Order, ...], Simulator, _Lowest | None]:
    """:func:`_search`, and with ``config.knobs.serialize``, when no plan fits: ordering edges for the
    lowest plan (:func:`tflms.plan.passes.schedule.memory_orders`), then the search again on the step with them
    (step 4 of the module doc), then step 5: the lowest plan as ``make_plan`` finishes it
    (:func:`tflms.plan.passes.schedule.finish`, with late triggers), then other plans finished
    (:func:`_finish_other_knobs`; their orders are ``()`` and their simulator ``sim``).

    Returns ``(tuned config or None, lowest predicted peak seen, orders, simulator, lowest)``: the
    orders are ``()`` and the simulator ``sim`` unless the search needed them (then it is the
    ordered step's). The orders and triggers of step 5 are not among them: ``make_plan`` makes
    them again from the tuned config. ``lowest``, when nothing fits: ``(knobs, orders, simulator)``
    of the lowest plan of steps 2-4 (knobs None: the plain step was the lowest), which
    ``on_budget_miss='best'`` plans with; None when a plan fits.
    ``exists_only``: whether the config is None tells whether some plan fits, as without it; a
    fitting config may differ (see :func:`_search`), and so may the lowest peak when a plan fits.
    ``first`` (with ``exists_only``): thresholds whose plans of step 5 (:func:`_finish_other_knobs`)
    are finished before anything else, e.g. the threshold that fitted at a nearby batch size
    (:func:`tflms.plan.capacity.max_batch_size`): one that fits answers at the cost of one finished
    plan, where the search would have reached and fitted it in step 5; one that does not is not
    finished again in step 5.
    """
    tried: dict[int, int] = {}  # threshold -> the finished peak of its plan of step 5
    if exists_only and first and config.knobs.serialize:
        fitted = _first_fit(model, config, sim, budget, first, tried)
        if fitted is not None:
            return fitted, tried[fitted.knobs.swapout_threshold], (), sim, None
    tuned, lowest, lowest_swaps, lowest_knobs = _search(model, config, sim, budget, exists_only)
    if tuned is not None or not config.knobs.serialize or not lowest_swaps:
        return tuned, lowest, (), sim, (lowest_knobs, (), sim)
    from .passes.schedule import _memory_orders

    orders, ordered_sim = _memory_orders(sim, lowest_swaps)
    if orders:
        ordered = with_orders(model, orders)  # levels recomputed: the search's candidates read them
        ordered_sim = ordered_sim._of(ordered)  # noqa: SLF001 (the search's simulator, of the same step)
        tuned, ordered_lowest, ordered_swaps, ordered_knobs = _search(ordered, config, ordered_sim, budget, exists_only)
        if tuned is not None:
            return tuned, min(lowest, ordered_lowest), orders, ordered_sim, None
        if ordered_swaps:
            lowest_knobs = ordered_knobs
        lowest = min(lowest, ordered_lowest)
    else:
        ordered_sim = sim
    finished = _finished_peak(ordered_sim, lowest_knobs) if lowest_knobs is not None else None
    if finished is not None and finished <= budget:
        return lowest_knobs, min(lowest, finished), orders, ordered_sim, None
    lowest = lowest if finished is None else min(lowest, finished)
    other_knobs, other = _finish_other_knobs(model, config, sim, budget, tried)
    if other_knobs is not None:
        return other_knobs, min(lowest, other), (), sim, None
    return None, min(lowest, other), orders, ordered_sim, (lowest_knobs, orders, ordered_sim)


def _finish_other_knobs(
    model: GraphModel, config: LMSConfig, sim: Simulator, budget: int, tried: dict[int, int] | None = None
) -> tuple[LMSConfig | None, float]:
    """Step 5 for the other plans of the grid, on the step without step 4's orders: each
    threshold with the latest prefetch and ``config``'s grouping, all of its candidates, the
    fewest swaps first. ``(the first knobs whose finished plan fits or None, the lowest
    finished peak, inf where there was no plan)``.

    Step 5 finishes the plan that was lowest before it, but the plan lowest before finishing
    need not be the lowest once finished (another threshold, or the step without step 4's
    orders, can finish lower), so the others are tried here.

    ``tried``: threshold -> finished peak of the plans finished before on the same ``sim`` (by
    :func:`_first_fit`), not finished again."""
    lowest = math.inf
    tried = {} if tried is None else tried
    for threshold, knobs in _other_plans(model, config, budget):
        peak = tried[threshold] if threshold in tried else _finished_peak(sim, knobs)
        lowest = min(lowest, peak)
        if peak <= budget:
            return knobs, peak
    return None, lowest


def _other_plans(model: GraphModel, config: LMSConfig, budget: int) -> list[tuple[int, LMSConfig]]:
    """``(threshold, tuned knobs)`` of the plans :func:`_finish_other_knobs` finishes, in its order:
    each threshold with the latest prefetch and ``config``'s grouping, all of its candidates, the
    fewest swaps first, one threshold per set of swaps."""
    seen: set[tuple[Swap, ...]] = set()
    eligible = _eligible(model, config)
    plans = []
    for threshold in reversed(_thresholds(_swaps(model, _knobs(config, 0, 1, 0), eligible))):
        swaps = _swaps(model, _knobs(config, threshold, 1, config.knobs.swapin_groupby), eligible)
        if not swaps or tuple(swaps) in seen:
            continue
        seen.add(tuple(swaps))
        plans.append((threshold, _tuned(config, budget, threshold, 1, config.knobs.swapin_groupby, len(swaps))))
    return plans


def _first_fit(
    model: GraphModel, config: LMSConfig, sim: Simulator, budget: int, first: Sequence[int], tried: dict[int, int]
) -> LMSConfig | None:
    """The knobs of the first plan of step 5 among the thresholds ``first`` whose finished peak fits
    ``budget``, where :func:`serialized_search` without ``first`` would reach step 5 if nothing before
    it fitted; else None. Each finished peak goes into ``tried`` (threshold -> peak).

    Step 5 finishes these same plans on the same ``sim`` (:func:`_other_plans`), so a plan that fits
    here fits there, and a search that finds nothing before step 5 gets there unless the lowest plan
    of step 2 is the plain step (:func:`_step2_beats_plain`)."""
    plans = dict(_other_plans(model, config, budget))
    for threshold in dict.fromkeys(first):
        if threshold not in plans or threshold in tried:
            continue
        tried[threshold] = _finished_peak(sim, plans[threshold])
        if tried[threshold] <= budget and (sim.peak() <= budget or _step2_beats_plain(model, config, sim)):
            return plans[threshold]
    return None


def _step2_beats_plain(model: GraphModel, config: LMSConfig, sim: Simulator) -> bool:
    """Whether the lowest plan of :func:`_search` (step 2) has swaps: whether one of the prefixes
    it checks accurately when nothing fits (the ends of each grid entry's lowest fast peaks, and all
    candidates for ``config``'s own knobs) has a predicted peak below the plain step's. Those are
    checked in an order of their own, stopping at the first."""
    plain = sim.peak()
    own = _own_knobs(config)
    for threshold, ahead, groupby, swaps in _grid_entries(model, config, _eligible(model, config)):
        peaks = sim.prefix_peaks(swaps)
        ends = {int(np.argmin(peaks)), len(peaks) - 1 - int(np.argmin(peaks[::-1]))}
        if (threshold, ahead, groupby) == own:
            ends.add(len(swaps))
        for n in sorted(ends):
            if peaks[n] < plain and sim.peak(swaps[:n], above=plain) < plain:
                return True
    return False


def _finished_peak(sim: Simulator, config: LMSConfig) -> int:
    """The predicted peak of the plan ``make_plan`` makes with the tuned ``config`` on ``sim``'s step."""
    from .candidates import candidate_swaps
    from .passes.schedule import finish

    swaps = sorted(candidate_swaps(sim.model, config)[: config.knobs.n_tensors], key=lambda s: (s.level, s.tensor))
    swaps, _, finished = finish(sim, swaps, config)
    return finished.peak(swaps)


def tune(model: GraphModel, config: LMSConfig, sim: Simulator | None = None, *, plain: int | None = None) -> LMSConfig:
    """``config`` with the swap knobs chosen for ``config.budget`` (see module doc).

    Raises :class:`BudgetError` (with the lowest predicted peak the search saw)
    when no plan of the search fits. It adds no ordering edges (``serialize``): see
    :func:`tune_ordered`, which :func:`tflms.make_plan` uses. ``plain``: the predicted peak the
    error quotes as the step's without LMS (default: ``model``'s).
    """
    if config.budget is None:
        raise ValueError("tune needs a budget. Received: budget=None")
    sim = sim or Simulator(model, config.host)
    tuned, lowest, *_ = _search(model, config, sim, config.budget)
    if tuned is None:
        raise BudgetError(config.budget, lowest, sim.peak() if plain is None else plain)
    return tuned


def tune_ordered(
    model: GraphModel, config: LMSConfig, sim: Simulator | None = None, *, plain: int | None = None
) -> tuple[LMSConfig, tuple[Order, ...], Simulator]:
    """:func:`tune`, and with ``config.knobs.serialize`` ordering edges first where no plan fits without them.

    When the search finds no plan within the budget, ``serialize=True`` orders the backward
    pass for the lowest plan it saw (:func:`tflms.plan.passes.schedule.memory_orders`) and searches again
    on the step with those orders; if that fails too, the tuned config may be the lowest plan's,
    which fits once ``make_plan`` has triggered some of its swap-ins later
    (:func:`tflms.plan.passes.schedule.late_triggers`; step 5 of the module doc). Returns ``(tuned config,
    orders, simulator of the step with the orders)`` (its ``.model``); ``orders`` is ``()`` (and
    the simulator ``sim``, or a new one of ``model``) when the budget was met without them.
    Raises :class:`BudgetError` as :func:`tune` does. ``plain``: the predicted peak the error
    quotes as the step's without LMS (default: ``model``'s); :func:`tflms.make_plan`, which tunes
    the step its passes made, passes the peak of the step as given, its plan's ``peak_bytes_before``.
    """
    if config.budget is None:
        raise ValueError("tune needs a budget. Received: budget=None")
    sim = sim or Simulator(model, config.host)
    tuned, lowest, orders, ordered_sim, best = serialized_search(model, config, sim, config.budget)
    if tuned is None:
        err = BudgetError(config.budget, lowest, sim.peak() if plain is None else plain)
        if config.on_budget_miss == "raise" or best is None:
            raise err
        knobs, orders, ordered_sim = best
        if knobs is None:  # the plain step was the lowest
            knobs = config.with_knobs(n_tensors=0)
        warnings.warn(
            f"{err} on_budget_miss='best': planning with the lowest plan the search found "
            f"(swapout_threshold={knobs.knobs.swapout_threshold}, swapin_groupby={knobs.knobs.swapin_groupby}, "
            f"n_tensors={knobs.knobs.n_tensors}); the step may run out of device memory.",
            LMSWarning,
            stacklevel=2,
        )
        return knobs, orders, ordered_sim
    return tuned.replace(on_budget_miss="raise"), orders, ordered_sim
