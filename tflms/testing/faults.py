"""Out-of-memory errors on purpose, for tests of recovery (:mod:`tflms.integrations.recovery`).

:func:`out_of_memory` makes chosen calls of every step that tflms rewrites while it is active
run out of device memory half-way: an op of the rewritten step asks the device for a tensor far
larger than any device has, after the step's first variable write and before its last, so that
a failed call has written some of its state and not the rest. The plain step (a fallback) is
left alone. Calls are counted as the steps run them (a call that is retried counts again).

Example (a test's custom loop; ``step`` a :class:`tflms.LMSFunction`)::

    with out_of_memory(calls={3}) as fault:
        for x, y in batches:
            step(x, y)  # the third run fails half-way, is undone and runs again
    assert fault.failed == [3]
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from ..integrations import function as _function
from ..plan.records import SwapPlan

__all__ = ["FaultLog", "out_of_memory"]

#: The side of the square float32 tensor a failing call asks for (2**21 squared: 16 TiB).
HUGE_SIDE = 2**21
#: Resource ops that write their variable (the first and last of them in a step bracket the fault).
_WRITES = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp")


class FaultLog:
    """What :func:`out_of_memory` did: ``calls`` run so far, ``failed`` the ones made to fail."""

    def __init__(self, fail_on: Collection[int]) -> None:
        self.fail_on = frozenset(fail_on)
        self.calls = 0
        self.failed: list[int] = []

    def size(self) -> np.ndarray:
        """The side of the tensor this call asks for: huge on a call to fail, else 1."""
        self.calls += 1
        if self.calls in self.fail_on:
            self.failed.append(self.calls)
            return np.array([HUGE_SIDE], np.int32)
        return np.array([1], np.int32)


@contextlib.contextmanager
def out_of_memory(calls: Collection[int]) -> Iterator[FaultLog]:
    """Within it, steps rewritten by tflms run out of device memory at the ``calls``-th run
    (1-based, counted over every step rewritten within it), half-way through their state writes.
    Yields the :class:`FaultLog`."""
    fault = FaultLog(calls)

    def edit(graph: Any, plan: SwapPlan, device: str) -> None:
        _add_fault(graph, fault, device)

    _function.AFTER_REWRITE.append(edit)
    try:
        yield fault
    finally:
        _function.AFTER_REWRITE.remove(edit)


def _add_fault(graph: Any, fault: FaultLog, device: str) -> None:
    writes = [op for op in graph.get_operations() if op.type in _WRITES]
    with graph.as_default(), tf.device(device):
        first = [writes[0]] if writes else []
        with tf.control_dependencies(first):
            side = tf.numpy_function(fault.size, [], tf.int32, stateful=True, name="tflms_fault/size")
            side.set_shape([1])
            huge = tf.raw_ops.Empty(shape=tf.concat([side, side], 0), dtype=tf.float32, name="tflms_fault/alloc")
            done = tf.raw_ops.Identity(input=huge[:0, :0], name="tflms_fault/done")
    done.op._set_attr("_grappler_do_not_remove", tf.compat.v1.AttrValue(b=True))  # noqa: SLF001
    if len(writes) > 1:
        writes[-1]._add_control_input(done.op)  # noqa: SLF001
    else:
        graph.control_outputs.append(done.op)
