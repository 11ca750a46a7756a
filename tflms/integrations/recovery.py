"""Undoing a step that ran out of device memory, so that it can run again on the same batch.

A rewritten step's plan is a prediction; the device's allocator decides. While a plan is new
(its first :data:`PROBATION_CALLS` calls), :class:`tflms.LMSFunction` saves the value of every
variable the step may write (weights, optimizer slots and iterations, BatchNorm's moving
statistics, metrics, Keras's seed-generator states) to the host before each call. When the call
raises ``ResourceExhaustedError``, some of those writes may have happened: they are undone from
the saved values, the step is planned again for less memory (:func:`replan_budget`) and called
again with the same arguments, at most :data:`MAX_REPLANS` times; then the plain step is tried,
if it has not run out of memory itself; then an error says what was tried.

The loop also learns the margin of ``budget="auto"``: where the device reports its memory (a GPU,
the test bed's device), the peaks of a new plan's first :data:`LEARN_AFTER_CALLS` calls are
measured, and a plan whose measured peak lands far from :data:`TARGET_FRACTION` of the device's
limit is planned once again for the budget that would put it there (:func:`learned_budget`).

What it cannot undo: state that lives outside variables (the kernels of TensorFlow's legacy
stateful random ops, ``tf.random.uniform`` with an op seed, keep their own counters), and
anything the step's Python code did while it was traced. The saving costs one copy of the
written variables to the host per call on probation.

Example:
    >>> import tensorflow as tf
    >>> v = tf.Variable([1.0, 2.0])
    >>> @tf.function
    ... def step(x):
    ...     v.assign_add(x)
    ...     return tf.reduce_sum(v)
    >>> cf = step.get_concrete_function(tf.ones(2))
    >>> [w.name for w in written_variables(cf)]
    ['Variable:0']
    >>> saved = save_state(written_variables(cf), "/device:CPU:0")
    >>> _ = cf(tf.ones(2))
    >>> restore_state(written_variables(cf), saved)
    >>> v.numpy().tolist()
    [1.0, 2.0]
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from .._util import paused_gc
from ..config import LMSConfig
from ..errors import BudgetError, LMSWarning
from ..ir.graph import GraphModel
from ..plan.planner import empty_plan
from ..plan.records import SwapPlan, format_bytes
from ..rewrite.apply import is_rewritten
from .devices import device_memory, device_memory_limit

__all__ = [
    "Recovering",
    "FALLBACK_REASON",
    "LEARN_AFTER_CALLS",
    "LEARN_TOLERANCE",
    "MAX_REPLANS",
    "PROBATION_CALLS",
    "REPLAN_FACTOR",
    "TARGET_FRACTION",
    "learned_budget",
    "out_of_memory_message",
    "replan_budget",
    "restore_state",
    "save_state",
    "written_variables",
]

log = logging.getLogger("tflms")

#: Calls of a new plan (per input signature) whose written variables are saved first.
PROBATION_CALLS = 5
#: Plans tried, after the first, before the plain step.
MAX_REPLANS = 3
#: A plan made after an out-of-memory error aims at this fraction of the failed plan's predicted peak.
REPLAN_FACTOR = 0.85

#: Where a learned budget aims the measured peak: this fraction of the device's memory limit.
TARGET_FRACTION = 0.95
#: A learned budget replaces the plan's only where the two differ by more than this fraction.
LEARN_TOLERANCE = 0.05
#: The budget is learned from the measured peaks of this many calls of a plan (the first call of a
#: step may hold one-time allocations, a GPU's convolution autotuning among them).
LEARN_AFTER_CALLS = 2

#: The reason of the plan that runs the plain step after every plan ran out of memory.
FALLBACK_REASON = "the plans ran out of device memory: the plain step runs"

#: Ops that read a resource variable without writing it.
_READ_ONLY = frozenset(
    {"ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape", "VarIsInitializedOp", "Identity"}
)


def written_variables(concrete_function: Any) -> list[Any]:
    """The variables captured by ``concrete_function`` that an op of its graph may write: every
    variable whose handle reaches an op other than a read (assignments, optimizer updates, and,
    to be safe, any function call that takes the handle). In the order of ``graph.variables``."""
    graph = concrete_function.graph
    internal = {e.ref(): i for e, i in zip(graph.external_captures, graph.internal_captures)}
    written = []
    for variable in graph.variables:
        handle = getattr(variable, "handle", None)
        placeholder = internal.get(handle.ref()) if handle is not None else None
        if placeholder is not None and _writes(placeholder):
            written.append(variable)
    return written


def _writes(tensor: Any) -> bool:
    """Whether a consumer of the resource ``tensor`` (through ``Identity`` ops) writes it."""
    stack, seen = [tensor], set()
    while stack:
        t = stack.pop()
        for op in t.consumers():
            if op.name in seen:
                continue
            seen.add(op.name)
            if op.type == "Identity":
                stack.extend(op.outputs)
            elif op.type not in _READ_ONLY:
                return True
    return False


def save_state(variables: Sequence[Any], host: str) -> list[Any]:
    """Copies of ``variables``' values on ``host`` (a device string), to undo a step with."""
    with tf.device(host):
        return [tf.identity(v) for v in variables]


def restore_state(variables: Sequence[Any], saved: Sequence[Any]) -> None:
    """Assign each of ``variables`` its value in ``saved`` (from :func:`save_state`)."""
    for v, value in zip(variables, saved, strict=True):
        v.assign(value)


def replan_budget(failed_peak: int, budget: int | None, limit: int | None = None) -> int:
    """The budget of the plan made after a plan predicted at ``failed_peak`` bytes ran out of memory
    under ``budget`` (``None``: none was set) on a device of ``limit`` bytes (``None``: not known):
    :data:`REPLAN_FACTOR` of the lowest of the three. A plan predicted above the device's memory
    could not fit; one predicted below it ran out anyway, so the device needs more than predicted.

    >>> replan_budget(1000, None), replan_budget(1000, 900), replan_budget(1000, 900, limit=800)
    (850, 765, 680)
    """
    known = [b for b in (failed_peak, budget, limit) if b is not None]
    return int(REPLAN_FACTOR * min(known))


def learned_budget(limit: int, budget: int, predicted: int, measured: int) -> int | None:
    """The budget ``budget="auto"`` should have had, from one plan's ``measured`` and ``predicted``
    peaks: the one whose plan, measured ``measured / predicted`` times its prediction as this one
    was, peaks at :data:`TARGET_FRACTION` of the device's ``limit`` (never above ``limit``).
    ``None`` where it is within :data:`LEARN_TOLERANCE` of ``budget``: nothing to learn.

    Tighter where the measurement came close to the limit, looser (fewer swaps, a faster step)
    where it left much of it unused:

    >>> learned_budget(limit=1000, budget=900, predicted=900, measured=1035)  # 1.15x its prediction
    826
    >>> learned_budget(limit=1000, budget=900, predicted=800, measured=600)  # 0.75x
    1000
    >>> learned_budget(limit=1000, budget=900, predicted=900, measured=950) is None  # 0.95 of the limit
    True
    """
    new = min(limit, int(TARGET_FRACTION * limit * predicted / measured))
    return None if abs(new - budget) <= LEARN_TOLERANCE * budget else new


def out_of_memory_message(function: str, tries: Sequence[str]) -> str:
    """The message of the error raised once every way of running the step ran out of memory."""
    lines = "\n".join(f"  {i + 1}. {t}" for i, t in enumerate(tries))
    return (
        f"tflms: {function} ran out of device memory in every way tried on the same batch (each failed "
        f"call's variable writes were undone):\n{lines}\nLower the batch size, or set a budget below the "
        "device's memory (budget=...), or move state to the host (offload='optimizer' or 'weights')."
    )


def tried(plain: bool, plan: SwapPlan, device: str | None, err: Exception) -> str:
    """One line on a way of running a step that ran out of memory."""
    way = (
        f"the plain step (predicted {format_bytes(plan.peak_bytes_before)})"
        if plain
        else f"a plan of {len(plan.swaps)} swaps predicted at {format_bytes(plan.peak_bytes_after)}"
        + (f" for budget {format_bytes(plan.options['budget'])}" if plan.options.get("budget") else "")
    )
    first = str(getattr(err, "message", err)).strip().splitlines()
    oom = next((line.strip() for line in first if "OOM when allocating" in line), first[0] if first else "")
    return f"{way} on {device}: {oom[:200]}"


class Recovering:
    """What :class:`tflms.LMSFunction` does around a call of a rewritten step: the state saved while
    a plan is on probation, the undo and the re-plans after an out-of-memory error, the learned
    margin. The class that mixes it in provides ``_cache`` (trace -> ``(function, plan, device)``),
    ``_config``, ``_run(function, device, args, kwargs)``, ``_replan(trace, config)`` (a new entry
    for the trace, planned with ``config``), ``_fresh_trace(trace)`` (an unedited trace of its
    signature) and ``_watched_device(trace)`` (the device whose memory is watched, or ``None``)."""

    _cache: dict[Any, tuple[Any, SwapPlan, str | None]]
    _config: LMSConfig

    def _init_recovery(self) -> None:
        self._probation: dict[Any, int] = {}  # trace -> calls left whose writes are saved first
        self._plan_peaks: dict[Any, list[int]] = {}  # trace -> measured peaks of its plan's first calls
        #: trace -> the config its running plan was made with, where the loop planned it again
        #: (a lower budget after an out-of-memory error, a learned one).
        self._trace_configs: dict[Any, LMSConfig] = {}
        #: The device peaks read while a plan is on probation, in order (where the device reports
        #: memory): before each call, the peak since the last reset (which the call's own reset would
        #: lose), and each call's own peak.
        self.measured_peaks: list[int] = []
        #: The re-plans after an out-of-memory error or a learned margin, in order: ``{'function', 'why',
        #: 'failed_peak', 'old_budget', 'budget'}`` (``budget='plain'``: the plain step took over).
        self.replans: list[dict[str, Any]] = []

    def _run(self, new_cf: Any, device: str | None, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError

    def _replan(self, cf: Any, config: LMSConfig) -> tuple[Any, SwapPlan, str | None]:
        raise NotImplementedError

    def _fresh_trace(self, cf: Any) -> Any:
        raise NotImplementedError

    def _watched_device(self, cf: Any) -> str | None:
        raise NotImplementedError

    def _run_recovering(self, cf: Any, args: tuple, kwargs: dict) -> Any:
        """Run the rewritten step of trace ``cf``; while its plan is on probation, undo a call that
        runs out of device memory and run the same arguments again with a plan for less memory,
        then with the plain step (:mod:`tflms.integrations.recovery`)."""
        new_cf, plan, device = self._cache[cf]
        left = self._probation.get(cf, PROBATION_CALLS)
        if left <= 0:
            return self._run(new_cf, device, args, kwargs)
        tries: list[str] = []
        watched = self._watched_device(cf)  # the rewrite's device, or the one a fitting step would use
        measured = watched is not None and device_memory(watched) is not None
        while True:
            variables = written_variables(new_cf)
            saved = save_state(variables, self._config.host)
            if measured:  # the peak since the last reset (others' allocations too), then each call's own
                self.measured_peaks.append(int(device_memory(watched)["peak"]))
                tf.config.experimental.reset_memory_stats(watched)
            try:
                out = self._run(new_cf, device, args, kwargs)
            except tf.errors.ResourceExhaustedError as err:
                restore_state(variables, saved)
                del saved
                plain = not is_rewritten(new_cf.graph)
                tries.append(tried(plain, plan, watched, err))
                entry = self._after_out_of_memory(cf, plain, plan, watched, tries)
                if entry is None:
                    raise tf.errors.ResourceExhaustedError(
                        None, None, out_of_memory_message(plan.function, tries)
                    ) from err
                new_cf, plan, device = entry
                self._cache[cf] = entry
                left = PROBATION_CALLS
                continue
            self._probation[cf] = left - 1
            if measured:
                peak = int(device_memory(watched)["peak"])
                self.measured_peaks.append(peak)
                peaks = self._plan_peaks.setdefault(cf, [])
                peaks.append(peak)
                if len(peaks) == LEARN_AFTER_CALLS and self._config.budget == "auto":
                    self._learn_margin(cf, plan, watched, max(peaks))
            return out

    def _learn_margin(self, cf: Any, plan: SwapPlan, device: str, measured: int) -> None:
        """Plan trace ``cf`` once again for the budget that its ``measured`` peak says ``budget="auto"``
        should have had (:func:`learned_budget`), where that differs."""
        limit, _ = device_memory_limit(device)
        budget = plan.options.get("budget")
        if limit is None or not isinstance(budget, int) or not plan.peak_bytes_after:
            return
        new_budget = learned_budget(limit, budget, plan.peak_bytes_after, measured)
        if new_budget is None:
            return
        config = self._config.replace(budget=new_budget)
        try:
            with paused_gc(), warnings.catch_warnings():
                warnings.simplefilter("ignore", LMSWarning)
                entry = self._replan(cf, config)
        except BudgetError as err:
            log.warning(
                "tflms: %s: no plan fits the learned budget %s; the plan is kept (%s)",
                plan.function,
                format_bytes(new_budget),
                err,
            )
            return
        why = (
            f"learned margin: measured peak {format_bytes(measured)} against {format_bytes(plan.peak_bytes_after)} "
            f"predicted ({measured / plan.peak_bytes_after:.2f}x), aiming at {TARGET_FRACTION} x the "
            f"limit {format_bytes(limit)}"
        )
        self.replans.append(
            {"function": plan.function, "why": why, "failed_peak": None, "old_budget": budget, "budget": new_budget}
        )
        log.warning(
            "tflms: %s: %s; planned again for budget %s (was %s)",
            plan.function,
            why,
            format_bytes(new_budget),
            format_bytes(budget),
        )
        if entry[1].swaps == plan.swaps and entry[1].recomputes == plan.recomputes and entry[1].orders == plan.orders:
            return  # the same decisions: keep the function that runs
        self._cache[cf] = entry
        self._trace_configs[cf] = config
        self._probation[cf] = PROBATION_CALLS
        self._plan_peaks[cf] = []

    def _after_out_of_memory(
        self, cf: Any, plain: bool, plan: SwapPlan, device: str | None, tries: list[str]
    ) -> tuple[Any, SwapPlan, str | None] | None:
        """The next way to run trace ``cf`` after ``plan`` ran out of memory: a plan for less memory
        (at most :data:`MAX_REPLANS`), then the plain step; ``None``
        when the plain step (``plain``: the one that failed) ran out of memory too."""
        budget = plan.options.get("budget")
        fallback = plain and plan.reason == FALLBACK_REASON  # the plain step after the plans failed
        if not fallback and len(tries) <= MAX_REPLANS:
            limit = device_memory_limit(device)[0] if device is not None else None
            new_budget = replan_budget(plan.peak_bytes_after, budget, limit)  # a step left plain: its own peak
            config = self._config.replace(budget=new_budget, on_budget_miss="best")
            with paused_gc(), warnings.catch_warnings():
                warnings.simplefilter("ignore", LMSWarning)
                entry = self._replan(cf, config)
            if entry[2] is not None and entry[1].peak_bytes_after < plan.peak_bytes_after:
                self._trace_configs[cf] = config
                self.replans.append(
                    {
                        "function": plan.function,
                        "why": tries[-1],
                        "failed_peak": plan.peak_bytes_after,
                        "old_budget": budget,
                        "budget": new_budget,
                    }
                )
                log.warning(
                    "tflms: %s ran out of device memory (%s); its writes were undone and it runs the same batch "
                    "again with a plan for budget %s (was %s)",
                    plan.function,
                    tries[-1],
                    format_bytes(new_budget),
                    "none" if budget is None else format_bytes(budget),
                )
                return entry
        if plain:
            return None  # the plain step ran out of memory: nothing uses less that tflms can run
        log.warning(
            "tflms: %s ran out of device memory with every plan tried (%s); it runs the same batch with the plain step",
            plan.function,
            tries[-1],
        )
        self.replans.append(
            {
                "function": plan.function,
                "why": tries[-1],
                "failed_peak": plan.peak_bytes_after,
                "old_budget": budget,
                "budget": "plain",
            }
        )
        self._trace_configs.pop(cf, None)
        plain_cf = self._fresh_trace(cf)  # ``cf`` itself may have been rewritten in place
        model = GraphModel.from_func_graph(plain_cf.graph)
        return plain_cf, empty_plan(model, self._config, plan.peak_bytes_before, FALLBACK_REASON), device
