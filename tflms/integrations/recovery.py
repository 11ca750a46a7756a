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

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

__all__ = [
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


def replan_budget(failed_peak: int, budget: int | None) -> int:
    """The budget of the plan made after a plan predicted at ``failed_peak`` bytes ran out of memory
    under ``budget`` (``None``: none was set): :data:`REPLAN_FACTOR` of the lower of the two.

    >>> replan_budget(1000, None), replan_budget(1000, 900)
    (850, 765)
    """
    return int(REPLAN_FACTOR * min(failed_peak, budget if budget is not None else failed_peak))


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
