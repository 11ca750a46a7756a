"""The capacity search: the largest batch size whose predicted peak fits a budget, with tflms and without."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

from .._util import format_sizes, paused_gc
from ..config import LMSConfig, parse_bytes
from ..emulate.simulator import Simulator
from ..ir.graph import GraphModel
from ..ir.trace import graph_source, keras_step_source, keras_train_step, specs_text
from .autotune import serialized_search
from .passes.offload import offload_decisions, with_offload
from .registry import prepare

__all__ = ["BatchSizeResult", "batch_bound", "largest_fitting", "max_batch_size", "offloaded", "unknown_dims"]

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

    Only the batch (the leading dimension of the step's inputs) may be unknown: a step whose
    inputs leave another dimension unknown (a sequence length: KerasHub's models take
    ``keras.Input(shape=(None,))``) raises ``ValueError`` naming each such input and dimension
    (:func:`unknown_dims`), since sizing them as 1 would answer for a sequence of length 1.
    Trace such a step with concrete shapes: a ConcreteFunction traced with an input signature
    such as ``tf.TensorSpec([None, 128], tf.int32)``, a ``keras.Model`` built on inputs of that
    shape (``keras.Model(inputs, model(inputs))`` with ``inputs = keras.Input(shape=(128,),
    dtype="int32")``, compiled as ``model`` was), or a factory tracing static shapes. A
    ConcreteFunction whose inputs all have a static leading dimension raises ``ValueError``
    too: its batch cannot vary (pass a factory instead).

    "With LMS" means the autotuner (:func:`tune`) finds a plan that fits (with
    ``recompute`` in the policy: on the model with the recomputes applied, as :func:`tflms.make_plan` does;
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
    cfg, budget = _budget_of(budget, LMSConfig.from_options(config, **options))
    _check_limit(limit)
    if not isinstance(bound, bool):
        raise ValueError(f"bound must be True or False. Received: bound={bound!r}")
    graph_of = _checked_source(step, "max_batch_size")
    if cfg.offload is not None:  # every size as the step runs with the offload: the update on the host
        traced_of = graph_of
        graph_of = lambda batch: offloaded(traced_of(batch), cfg)  # noqa: E731
    search = _CapacitySearch(graph_of, cfg, budget)
    without = _largest_within(search.plain_peak, budget, limit, rel_tol, start=32)
    with_lms = largest_fitting(search.fits_with, limit, rel_tol)
    return BatchSizeResult(
        budget=budget,
        without_lms=without,
        with_lms=with_lms,
        limit=limit,
        bound=_bound(search.planned_of, budget, limit, with_lms) if bound else None,
    )


def _budget_of(budget: int | str | None, cfg: LMSConfig) -> tuple[LMSConfig, int]:
    """``(cfg, budget in bytes)`` of :func:`max_batch_size`'s ``budget`` argument and ``cfg.budget``
    (``'auto'`` dropped: no device to read a limit from); a ``ValueError`` for none, or two that differ."""
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
    return cfg, budget


class _CapacitySearch:
    """The predicates :func:`max_batch_size` searches on, per batch size, with what they learnt so far."""

    def __init__(self, graph_of: Callable[[int], GraphModel], cfg: LMSConfig, budget: int) -> None:
        self.graph_of, self.cfg, self.budget = graph_of, cfg, budget
        self.plain_fits: dict[int, bool] = {}  # per batch size: the plain step fits
        self.lms_fits: dict[int, bool] = {}  # per batch size: the plain step or some plan of the autotuner fits
        # Thresholds of the plans of step 5 that fitted at the last batch sizes, latest first.
        self.fitted: list[int] = []
        self.plain_peaks: dict[int, int] = {}  # per batch size: the plain step's predicted peak

    def planned_of(self, batch: int) -> Simulator:
        """A simulator of the step the bound is searched on: the policy's passes that change what
        the step holds (split sums, tiles left out) applied, as the planner applies them. Those two
        passes read no simulator: one is made of the last step only (``prepare`` without one)."""
        return prepare(self.graph_of(batch), self.cfg, None, only=("split_sums", "drop_tiles"))[1]

    def plain_peak(self, batch: int) -> int:
        """The plain step's predicted peak at this batch size (what :func:`_largest_within` searches on)."""
        if batch not in self.plain_peaks:
            peak = [0]

            def fits() -> bool:
                peak[0] = Simulator(self.graph_of(batch), self.cfg.host).peak()
                return peak[0] <= self.budget

            self.plain_fits[batch] = _timed(batch, "without", fits)
            self.plain_peaks[batch] = peak[0]
        return self.plain_peaks[batch]

    def fits_without(self, batch: int) -> bool:
        """Whether the plain step fits at this batch size."""
        if batch not in self.plain_fits:
            self.plain_fits[batch] = _timed(
                batch,
                "without",
                lambda: Simulator(self.graph_of(batch), self.cfg.host).peak(above=self.budget) <= self.budget,
            )
        return self.plain_fits[batch]

    def fits_with(self, batch: int) -> bool:
        """Whether the plain step or some plan of the autotuner fits at this batch size: the
        autotuner's search runs only for the batch sizes the search with LMS asks about, and the
        plain step is checked where no plan fits (or known to fit from the search without LMS)."""
        known = self.lms_fits
        if batch not in known and batch <= max((b for b, fit in self.plain_fits.items() if fit), default=0):
            known[batch] = True  # the plain step fits there (it fits at a batch at least as large)
        if batch not in known:
            known[batch] = _timed(batch, "with", lambda: self._some_plan_fits(batch))
        return known[batch]

    def _some_plan_fits(self, batch: int) -> bool:
        """Whether some plan of the autotuner fits at this batch size, else whether the plain step does."""
        model = self.graph_of(batch)  # made again: the plain step's model is not kept
        # The step make_plan plans on; one simulator, of it (none of the steps before each pass).
        model, sim, *_ = prepare(model, self.cfg, None)
        if sim.floor()[0] <= self.budget:  # else no plan's peak is below it: nothing to search
            # The plans of step 5 that fitted at the last batch sizes are tried first (they
            # often fit again): the answer is the search's either way (serialized_search's ``first``).
            fitted = self.fitted
            tuned, *_, lowest = serialized_search(model, self.cfg, sim, self.budget, exists_only=True, first=fitted)
            if tuned is not None:
                if lowest is None:  # it fitted only with orders (steps 4 and 5)
                    threshold = tuned.knobs.swapout_threshold
                    fitted[:] = [threshold, *(t for t in fitted if t != threshold)][:3]
                return True
        return self.fits_without(batch)


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
    graph_of = _checked_source(step, "batch_bound")
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


def unknown_dims(function: Any, model: Any = None) -> list[str]:
    """What leaves the size of the traced step ``function``'s inputs unknown beyond the batch: one
    phrase per input (a ``tf.TensorSpec`` of its input signature) with an unknown rank or an unknown
    dimension other than the leading one, e.g. ``"input 'token_ids' has an unknown dimension 1
    (shape [?, ?])"``; empty when the batch is all that is unknown.

    ``model``: the compiled ``keras.Model`` whose :func:`~tflms.ir.trace.keras_train_step` ``function``
    is; its inputs are then named as the model names them, and the labels "the labels".
    :func:`max_batch_size` refuses a step with any (an unknown dimension would be sized as 1).

    Example:
        >>> import tensorflow as tf
        >>> step = lambda tokens: tf.reduce_sum(tokens)
        >>> unknown_dims(tf.function(step).get_concrete_function(tf.TensorSpec([None, None], tf.int32, name="tokens")))
        ["input 'tokens' has an unknown dimension 1 (shape [?, ?])"]
        >>> unknown_dims(tf.function(step).get_concrete_function(tf.TensorSpec([None, 128], tf.int32, name="tokens")))
        []
    """
    return [_unknown_text(name, shape) for name, shape in _named_inputs(function, model) if _unknown_at(shape) != []]


def _named_inputs(function: Any, model: Any = None) -> list[tuple[str, tuple[int | None, ...] | None]]:
    """(``"input 'name'"``, shape) of each ``tf.TensorSpec`` input of the ConcreteFunction ``function``,
    in its signature's order; with ``model`` (its Keras model) the model's input names and "the labels"."""
    import keras
    import tensorflow as tf

    specs = [s for s in tf.nest.flatten(function.structured_input_signature) if isinstance(s, tf.TensorSpec)]
    names = [f"input {s.name!r}" if s.name else f"input {i}" for i, s in enumerate(specs)]
    if model is not None:
        from ..ir.trace import keras_structure

        inputs = keras.tree.flatten(keras_structure(model, "inputs"))
        outputs = keras.tree.flatten(keras_structure(model, "outputs"))
        if len(specs) == len(inputs) + len(outputs):
            labels = ["the labels"] if len(outputs) == 1 else [f"the labels of output {o.name!r}" for o in outputs]
            names = [f"input {t.name!r}" for t in inputs] + labels
    return [(n, None if s.shape.rank is None else tuple(s.shape.as_list())) for n, s in zip(names, specs)]


def _unknown_at(shape: tuple[int | None, ...] | None) -> list[int] | None:
    """The unknown dimensions of ``shape`` past the leading one (None: an unknown rank)."""
    return None if shape is None else [i for i, d in enumerate(shape) if d is None and i > 0]


def _unknown_text(name: str, shape: tuple[int | None, ...] | None) -> str:
    verb = "have" if name.startswith("the labels") else "has"
    dims = _unknown_at(shape)
    if dims is None:
        return f"{name} {verb} an unknown rank (shape unknown)"
    which = f"an unknown dimension {dims[0]}"
    if len(dims) > 1:
        which = f"unknown dimensions {', '.join(map(str, dims[:-1]))} and {dims[-1]}"
    return f"{name} {verb} {which} (shape {_shape_text(shape)})"


def _inputs_text(function: Any) -> str:
    """``(None, 128) int32, (None,) float32``: the shapes and dtypes of ``function``'s tensor inputs
    (``<unknown rank>`` for a shape of unknown rank), in its signature's order."""
    import tensorflow as tf

    specs = [s for s in tf.nest.flatten(function.structured_input_signature) if isinstance(s, tf.TensorSpec)]
    shape = lambda s: "<unknown rank>" if s.shape.rank is None else str(tuple(s.shape.as_list()))  # noqa: E731
    return ", ".join(f"{shape(s)} {s.dtype.name}" for s in specs)


def _shape_text(shape: tuple[int | None, ...]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


#: What to do about a step with unknown dimensions besides the batch (the end of the error).
CONCRETE_SHAPES = (
    "Trace the step with concrete shapes (the sequence length, the image size): pass a keras.Model built on "
    "inputs of concrete shape (inputs = keras.Input(shape=(128,), dtype='int32'), one per input; "
    "keras.Model(inputs, model(inputs)), compiled as the model is), a factory batch_size -> ConcreteFunction "
    "traced with static shapes, or a ConcreteFunction traced with an input_signature such as "
    "tf.TensorSpec([None, 128], tf.int32) (the batch alone unknown)."
)


def _refuse_unknown(who: str, function: Any, model: Any, received: str) -> None:
    """Raise ``ValueError`` when ``function`` (the step, or with ``model`` its Keras model's training
    step) leaves a dimension other than the batch unknown."""
    gaps = unknown_dims(function, model)
    if gaps:
        raise ValueError(
            f"{who} cannot size the step: {'; '.join(gaps)}. Only the batch (the leading dimension) may be "
            "unknown: tflms would size every other unknown dimension as 1 (a sequence of length 1) and answer "
            f"for that smaller step. {CONCRETE_SHAPES} Received: step={received}"
        )


def _warn_unsized(who: str, model: GraphModel) -> None:
    """Warn when the batch does not tell the size of some forward tensors of ``model`` (a ConcreteFunction
    traced with an unknown batch): each is sized with its unknown leading dimension as the batch and any
    other as 1 (a ``Dense`` on ``(None, 128, 256)`` reshapes it to ``(None, None)``: batch x 128 rows)."""
    from ..ir.trace import batch_sized

    unsized = [t for t in model.tensors.values() if model.phase(t.op) == "forward" and not batch_sized(model, t)]
    if unsized:
        first = unsized[0]
        shape = "unknown rank" if first.shape is None else _shape_text(first.shape)
        warnings.warn(
            f"{who}: the unknown batch does not tell the size of {len(unsized)} forward tensor(s) of this "
            f"ConcreteFunction (e.g. {first.op!r}, shape {shape}): each is sized with its unknown leading "
            "dimension as the batch and any other as 1, so the batch sizes found may be off. Pass the compiled "
            "keras.Model (traced again per batch where this happens) or a factory batch_size -> "
            "ConcreteFunction traced with static shapes.",
            UserWarning,
            stacklevel=3,
        )


def _checked_source(step: Any, who: str) -> Callable[[int], GraphModel]:
    """:func:`~tflms.ir.trace.graph_source` of ``step``, refusing what it would size wrongly: inputs
    with unknown dimensions besides the batch (every trace of a factory is checked as it is made),
    and a ConcreteFunction whose batch cannot vary (every input's leading dimension static)."""
    import keras

    from .. import _tf_internal as tfi

    if isinstance(step, keras.Model):
        traced = keras_train_step(step)
        x_spec, y_spec = traced.structured_input_signature[0]
        received = f"the Keras model {step.name!r} (inputs {specs_text(x_spec)}; labels {specs_text(y_spec)})"
        _refuse_unknown(who, traced, step, received)
        return graph_source(keras_step_source(step, traced))
    if isinstance(step, tfi.ConcreteFunction):
        received = f"a ConcreteFunction with inputs {_inputs_text(step)}"
        _refuse_unknown(who, step, None, received)
        shaped = [(n, s) for n, s in _named_inputs(step) if s]  # rank 1 or more
        if shaped and all(s[0] is not None for _, s in shaped):
            name, shape = shaped[0]
            raise ValueError(
                f"{who} varies the batch of the step, but every input of this ConcreteFunction has a static "
                f"leading dimension ({name} has shape {_shape_text(shape)}): each batch size would be sized as "
                "this one. Trace it with an unknown batch (an input_signature such as "
                f"tf.TensorSpec({_shape_text((None, *shape[1:])).replace('?', 'None')}, ...)) or pass a factory "
                f"batch_size -> ConcreteFunction. Received: step={received}"
            )
        graph_of = graph_source(step)
        _warn_unsized(who, graph_of(None))
        return graph_of
    if callable(step):
        factory = step

        def checked(batch: int) -> Any:
            traced = factory(batch)
            if isinstance(traced, tfi.ConcreteFunction):
                received = f"a factory whose ConcreteFunction at batch_size={batch} has inputs {_inputs_text(traced)}"
                _refuse_unknown(who, traced, None, received)
            return traced

        return graph_source(checked)
    return graph_source(step)  # its TypeError
