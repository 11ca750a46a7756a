"""Autotuning to a memory budget, and the largest batch that fits one.

:func:`tune` picks ``swapout_threshold``, ``swapin_ahead``, ``swapin_groupby`` and
``n_tensors`` for ``LMSConfig(budget=...)``:

1. If the plain step's predicted peak fits, nothing is swapped (``n_tensors=0``).
2. For each threshold and groupby of a small grid (:data:`THRESHOLDS`,
   :data:`GROUPBYS`), with the latest prefetch (``swapin_ahead=1``), the peak of
   every largest-first prefix of the candidates is predicted
   (:meth:`Simulator.prefix_peaks`) and the shortest fitting prefix kept; the
   combination moving the fewest bytes (swap-outs plus swap-ins) wins, ties going
   to fewer tensors, then larger thresholds and groups. If none fits,
   :class:`BudgetError` carries the lowest predicted peak of all those prefixes.
   Swapping more is not always lower (a tensor read by several backward ops gets
   one swap-in copy per consumer group, and overlapping copies can cost more
   than the device copy they replace), so no prefix is assumed best.
3. With those fixed, the largest ``swapin_ahead`` (earliest prefetch) that still
   fits is kept.

Every number is a simulator prediction (:mod:`tflms.simulator`). The chosen
values are recorded in the plan's options, so ``make_plan`` with them (and no
budget) reproduces the plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .config import LMSConfig, parse_bytes
from .errors import BudgetError
from .graph import GraphModel
from .plan import Swap, format_bytes
from .planner import candidate_swaps
from .simulator import Simulator

__all__ = ["tune", "max_batch_size", "keras_train_step", "BatchSizeResult", "THRESHOLDS", "GROUPBYS", "AHEADS"]

THRESHOLDS = (0, 5, 10, 20, 40, 80, 160, 320, 640, 1280)
GROUPBYS = (0, 5, 20, 80)
AHEADS = (64, 32, 16, 8, 4, 2, 1)


def traffic(swaps: Sequence[Swap]) -> int:
    """Bytes moved per step: each swap-out once, each swap-in once."""
    return sum(s.bytes * (1 + len(s.swap_ins)) for s in swaps)


def _knobs(config: LMSConfig, threshold: int, ahead: int, groupby: int) -> LMSConfig:
    return dataclasses.replace(
        config, budget=None, n_tensors=None, swapout_threshold=threshold, swapin_ahead=ahead, swapin_groupby=groupby
    )


def _grid(model: GraphModel, config: LMSConfig) -> list[tuple[int, int, list[Swap]]]:
    """(threshold, groupby, all candidate swaps with the latest prefetch) for the search grid."""
    everything = candidate_swaps(model, _knobs(config, 0, 1, 0))
    if not everything:
        return []
    max_distance = max(s.distance for s in everything)
    grid = []
    for threshold in (t for t in THRESHOLDS if t < max_distance):
        for groupby in GROUPBYS:
            swaps = (
                everything
                if threshold == 0 and groupby == 0
                else candidate_swaps(model, _knobs(config, threshold, 1, groupby))
            )
            if swaps:
                grid.append((threshold, groupby, swaps))
    return grid


def _search(model: GraphModel, config: LMSConfig, sim: Simulator, budget: int) -> tuple[LMSConfig | None, int]:
    """(tuned config or None when nothing fits, lowest predicted peak the search saw)."""
    lowest = sim.peak()
    if lowest <= budget:
        return dataclasses.replace(config, budget=budget, n_tensors=0), lowest
    best: tuple[tuple[int, int, int, int], int, int, int] | None = None
    for threshold, groupby, swaps in _grid(model, config):
        peaks = sim.prefix_peaks(swaps)
        lowest = min(lowest, int(peaks.min()))
        fitting = np.flatnonzero(peaks <= budget)
        if not len(fitting):
            continue
        n = int(fitting[0])
        key = (traffic(swaps[:n]), n, -threshold, -groupby)
        if best is None or key < best[0]:
            best = (key, threshold, groupby, n)
    if best is None:
        return None, lowest
    _, threshold, groupby, n = best
    for ahead in AHEADS:  # earliest prefetch first; ahead=1 is the one that fitted above
        if sim.peak(candidate_swaps(model, _knobs(config, threshold, ahead, groupby))[:n]) <= budget:
            break
    tuned = dataclasses.replace(
        config, budget=budget, swapout_threshold=threshold, swapin_ahead=ahead, swapin_groupby=groupby, n_tensors=n
    )
    return tuned, lowest


def tune(model: GraphModel, config: LMSConfig, sim: Simulator | None = None) -> LMSConfig:
    """``config`` with the swap knobs chosen for ``config.budget`` (see module doc).

    Raises :class:`BudgetError` (with the lowest predicted peak the search saw)
    when no plan of the search fits.
    """
    if config.budget is None:
        raise ValueError("tune needs a budget. Received: budget=None")
    sim = sim or Simulator(model, config.host)
    tuned, lowest = _search(model, config, sim, config.budget)
    if tuned is None:
        raise BudgetError(config.budget, lowest, sim.peak())
    return tuned


@dataclasses.dataclass(frozen=True)
class BatchSizeResult:
    """Largest batch sizes whose *predicted* (simulator) peak fits ``budget``.

    A size of 0 means even batch 1 does not fit; ``limit`` means the search stopped there.
    """

    budget: int
    without_lms: int
    with_lms: int
    limit: int

    @property
    def ratio(self) -> float | None:
        return self.with_lms / self.without_lms if self.without_lms else None

    def __str__(self) -> str:
        ratio = f" (x{self.ratio:.1f})" if self.ratio else ""
        cap = lambda b: f">={b}" if b >= self.limit else str(b)  # noqa: E731
        return (
            f"largest batch within {format_bytes(self.budget)} (simulator prediction): "
            f"{cap(self.without_lms)} without LMS, {cap(self.with_lms)} with LMS{ratio}"
        )


def _largest(fits: Callable[[int], bool], limit: int, rel_tol: float = 0.0) -> int:
    """Largest b in [1, limit] with fits(b), for a monotone predicate; 0 if none.

    With ``rel_tol`` > 0 the bisection stops once the bracket is within that
    fraction of the lower end (the result is then a lower bound, that close).
    """
    if not fits(1):
        return 0
    lo = 1
    hi = 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    if hi > limit:
        if fits(limit):
            return limit
        hi = limit
    while hi - lo > max(1, int(lo * rel_tol)):  # lo fits, hi does not
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def max_batch_size(
    step: Any,
    budget: int | str,
    *,
    config: LMSConfig | None = None,
    limit: int = 1 << 16,
    rel_tol: float = 0.0,
    **options: Any,
) -> BatchSizeResult:
    """Largest batch whose predicted device peak fits ``budget``, without and with LMS.

    ``step`` is one of:

    * a ConcreteFunction traced with an unknown (``None``) batch dimension: sizes
      are re-estimated per batch with the ``batch_size`` rule, no retracing;
    * a compiled ``keras.Model`` (loss and optimizer set): its training step is
      traced once with an unknown batch dimension (see :func:`keras_train_step`);
    * a callable ``factory(batch_size) -> ConcreteFunction`` (retraced per size).

    "With LMS" means the autotuner (:func:`tune`) finds a plan that fits.
    ``rel_tol`` > 0 trades exactness for fewer evaluations: each result is then a
    size that fits, within that fraction below the true largest one.

    Example:
        >>> model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")  # doctest: +SKIP
        >>> print(tflms.max_batch_size(model, "16GiB"))                              # doctest: +SKIP
        largest batch within 16.0 GiB (simulator prediction): 96 without LMS, 1150 with LMS (x12.0)
    """
    from .core import paused_gc

    budget = parse_bytes(budget, "budget")
    cfg = LMSConfig.from_options(config, **options)
    _check_limit(limit)
    graph_of = _graph_source(step)
    cache: dict[int, tuple[bool, bool]] = {}

    def fits(batch: int) -> tuple[bool, bool]:
        """(plain step fits, some plan of the autotuner fits) at this batch size."""
        if batch not in cache:
            with paused_gc():
                model = graph_of(batch)
                sim = Simulator(model, cfg.host)
                plain = sim.peak() <= budget
                cache[batch] = (plain, plain or _search(model, cfg, sim, budget)[0] is not None)
        return cache[batch]

    return BatchSizeResult(
        budget=budget,
        without_lms=_largest(lambda b: fits(b)[0], limit, rel_tol),
        with_lms=_largest(lambda b: fits(b)[1], limit, rel_tol),
        limit=limit,
    )


def _check_limit(limit: Any) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be an integer >= 1. Received: limit={limit!r}")


def _graph_source(step: Any) -> Callable[[int], GraphModel]:
    import keras

    from . import _tf_internal as tfi

    if isinstance(step, keras.Model):
        step = keras_train_step(step)
    if isinstance(step, tfi.ConcreteFunction):
        graph = step.graph
        return lambda batch: GraphModel.from_func_graph(graph, batch_size=batch)
    if callable(step):
        return lambda batch: GraphModel.from_func_graph(step(batch).graph, batch_size=batch)
    raise TypeError(
        "step must be a ConcreteFunction, a compiled keras.Model or a callable batch_size -> "
        f"ConcreteFunction. Received: step={step!r}"
    )


def keras_train_step(model: Any, label_shape: Sequence[int] | None = None, label_dtype: str | None = None) -> Any:
    """The training step of a compiled Keras model, traced with an unknown batch size.

    Labels default to the model's output shape (float32), or to integer class ids
    of shape ``(batch,)`` when the loss is a sparse categorical one.
    """
    import tensorflow as tf

    if model.optimizer is None or getattr(model, "loss", None) is None:
        raise ValueError(
            "The Keras model must be compiled with a loss and an optimizer, e.g. "
            f"model.compile(optimizer='adam', loss='mse'). Received: model={model.name!r}"
        )
    loss_name = str(model.loss).lower()
    sparse = "sparse" in loss_name
    if label_shape is None:
        label_shape = () if sparse else tuple(model.output_shape[1:])
    label_dtype = label_dtype or ("int32" if sparse else "float32")
    x_spec = tf.TensorSpec((None, *model.input_shape[1:]), model.inputs[0].dtype)
    y_spec = tf.TensorSpec((None, *label_shape), label_dtype)
    optimizer = model.optimizer
    optimizer.build(model.trainable_variables)

    def train_step(x, y):
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            loss = model.compute_loss(x=x, y=y, y_pred=y_pred, training=True)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return tf.function(train_step).get_concrete_function(x_spec, y_spec)
