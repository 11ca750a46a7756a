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
   combination with the least predicted link time wins (:func:`tflms.plan.link_seconds`:
   each swap-out and swap-in costs ``link_latency + bytes / link_bandwidth``), ties
   going to fewer tensors, then larger thresholds and groups. If none fits,
   :class:`BudgetError` carries the lowest predicted peak of all those prefixes.
   Swapping more is not always lower (a tensor read by several backward ops gets
   one swap-in copy per consumer group, and overlapping copies can cost more
   than the device copy they replace), so no prefix is assumed best.
3. With those fixed, the largest ``swapin_ahead`` (earliest prefetch) that still
   fits is kept.
4. With ``serialize=True`` (:func:`tune_ordered`, what ``make_plan`` and
   :func:`max_batch_size` use), when nothing fits: ordering edges for the lowest plan
   of step 2 (:func:`tflms.schedule.memory_orders`), then steps 1-3 again on the step
   with those orders.
5. Still with ``serialize=True``, when nothing fits after step 4: the lowest plan as
   ``make_plan`` finishes it (its own ordering edges, then later triggers for the swap-ins
   that arrive by the peak and are read after it: :func:`tflms.schedule.late_triggers`, and
   orders that make room for more of them); its knobs are the tuned ones if that fits. If
   it does not, the plans of each threshold (latest prefetch, the config's grouping, all
   candidates) finished the same way on the step without step 4's orders, fewest swaps
   first: the first that fits wins.

A plan fits when its predicted peak is within the budget. With ``on_budget_miss='best'`` a
budget that nothing fits gets a warning (:class:`tflms.LMSWarning`, with the lowest predicted
peak) and the lowest plan of steps 2-4 instead of :class:`BudgetError`.

Every number is a simulator prediction (:mod:`tflms.simulator`). The chosen
values are recorded in the plan's options, so ``make_plan`` with them (and no
budget) reproduces the plan, except one that needed step 4 or 5: its JSON (orders and
swaps) reproduces it, and so do its options with the budget.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .candidates import _eligible, _swaps
from .config import LMSConfig, check_int, parse_bytes
from .errors import BudgetError, LMSWarning
from .graph import GraphModel, TensorInfo, with_orders
from .plan import Order, Swap, format_sizes, link_seconds
from .simulator import Simulator

__all__ = [
    "tune",
    "tune_ordered",
    "prepare",
    "max_batch_size",
    "keras_train_step",
    "keras_step_source",
    "BatchSizeResult",
    "THRESHOLDS",
    "GROUPBYS",
    "AHEADS",
]

THRESHOLDS = (0, 5, 10, 20, 40, 80, 160, 320, 640, 1280)
GROUPBYS = (0, 5, 20, 80)
AHEADS = (64, 32, 16, 8, 4, 2, 1)


def _knobs(config: LMSConfig, threshold: int, ahead: int, groupby: int) -> LMSConfig:
    return dataclasses.replace(
        config, budget=None, n_tensors=None, swapout_threshold=threshold, swapin_ahead=ahead, swapin_groupby=groupby
    )


def _own_knobs(config: LMSConfig) -> tuple[int, int, int]:
    """``config``'s (threshold, ahead, groupby): the grid entry of the plan ``make_plan`` gives without a budget."""
    return config.swapout_threshold, config.swapin_ahead, config.swapin_groupby


def _thresholds(everything: list[Swap]) -> list[int]:
    """The grid's thresholds: those of :data:`THRESHOLDS` below the largest distance of
    ``everything`` (the swaps of threshold 0), where each leaves some swap."""
    max_distance = max((s.distance for s in everything), default=0)
    return [t for t in THRESHOLDS if t < max_distance]


def _grid(model: GraphModel, config: LMSConfig, eligible: list[TensorInfo]) -> list[tuple[int, int, int, list[Swap]]]:
    """(threshold, ahead, groupby, the candidate swaps) of the search grid: each threshold and
    groupby with the latest prefetch (``ahead=1``), and ``config``'s own three knobs.
    ``eligible``: the tensors ``config`` lets be swapped (the knobs do not change them)."""
    everything = _swaps(model, _knobs(config, 0, 1, 0), eligible)
    grid = []
    for threshold in _thresholds(everything):
        for groupby in GROUPBYS:
            swaps = (
                everything
                if threshold == 0 and groupby == 0
                else _swaps(model, _knobs(config, threshold, 1, groupby), eligible)
            )
            if swaps:
                grid.append((threshold, 1, groupby, swaps))
    own = _own_knobs(config)
    if own not in {entry[:3] for entry in grid}:
        swaps = _swaps(model, _knobs(config, *own), eligible)
        if swaps:
            grid.append((*own, swaps))
    return grid


def _search(
    model: GraphModel, config: LMSConfig, sim: Simulator, budget: int
) -> tuple[LMSConfig | None, int, list[Swap], LMSConfig | None]:
    """(tuned config or None when nothing fits, lowest predicted peak the search saw, the swaps
    of that lowest plan when nothing fits, else ``[]``, and the knobs of those swaps then, else None).

    The grid is searched with the fast requested-bytes peaks (:meth:`Simulator.prefix_peaks`,
    a lower bound of :meth:`Simulator.peak`); the candidates it finds are then checked
    with the allocator-accurate :meth:`Simulator.peak`, best key first.
    """
    lowest = sim.peak()
    if lowest <= budget:
        return dataclasses.replace(config, budget=budget, n_tensors=0), lowest, [], None
    candidates: set[tuple[tuple[float, int, int, int, int], tuple[int, int, int], int]] = set()
    deepest: list[tuple[int, tuple[int, int, int], int]] = []  # (fast peak, knobs, n): the lowest prefixes
    grid = {}
    own = _own_knobs(config)
    eligible = _eligible(model, config)
    for threshold, ahead, groupby, swaps in _grid(model, config, eligible):
        knobs = (threshold, ahead, groupby)
        grid[knobs] = swaps
        peaks = sim.prefix_peaks(swaps)
        # The fast peaks often stay at their minimum over many prefixes while the accurate ones
        # differ (ResNet50 96² b32, default knobs: 508.5 MiB at the first of them, 495.8 at
        # the last), so both ends of that plateau are tried.
        ends = {int(np.argmin(peaks)), len(peaks) - 1 - int(np.argmin(peaks[::-1]))}
        if knobs == own:  # the plan make_plan gives for these knobs without a budget
            ends.add(len(swaps))
        deepest += [(int(peaks[n]), knobs, n) for n in sorted(ends)]
        fitting = np.flatnonzero(peaks <= budget)
        for n in {int(fitting[0]), *ends} if len(fitting) else ():
            if peaks[n] <= budget:
                cost = link_seconds(swaps[:n], config.link_bandwidth, config.link_latency)
                candidates.add(((cost, n, -threshold, -groupby, ahead), knobs, n))
    best = None
    for _key, knobs, n in sorted(candidates):
        if _fits(sim, grid[knobs][:n], budget):
            best = (knobs, n)
            break
    if best is None:
        # The lowest accurate peak among the deepest prefixes of each grid entry (best fast peaks
        # first); the one-step emulation is a lower bound of it, cheaper to compute.
        lowest_swaps: list[Swap] = []
        lowest_knobs = None
        for fast, knobs, n in sorted(deepest):
            if fast >= lowest:
                break
            if sim.peak(grid[knobs][:n], steps=1, above=lowest) >= lowest:
                continue
            peak = sim.peak(grid[knobs][:n], above=lowest)
            if peak < lowest:
                lowest, lowest_swaps, lowest_knobs = peak, grid[knobs][:n], _tuned(config, budget, *knobs, n)
        return None, lowest, lowest_swaps, lowest_knobs
    (threshold, fitted, groupby), n = best
    # Earliest prefetch first; the last one tried is the one that fitted above.
    for ahead in sorted({a for a in AHEADS if a > fitted} | {fitted}, reverse=True):
        if _fits(sim, _swaps(model, _knobs(config, threshold, ahead, groupby), eligible)[:n], budget):
            break
    return _tuned(config, budget, threshold, ahead, groupby, n), lowest, [], None


def _tuned(config: LMSConfig, budget: int, threshold: int, ahead: int, groupby: int, n: int) -> LMSConfig:
    return dataclasses.replace(
        config, budget=budget, swapout_threshold=threshold, swapin_ahead=ahead, swapin_groupby=groupby, n_tensors=n
    )


def prepare(
    model: GraphModel, config: LMSConfig, sim: Simulator
) -> tuple[GraphModel, Simulator, list, list, list, tuple]:
    """The step that swaps are planned on: ``model`` with ``config``'s split sums, left-out
    tiles, planned recomputes and update orders applied, in that order (see :mod:`tflms.planner`).
    Returns ``(model, a simulator of it, sums, tiles, recomputes, orders)``; ``sim`` is ``model``'s and is
    returned when nothing changed. :func:`tflms.make_plan`, :func:`max_batch_size` and the
    capacity benchmark plan on it."""
    sums: list = []
    if config.split_sums:
        from .sums import with_split_sums

        model, sums = with_split_sums(model)
        if sums:
            sim = Simulator(model, config.host)
    tiles: list = []
    if config.drop_tiles:
        from .tiles import with_dropped_tiles

        model, tiles = with_dropped_tiles(model)
        if tiles:
            sim = Simulator(model, config.host)
    recomputes: list = []
    if config.recompute:
        from .recompute import with_planned_recomputes

        model, recomputes = with_planned_recomputes(model, config)
        if recomputes:
            sim = Simulator(model, config.host)
    orders: tuple = ()
    if config.order_updates:  # every variable update waits for the reads of it still held
        from .schedule import _with_update_orders

        model, orders, sim = _with_update_orders(model, sim)
    return model, sim, sums, tiles, recomputes, orders


def _fits(sim: Simulator, swaps: list[Swap], budget: int) -> bool:
    """Whether the predicted peak of ``swaps`` is within ``budget``: the one-step emulation
    first, a lower bound (:meth:`Simulator.peak`), so that most misses cost one step."""
    return sim.peak(swaps, steps=1, above=budget) <= budget and sim.peak(swaps, above=budget) <= budget


#: The lowest plan of a search that found none within the budget: ``(knobs, orders, simulator)``.
_Lowest = tuple[LMSConfig | None, tuple[Order, ...], Simulator]


def _serialized_search(
    model: GraphModel, config: LMSConfig, sim: Simulator, budget: int
) -> tuple[LMSConfig | None, int, tuple[Order, ...], Simulator, _Lowest | None]:
    """:func:`_search`, and with ``config.serialize``, when no plan fits: ordering edges for the
    lowest plan (:func:`tflms.schedule.memory_orders`), then the search again on the step with them
    (step 4 of the module doc), then step 5: the lowest plan as ``make_plan`` finishes it
    (:func:`tflms.schedule.finish`, with late triggers), then other plans finished
    (:func:`_finish_other_knobs`; their orders are ``()`` and their simulator ``sim``).

    Returns ``(tuned config or None, lowest predicted peak seen, orders, simulator, lowest)``: the
    orders are ``()`` and the simulator ``sim`` unless the search needed them (then it is the
    ordered step's). The orders and triggers of step 5 are not among them: ``make_plan`` makes
    them again from the tuned config. ``lowest``, when nothing fits: ``(knobs, orders, simulator)``
    of the lowest plan of steps 2-4 (knobs None: the plain step was the lowest), which
    ``on_budget_miss='best'`` plans with; None when a plan fits.
    """
    tuned, lowest, lowest_swaps, lowest_knobs = _search(model, config, sim, budget)
    if tuned is not None or not config.serialize or not lowest_swaps:
        return tuned, lowest, (), sim, (lowest_knobs, (), sim)
    from .schedule import _memory_orders

    orders, ordered_sim = _memory_orders(sim, lowest_swaps)
    if orders:
        ordered = with_orders(model, orders)  # levels recomputed: the search's candidates read them
        ordered_sim = ordered_sim._of(ordered)  # noqa: SLF001 (the search's simulator, of the same step)
        tuned, ordered_lowest, ordered_swaps, ordered_knobs = _search(ordered, config, ordered_sim, budget)
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
    other_knobs, other = _finish_other_knobs(model, config, sim, budget)
    if other_knobs is not None:
        return other_knobs, min(lowest, other), (), sim, None
    return None, min(lowest, other), orders, ordered_sim, (lowest_knobs, orders, ordered_sim)


def _finish_other_knobs(
    model: GraphModel, config: LMSConfig, sim: Simulator, budget: int
) -> tuple[LMSConfig | None, float]:
    """Step 5 for the other plans of the grid, on the step without step 4's orders: each
    threshold with the latest prefetch and ``config``'s grouping, all of its candidates, the
    fewest swaps first. ``(the first knobs whose finished plan fits or None, the lowest
    finished peak, inf where there was no plan)``.

    Step 5 finishes the plan that was lowest before it, but which plan is lowest once finished
    is another matter: ResNet50 224² at batch 1,424 (``swap_gradients``, ``split_sums``,
    ``drop_tiles``, 16 GiB, one process on a CPU), the lowest plan of step 4 finished at 18.1
    GiB, and the plan of threshold 320 on the step without step 4's orders at 14.9 GiB
    (predicted)."""
    lowest = math.inf
    seen: set[tuple[Swap, ...]] = set()
    eligible = _eligible(model, config)
    for threshold in reversed(_thresholds(_swaps(model, _knobs(config, 0, 1, 0), eligible))):
        swaps = _swaps(model, _knobs(config, threshold, 1, config.swapin_groupby), eligible)
        if not swaps or tuple(swaps) in seen:
            continue
        seen.add(tuple(swaps))
        knobs = _tuned(config, budget, threshold, 1, config.swapin_groupby, len(swaps))
        peak = _finished_peak(sim, knobs)
        lowest = min(lowest, peak)
        if peak <= budget:
            return knobs, peak
    return None, lowest


def _finished_peak(sim: Simulator, config: LMSConfig) -> int:
    """The predicted peak of the plan ``make_plan`` makes with the tuned ``config`` on ``sim``'s step."""
    from .candidates import candidate_swaps
    from .schedule import finish

    swaps = sorted(candidate_swaps(sim.model, config)[: config.n_tensors], key=lambda s: (s.level, s.tensor))
    swaps, _, finished = finish(sim, swaps, config)
    return finished.peak(swaps)


def tune(model: GraphModel, config: LMSConfig, sim: Simulator | None = None) -> LMSConfig:
    """``config`` with the swap knobs chosen for ``config.budget`` (see module doc).

    Raises :class:`BudgetError` (with the lowest predicted peak the search saw)
    when no plan of the search fits. It adds no ordering edges (``serialize``): see
    :func:`tune_ordered`, which :func:`tflms.make_plan` uses.
    """
    if config.budget is None:
        raise ValueError("tune needs a budget. Received: budget=None")
    sim = sim or Simulator(model, config.host)
    tuned, lowest, *_ = _search(model, config, sim, config.budget)
    if tuned is None:
        raise BudgetError(config.budget, lowest, sim.peak())
    return tuned


def tune_ordered(
    model: GraphModel, config: LMSConfig, sim: Simulator | None = None
) -> tuple[LMSConfig, tuple[Order, ...], Simulator]:
    """:func:`tune`, and with ``config.serialize`` ordering edges first where no plan fits without them.

    When the search finds no plan within the budget, ``serialize=True`` orders the backward
    pass for the lowest plan it saw (:func:`tflms.schedule.memory_orders`) and searches again
    on the step with those orders; if that fails too, the tuned config may be the lowest plan's,
    which fits once ``make_plan`` has triggered some of its swap-ins later
    (:func:`tflms.schedule.late_triggers`; step 5 of the module doc). Returns ``(tuned config,
    orders, simulator of the step with the orders)`` (its ``.model``); ``orders`` is ``()`` (and
    the simulator ``sim``, or a new one of ``model``) when the budget was met without them.
    Raises :class:`BudgetError` as :func:`tune` does.
    """
    if config.budget is None:
        raise ValueError("tune needs a budget. Received: budget=None")
    sim = sim or Simulator(model, config.host)
    tuned, lowest, orders, ordered_sim, best = _serialized_search(model, config, sim, config.budget)
    if tuned is None:
        err = BudgetError(config.budget, lowest, sim.peak())
        if config.on_budget_miss == "raise" or best is None:
            raise err
        knobs, orders, ordered_sim = best
        if knobs is None:  # the plain step was the lowest
            knobs = dataclasses.replace(config, budget=config.budget, n_tensors=0)
        warnings.warn(
            f"{err} on_budget_miss='best': planning with the lowest plan the search found "
            f"(swapout_threshold={knobs.swapout_threshold}, swapin_groupby={knobs.swapin_groupby}, "
            f"n_tensors={knobs.n_tensors}); the step may run out of device memory.",
            LMSWarning,
            stacklevel=2,
        )
        return knobs, orders, ordered_sim
    return dataclasses.replace(tuned, on_budget_miss="raise"), orders, ordered_sim


@dataclasses.dataclass(frozen=True)
class BatchSizeResult:
    """Largest batch sizes whose *predicted* (simulator) peak fits ``budget``.

    A size of 0 means even batch 1 does not fit; ``limit`` means the search stopped there.
    ``bound`` (with ``max_batch_size(..., bound=True)``, else ``None``): the largest batch
    whose :meth:`~tflms.simulator.Simulator.floor` fits, beyond which no plan of swaps,
    recomputes and orders can fit (the largest single op's working set no longer does).
    """

    budget: int
    without_lms: int
    with_lms: int
    limit: int
    bound: int | None = None

    @property
    def ratio(self) -> float | None:
        return self.with_lms / self.without_lms if self.without_lms else None

    def __str__(self) -> str:
        ratio = f" (x{self.ratio:.1f})" if self.ratio else ""
        cap = lambda b: f">={b}" if b >= self.limit else str(b)  # noqa: E731
        # Both unit systems: "16 GB" (powers of 10) and "16 GiB" (powers of 2) differ by 7%.
        size = format_sizes(self.budget)
        bound = "" if self.bound is None else f"; no plan fits past {cap(self.bound)} (one op's working set)"
        return (
            f"largest batch within {size} (simulator prediction): "
            f"{cap(self.without_lms)} without LMS, {cap(self.with_lms)} with LMS{ratio}{bound}"
        )


def largest_fitting(fits: Callable[[int], bool], limit: int, rel_tol: float = 0.0, start: int = 1) -> int:
    """Largest b in [1, limit] with ``fits(b)``, for a monotone predicate; 0 if none.

    The search starts at ``start`` (a guess: it doubles up or halves down from
    there, then bisects), so a good guess saves evaluations when each one is costly
    (a measured run). With ``rel_tol`` > 0 the bisection stops once the bracket is
    within that fraction of the lower end (the result is then a lower bound, that close).

    >>> largest_fitting(lambda b: b * b <= 1000, limit=100)
    31
    >>> largest_fitting(lambda b: b <= 40, limit=100, start=64), largest_fitting(lambda b: False, 100)
    (40, 0)
    """
    lo, hi = 0, limit + 1  # lo fits (0: nothing known), hi does not
    b = max(1, min(start, limit))
    if fits(b):
        lo = b
        while lo * 2 <= limit and fits(lo * 2):
            lo *= 2
        hi = min(lo * 2, limit + 1)
    else:
        hi = b
        while hi > 1 and not fits(hi // 2):
            hi //= 2
        if hi == 1:
            return 0
        lo = hi // 2
    while hi - lo > max(1, int(lo * rel_tol)):
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def max_batch_size(
    step: Any,
    budget: int | str | None = None,
    *,
    config: LMSConfig | None = None,
    limit: int = 1 << 16,
    rel_tol: float = 0.0,
    bound: bool = False,
    **options: Any,
) -> BatchSizeResult:
    """Largest batch whose predicted device peak fits ``budget``, without and with LMS.

    ``step`` is one of:

    * a ConcreteFunction traced with an unknown (``None``) batch dimension: sizes
      are re-estimated per batch with the ``batch_size`` rule, no retracing;
    * a compiled ``keras.Model`` (loss and optimizer set): its training step is
      traced once with an unknown batch dimension (see :func:`keras_train_step`), or per
      batch with static shapes where that trace leaves the size of a forward tensor
      unknown (a ``Dense`` on a 3-D input reshapes it to ``(None, None)``, which no plan
      can swap: its size would be a guess);
    * a callable ``factory(batch_size) -> ConcreteFunction`` (retraced per size).

    "With LMS" means the autotuner (:func:`tune`) finds a plan that fits (with
    ``recompute=True``: on the model with the recomputes applied, as :func:`tflms.make_plan` does;
    with ``serialize=True``: with ordering edges where it needs them, see :func:`tune_ordered`).
    ``budget`` may also come from ``config.budget`` (or ``budget=`` among the
    options); naming two different budgets is an error.
    ``rel_tol`` > 0 trades exactness for fewer evaluations: each result is then a
    size that fits, within that fraction below the true largest one.
    ``bound=True`` also searches ``result.bound``, the largest batch at which the step's
    :meth:`~tflms.simulator.Simulator.floor` (the variables and its largest single-op working
    set) fits: an upper limit of what any plan can reach, so the gap to ``with_lms`` is what
    better planning could still gain. It is searched exactly (``rel_tol`` does not apply: a
    bound must not be an underestimate), tracing or estimating the step at larger batches.

    Example (a small CNN; the figures are the simulator's):
        >>> import tflms
        >>> from tflms.measure import build
        >>> model = build("cnn", batch=1, size=32)[0]
        >>> model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", jit_compile=False)
        >>> r = tflms.max_batch_size(model, "64MiB", rel_tol=0.05, bound=True)
        >>> print(r)  # doctest: +ELLIPSIS
        largest batch within 64.0 MiB = 67.1 MB (simulator prediction): ... without LMS, ... with LMS (x...); no plan...
        >>> r.without_lms < r.with_lms <= r.bound
        True
    """
    from ._util import paused_gc

    cfg = LMSConfig.from_options(config, **options)
    if budget is None:
        if cfg.budget is None:
            raise ValueError("max_batch_size needs a budget: pass budget='16GiB' (or set it in config).")
        budget = cfg.budget
    budget = parse_bytes(budget, "budget")
    if cfg.budget is not None and cfg.budget != budget:
        raise ValueError(
            f"max_batch_size got two budgets: budget={budget} and config.budget={cfg.budget}. "
            "Pass one of them (or the same value)."
        )
    _check_limit(limit)
    if not isinstance(bound, bool):
        raise ValueError(f"bound must be True or False. Received: bound={bound!r}")
    graph_of = _graph_source(step)
    planned_of = graph_of  # the step the plans are made on (and the bound searched on)
    if cfg.split_sums:
        from .sums import with_split_sums

        planned_of = lambda batch: with_split_sums(graph_of(batch))[0]  # noqa: E731
    if cfg.drop_tiles:
        from .tiles import with_dropped_tiles

        planned_of = lambda batch, split=planned_of: with_dropped_tiles(split(batch))[0]  # noqa: E731
    cache: dict[int, tuple[bool, bool]] = {}

    def fits(batch: int) -> tuple[bool, bool]:
        """(plain step fits, some plan of the autotuner fits) at this batch size."""
        if batch not in cache:
            with paused_gc():
                model = graph_of(batch)
                sim = Simulator(model, cfg.host)
                plain = sim.peak() <= budget
                if not plain:  # the step make_plan plans on
                    model, sim, *_ = prepare(model, cfg, sim)
                cache[batch] = (plain, plain or _serialized_search(model, cfg, sim, budget)[0] is not None)
        return cache[batch]

    without = largest_fitting(lambda b: fits(b)[0], limit, rel_tol)
    with_lms = largest_fitting(lambda b: fits(b)[1], limit, rel_tol)
    return BatchSizeResult(
        budget=budget,
        without_lms=without,
        with_lms=with_lms,
        limit=limit,
        bound=_bound(planned_of, budget, cfg.host, limit, with_lms) if bound else None,
    )


def batch_bound(step: Any, budget: int | str, *, host: str | None = None, limit: int = 1 << 16, start: int = 1) -> int:
    """Largest batch at which ``step``'s :meth:`~tflms.simulator.Simulator.floor` fits ``budget``
    (``limit`` if it still fits there, 0 if not even batch 1): past it no plan fits.

    ``step`` as for :func:`max_batch_size`; ``host`` the plan's host (ops placed there
    allocate no device memory); ``start`` a guess to search from (e.g. ``with_lms``).
    :func:`max_batch_size` with ``bound=True`` returns it as ``result.bound``.
    """
    budget = parse_bytes(budget, "budget")
    _check_limit(limit)
    return _bound(_graph_source(step), budget, host, limit, start)


def _bound(graph_of: Callable[[int], GraphModel], budget: int, host: str | None, limit: int, start: int) -> int:
    from ._util import paused_gc

    def floor_fits(batch: int) -> bool:
        with paused_gc():
            return Simulator(graph_of(batch), host).floor()[0] <= budget

    return largest_fitting(floor_fits, limit, start=max(1, start))


def keras_step_source(model: Any, step: Any, label_shape: Any = None, label_dtype: Any = None) -> Any:
    """What to size a Keras model's training step by per batch: ``step`` (its
    :func:`keras_train_step`, traced with an unknown batch), or a ``factory(batch) ->
    ConcreteFunction`` tracing it with static shapes where the batch does not tell the size of
    a forward tensor. Plans could not swap such a tensor: a ``Dense`` on a 3-D input reshapes
    it to ``(None, None)``, and the product's leading dimension is batch x sequence.
    """
    traced = GraphModel.from_func_graph(step.graph)
    if all(_batch_sized(traced, t) for t in traced.tensors.values() if traced.phase(t.op) == "forward"):
        return step
    return lambda batch: keras_train_step(model, label_shape, label_dtype, batch_size=batch)


def _batch_sized(model: GraphModel, t: Any) -> bool:
    """True when the batch size tells ``t``'s size: its dimensions other than the leading one are static
    (tensors of no data, such as resources, count as sized), and it is not a ``Reshape`` that changes
    the elements per row of an unknown leading dimension (``reshape(t, (-1, C))`` of a ``(None, H, W,
    C)`` tensor gives ``(None, C)``: batch x H x W rows)."""
    if t.dtype in ("resource", "variant", "string"):
        return True
    if t.shape is None or None in t.shape[1:]:
        return False
    if t.shape and t.shape[0] is None and model.dag.nodes[t.op]["type"] == "Reshape":
        source = model.tensors[model.inputs_of[t.op][0]]
        if source.shape is None or not source.shape or source.shape[0] is not None or None in source.shape[1:]:
            return False
        return math.prod(source.shape[1:]) == math.prod(t.shape[1:])
    return True


def _check_limit(limit: Any) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be an integer >= 1. Received: limit={limit!r}")


def _graph_source(step: Any) -> Callable[[int], GraphModel]:
    import keras

    from . import _tf_internal as tfi

    if isinstance(step, keras.Model):
        step = keras_step_source(step, keras_train_step(step))
    if isinstance(step, tfi.ConcreteFunction):
        graph = step.graph
        return lambda batch: GraphModel.from_func_graph(graph, batch_size=batch)
    if callable(step):
        return lambda batch: GraphModel.from_func_graph(step(batch).graph, batch_size=batch)
    raise TypeError(
        "step must be a ConcreteFunction, a compiled keras.Model or a callable batch_size -> "
        f"ConcreteFunction. Received: step={step!r}"
    )


def keras_train_step(
    model: Any,
    label_shape: Sequence[int | None] | None = None,
    label_dtype: str | None = None,
    batch_size: int | None = None,
) -> Any:
    """The training step of a compiled Keras model, traced with an unknown batch size
    (or with ``batch_size``: every shape static).

    Inputs: every input of the model (``model.inputs``, in the structure the model
    takes them: one tensor, a list or a dict), with its shape and dtype. Labels: one
    per model output, in the outputs' structure, derived from the output and its
    loss: the output's shape as float32, or, for a sparse loss (e.g.
    ``sparse_categorical_crossentropy``), integer class ids (int32) shaped like the
    output without its last axis: ``(batch,)`` for a classifier, ``(batch, H, W)``
    for a per-pixel segmentation loss. ``label_shape`` (without the batch axis) and
    ``label_dtype`` override that for a model with one output.

    Raises ``ValueError`` for a model that is not compiled (with an optimizer and a
    loss), a model without known inputs (a subclassed model that was never built on
    ``keras.Input``), or bad ``label_shape``/``label_dtype``; ``TypeError`` when
    ``model`` is no ``keras.Model``.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Conv2D(8, 3), keras.layers.Flatten(),
        ...                           keras.layers.Dense(10)])
        >>> model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        >>> cf = keras_train_step(model)
        >>> [(s.shape.as_list(), s.dtype.name) for s in cf.structured_input_signature[0]]
        [([None, 32, 32, 3], 'float32'), ([None], 'int32')]
    """
    import keras
    import tensorflow as tf

    if not isinstance(model, keras.Model):
        raise TypeError(f"model must be a compiled keras.Model. Received: model={model!r}")
    name = model.name
    if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
        raise ValueError(
            f"The Keras model {name!r} is not compiled: compile it first with an optimizer and a loss, e.g. "
            f"model.compile(optimizer='adam', loss='sparse_categorical_crossentropy'). Received: model={name!r} "
            "(not compiled)"
        )
    if getattr(model, "loss", None) is None:
        raise ValueError(
            f"The Keras model {name!r} was compiled without a loss: compile it with one, e.g. "
            f"model.compile(optimizer='adam', loss='mse'). Received: model={name!r} (loss=None)"
        )
    x_struct = _keras_structure(model, "inputs")
    y_struct = _keras_structure(model, "outputs")
    if x_struct is None or y_struct is None:
        raise ValueError(
            f"The Keras model {name!r} has no known inputs and outputs (a subclassed model, or a Sequential "
            "model without keras.Input): tflms reads the input shapes from model.inputs. Start the model with "
            "keras.Input(shape), or pass a ConcreteFunction of your training step traced with an unknown batch "
            f"dimension. Received: model={name!r} of class {type(model).__name__}"
        )
    outputs = keras.tree.flatten(y_struct)
    if (label_shape is not None or label_dtype is not None) and len(outputs) != 1:
        raise ValueError(
            f"label_shape and label_dtype apply to a model with one output; the model {name!r} has "
            f"{len(outputs)}, whose labels are derived from each output and its loss. "
            f"Received: label_shape={label_shape!r}, label_dtype={label_dtype!r}"
        )
    if label_shape is not None:
        label_shape = _check_label_shape(label_shape)
    if batch_size is not None:
        check_int("batch_size", batch_size, 1)
    if label_dtype is not None:
        try:
            label_dtype = tf.as_dtype(label_dtype).name
        except TypeError:
            raise ValueError(
                f"label_dtype must be a TensorFlow dtype name such as 'int32' or 'float32'. "
                f"Received: label_dtype={label_dtype!r}"
            ) from None
    losses = _output_losses(model.loss, y_struct, getattr(model, "output_names", None))

    def label_spec(output: Any, loss: Any) -> Any:
        sparse = _is_sparse_loss(loss)
        shape = label_shape if label_shape is not None else tuple(output.shape[1 : -1 if sparse else None])
        dtype = label_dtype or ("int32" if sparse else "float32")
        return tf.TensorSpec((batch_size, *shape), dtype)

    x_spec = keras.tree.map_structure(lambda t: tf.TensorSpec((batch_size, *t.shape[1:]), t.dtype), x_struct)
    y_spec = keras.tree.pack_sequence_as(y_struct, [label_spec(o, loss) for o, loss in zip(outputs, losses)])
    optimizer = model.optimizer
    if not optimizer.built:
        optimizer.build(model.trainable_variables)

    def train_step(x, y):
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            loss = model.compute_loss(x=x, y=y, y_pred=y_pred, training=True)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    try:
        return tf.function(train_step).get_concrete_function(x_spec, y_spec)
    except Exception as err:
        first = " ".join(str(err).split())
        first = first if len(first) <= 300 else first[:297] + "..."
        raise ValueError(
            f"Tracing the training step of the Keras model {name!r} failed with inputs {_specs_text(x_spec)} and "
            f"labels {_specs_text(y_spec)} (derived from the outputs and the loss {_loss_name(model.loss)}): "
            f"{type(err).__name__}: {first} If the loss expects other labels, pass label_shape= and label_dtype= "
            f"(tflms plan: --label-shape, --label-dtype). Received: label_shape={label_shape!r}, "
            f"label_dtype={label_dtype!r}"
        ) from err


def _specs_text(structure: Any) -> str:
    """``(None, 64, 64, 3) float32``, several joined by ', ' (the structure flattened)."""
    import tensorflow as tf

    return ", ".join(f"{tuple(s.shape.as_list())} {s.dtype.name}" for s in tf.nest.flatten(structure))


def _loss_name(loss: Any) -> str:
    if isinstance(loss, (str, dict, list, tuple)):
        return repr(loss) if not isinstance(loss, (dict, list, tuple)) else type(loss).__name__
    return getattr(loss, "__name__", None) or type(loss).__name__


def _keras_structure(model: Any, which: str) -> Any:
    """``model``'s symbolic inputs or outputs in the structure it takes/returns them, or None.

    Functional models keep the structure (one tensor, a list, a dict) in ``_inputs_struct`` /
    ``_outputs_struct``; a Sequential model in its inner Functional; otherwise the flat
    public list (one element: the tensor itself).
    """
    functional = model if hasattr(model, "_inputs_struct") else getattr(model, "_functional", None)
    struct = getattr(functional, f"_{which}_struct", None)
    if struct is not None:
        return struct
    try:
        tensors = list(getattr(model, which))
    except (AttributeError, ValueError, TypeError):
        return None
    return tensors[0] if len(tensors) == 1 else (tensors or None)


def _output_losses(loss: Any, y_struct: Any, output_names: Sequence[str] | None) -> list[Any]:
    """The compiled loss of each output, in ``keras.tree.flatten(y_struct)`` order (None: none)."""
    import keras

    n = len(keras.tree.flatten(y_struct))
    if isinstance(loss, dict):
        if isinstance(y_struct, dict):
            names = sorted(y_struct)  # keras.tree flattens a dict in sorted key order
        else:
            names = list(output_names or [])
        return [loss.get(k) for k in names] if len(names) == n else [None] * n
    if isinstance(loss, (list, tuple)):
        return list(loss) if len(loss) == n else [None] * n
    return [loss] * n


def _is_sparse_loss(loss: Any) -> bool:
    """Whether ``loss`` takes integer class ids (``sparse_categorical_crossentropy`` and friends)."""
    if loss is None:
        return False
    if isinstance(loss, str):
        return "sparse" in loss.lower()
    fn = getattr(loss, "fn", None)  # keras.losses.LossFunctionWrapper
    names = (type(loss).__name__, getattr(loss, "name", ""), getattr(loss, "__name__", ""), getattr(fn, "__name__", ""))
    return any("sparse" in str(n).lower() for n in names)


def _check_label_shape(label_shape: Any) -> tuple[int | None, ...]:
    ok = isinstance(label_shape, Sequence) and not isinstance(label_shape, str)
    ok = ok and all(d is None or (isinstance(d, int) and not isinstance(d, bool) and d >= 1) for d in label_shape)
    if not ok:
        raise ValueError(
            "label_shape must be a sequence of dimensions >= 1 (or None), without the batch axis, e.g. (64, 64) "
            f"or () for one label per sample. Received: label_shape={label_shape!r}"
        )
    return tuple(label_shape)
