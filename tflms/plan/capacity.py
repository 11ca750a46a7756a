"""The capacity search: the largest batch size whose predicted peak fits a budget, with tflms and without."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from .._util import format_sizes, paused_gc
from ..config import LMSConfig, parse_bytes
from ..emulate.simulator import Simulator
from ..ir.graph import GraphModel
from ..ir.trace import graph_source
from .autotune import serialized_search
from .passes.offload import offload_decisions, with_offload
from .registry import prepare

__all__ = ["BatchSizeResult", "batch_bound", "largest_fitting", "max_batch_size", "offloaded"]

#: Progress of the search (one INFO record per batch size tried); ``tflms plan`` shows them.
log = logging.getLogger("tflms")


@dataclasses.dataclass(frozen=True)
class BatchSizeResult:
    """Largest batch sizes whose *predicted* (simulator) peak fits ``budget``.

    A size of 0 means even batch 1 does not fit; ``limit`` means the search stopped there.
    ``bound`` (with ``max_batch_size(..., bound=True)``, else ``None``): the largest batch
    whose :meth:`~tflms.emulate.simulator.Simulator.floor` fits, beyond which no plan of swaps,
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
    :meth:`~tflms.emulate.simulator.Simulator.floor` (the variables and its largest single-op working
    set) fits: an upper limit of what any plan can reach, so the gap to ``with_lms`` is what
    better planning could still gain. It is searched exactly (``rel_tol`` does not apply: a
    bound must not be an underestimate), tracing or estimating the step at larger batches.

    Example (a small CNN; the figures are the simulator's):
        >>> import tflms
        >>> from tflms.testing.zoo import build
        >>> model = build("cnn", batch=1, size=32)[0]
        >>> model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", jit_compile=False)
        >>> r = tflms.max_batch_size(model, "64MiB", rel_tol=0.05, bound=True)
        >>> print(r)  # doctest: +ELLIPSIS
        largest batch within 64.0 MiB = 67.1 MB (simulator prediction): ... without LMS, ... with LMS (x...); no plan...
        >>> r.without_lms < r.with_lms <= r.bound
        True
    """
    cfg = LMSConfig.from_options(config, **options)
    if cfg.budget == "auto":  # no device to read a limit from: the budget argument decides
        cfg = cfg.replace(budget=None)
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
    graph_of = graph_source(step)
    if cfg.offload is not None:  # every size as the step runs with the offload: the update on the host
        traced_of = graph_of
        graph_of = lambda batch: offloaded(traced_of(batch), cfg)  # noqa: E731

    def planned_of(batch: int) -> Simulator:
        """A simulator of the step the bound is searched on: the policy's passes that change what
        the step holds (split sums, tiles left out) applied, as the planner applies them. Those two
        passes read no simulator: one is made of the last step only (``prepare`` without one)."""
        return prepare(graph_of(batch), cfg, None, only=("split_sums", "drop_tiles"))[1]

    plain_fits: dict[int, bool] = {}  # per batch size: the plain step fits
    lms_fits: dict[int, bool] = {}  # per batch size: the plain step or some plan of the autotuner fits
    fitted: list[int] = []  # thresholds of the plans of step 5 that fitted at the last batch sizes, latest first

    plain_peaks: dict[int, int] = {}  # per batch size: the plain step's predicted peak

    def plain_peak(batch: int) -> int:
        """The plain step's predicted peak at this batch size (what :func:`_largest_within` searches on)."""
        if batch not in plain_peaks:
            peak = [0]

            def fits() -> bool:
                peak[0] = Simulator(graph_of(batch), cfg.host).peak()
                return peak[0] <= budget

            plain_fits[batch] = _timed(batch, "without", fits)
            plain_peaks[batch] = peak[0]
        return plain_peaks[batch]

    def fits_without(batch: int) -> bool:
        """Whether the plain step fits at this batch size."""
        if batch not in plain_fits:
            plain_fits[batch] = _timed(
                batch, "without", lambda: Simulator(graph_of(batch), cfg.host).peak(above=budget) <= budget
            )
        return plain_fits[batch]

    def fits_with(batch: int) -> bool:
        """Whether the plain step or some plan of the autotuner fits at this batch size: the
        autotuner's search runs only for the batch sizes the search with LMS asks about, and the
        plain step is checked where no plan fits (or known to fit from the search without LMS)."""
        if batch not in lms_fits and batch <= max((b for b, fit in plain_fits.items() if fit), default=0):
            lms_fits[batch] = True  # the plain step fits there (it fits at a batch at least as large)
        if batch not in lms_fits:

            def some_plan_fits() -> bool:
                model = graph_of(batch)  # made again: the plain step's model is not kept
                # The step make_plan plans on; one simulator, of it (none of the steps before each pass).
                model, sim, *_ = prepare(model, cfg, None)
                if sim.floor()[0] <= budget:  # else no plan's peak is below it: nothing to search
                    # The plans of step 5 that fitted at the last batch sizes are tried first (they
                    # often fit again): the answer is the search's either way (serialized_search's ``first``).
                    tuned, *_, lowest = serialized_search(model, cfg, sim, budget, exists_only=True, first=fitted)
                    if tuned is not None:
                        if lowest is None:  # it fitted only with orders (steps 4 and 5)
                            threshold = tuned.knobs.swapout_threshold
                            fitted[:] = [threshold, *(t for t in fitted if t != threshold)][:3]
                        return True
                return fits_without(batch)

            lms_fits[batch] = _timed(batch, "with", some_plan_fits)
        return lms_fits[batch]

    without = _largest_within(plain_peak, budget, limit, rel_tol, start=32)
    with_lms = largest_fitting(fits_with, limit, rel_tol)
    return BatchSizeResult(
        budget=budget,
        without_lms=without,
        with_lms=with_lms,
        limit=limit,
        bound=_bound(planned_of, budget, limit, with_lms) if bound else None,
    )


def offloaded(model: GraphModel, config: LMSConfig) -> GraphModel:
    """``model`` with ``config.offload`` applied (:func:`tflms.plan.passes.offload.with_offload`): the
    step as :func:`tflms.function` plans it, its update (and with ``"weights"`` the weights) on
    ``config.host``; ``model`` itself when nothing is offloaded.

    Example (the zoo's GPT, Adam): the optimizer's state leaves the device's variables.
        >>> import tensorflow as tf
        >>> import tflms
        >>> from tflms.testing.zoo import train_step
        >>> step, (x, y) = train_step("gpt", batch=2)
        >>> plain = tflms.GraphModel.from_func_graph(tf.function(step).get_concrete_function(x, y).graph)
        >>> offloaded(plain, tflms.LMSConfig(offload="optimizer")).variable_bytes < plain.variable_bytes
        True
    """
    if config.offload is None:
        return model
    return with_offload(model, offload_decisions(model, weights=config.offload == "weights"), config.host)


def batch_bound(step: Any, budget: int | str, *, host: str | None = None, limit: int = 1 << 16, start: int = 1) -> int:
    """Largest batch at which ``step``'s :meth:`~tflms.emulate.simulator.Simulator.floor` fits ``budget``
    (``limit`` if it still fits there, 0 if not even batch 1): past it no plan fits.

    ``step`` as for :func:`max_batch_size`; ``host`` the plan's host (ops placed there
    allocate no device memory); ``start`` a guess to search from (e.g. ``with_lms``).
    :func:`max_batch_size` with ``bound=True`` returns it as ``result.bound``.
    """
    budget = parse_bytes(budget, "budget")
    _check_limit(limit)
    graph_of = graph_source(step)
    return _bound(lambda batch: Simulator(graph_of(batch), host), budget, limit, start)


def _bound(simulator_of: Callable[[int], Simulator], budget: int, limit: int, start: int) -> int:
    """The largest batch whose step (``simulator_of(batch)``, a simulator of it) has a floor within ``budget``."""

    def floor_of(batch: int) -> int:
        with paused_gc():
            floor = simulator_of(batch).floor()[0]
        fits = "fits" if floor <= budget else "does not fit"
        log.info("max_batch_size: batch %d: the largest op's working set %s", batch, fits)
        return floor

    return _largest_within(floor_of, budget, limit, start=max(1, start))


def _largest_within(
    value: Callable[[int], float], budget: int, limit: int, rel_tol: float = 0.0, start: int = 1
) -> int:
    """Largest b in [1, limit] with ``value(b) <= budget``, for a non-decreasing ``value``; 0 if none.

    :func:`largest_fitting` with the values, not only whether they fit: the peaks and floors of a
    step grow almost linearly with its batch size, so each probe is where a line through two known
    values crosses ``budget`` (the last two probes, then the two ends of the bracket of what fits
    and what does not). A probe on the same side as the one before is at least twice as far from
    that side's end as the last step there (a gallop); once both ends are known, two probes that
    did not halve the bracket are followed by a bisection. So the search needs a few probes near a
    line, and at worst (a step function) up to about three times :func:`largest_fitting`'s.
    ``rel_tol`` and ``start`` as there.

    >>> _largest_within(lambda b: 3 * b + 7, budget=1000, limit=4096)
    331
    >>> _largest_within(lambda b: b * b, budget=1000, limit=100, start=64), _largest_within(lambda b: 9, 5, 100)
    (31, 0)
    """
    lo, hi = 0, limit + 1  # lo fits (0: nothing known), hi does not (limit + 1: nothing known)
    known: dict[int, float] = {}
    b, last, gap = max(1, min(start, limit)), None, 1
    mark, slow = None, 0  # the bracket's width when it was last halved; probes since
    while hi - lo > max(1, int(lo * rel_tol)):
        known[b] = v = value(b)
        fits = v <= budget
        if fits:
            lo = b
        else:
            hi = b
        if hi == 1:
            return 0
        gap = gap * 2 if fits == last else 1
        last = fits
        # The line: through the bracket's ends once both are known, else through the last two probes.
        ends = (lo, hi) if lo in known and hi in known else tuple(list(known)[-2:])
        guess = None
        if len(ends) == 2 and known[ends[0]] != known[ends[1]]:
            (b1, v1), (b2, v2) = ((e, known[e]) for e in ends)
            guess = math.floor(b2 + (budget - v2) * (b2 - b1) / (v2 - v1))
        if fits:  # the crossing, or further up than the last step up if the line says less
            guess = max(guess or 0, lo + gap, 2 * lo if hi > limit and len(known) == 1 else 0)
        else:
            guess = min(hi if guess is None else guess, hi - gap, hi // 2 if lo == 0 and len(known) == 1 else hi)
        if 0 < lo and hi <= limit:  # bracketed: bisect after two probes that did not halve it
            if mark is None or hi - lo <= mark // 2:
                mark, slow = hi - lo, 0
            else:
                slow += 1
            if slow >= 2:
                guess = (lo + hi) // 2
        b = min(max(guess, lo + 1), hi - 1, limit)
    return lo


def _check_limit(limit: Any) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be an integer >= 1. Received: limit={limit!r}")


def _timed(batch: int, way: str, fits: Callable[[], bool]) -> bool:
    """``fits()`` with the garbage collector paused, logged with its seconds (``way``: ``"with"``
    or ``"without"`` LMS)."""
    start = time.perf_counter()
    with paused_gc():
        answer = fits()
    log.info(
        "max_batch_size: batch %d %s %s LMS (%.1f s)",
        batch,
        "fits" if answer else "does not fit",
        way,
        time.perf_counter() - start,
    )
    return answer
