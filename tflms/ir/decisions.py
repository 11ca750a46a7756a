"""The decisions of a plan as frozen data: the records that the planner makes, the simulator and
the timeline emulate, the rewrite applies and a :class:`~tflms.plan.records.SwapPlan` holds.

They sit in ``ir`` because every later stage reads them: ``emulate`` predicts a step with them
before ``plan`` chooses them. What each one means for the graph is in
:mod:`tflms.plan.records` (the plan's JSON format) and :mod:`tflms.rewrite.apply`.

>>> s = Swap("a:0", "a", "Relu", "float32", (8, 4), 128, 3, 40, (SwapIn((("g", 0),), "t", 43, 41),))
>>> [si.trigger for si in s.swap_ins]
['t']
>>> Recompute("b:0", "b", ("a", "b"), 64, 256, 3, 40, ()).clone("a", 0)
'tflms_recompute/b/0/a'
"""

from __future__ import annotations

import dataclasses

__all__ = ["RECOMPUTE_SCOPE", "SwapIn", "Swap", "Recompute", "Fence", "Order", "Sum", "Stage"]

#: Name scope of the ops a recompute adds (clones of forward ops).
RECOMPUTE_SCOPE = "tflms_recompute"


@dataclasses.dataclass(frozen=True)
class SwapIn:
    """One swap-in: the consumers it feeds and the op that triggers it.

    ``consumers`` are ``(op_name, input_index)`` pairs; ``level`` is the level of the
    first consumer; ``trigger`` is ``None`` when no suitable op exists (then the
    swap-in may run as soon as the swap-out has finished).
    """

    consumers: tuple[tuple[str, int], ...]
    trigger: str | None
    level: int
    trigger_level: int | None


@dataclasses.dataclass(frozen=True)
class Swap:
    """One swapped tensor: a swap-out to the host and one or more swap-ins."""

    tensor: str
    producer: str
    producer_type: str
    dtype: str
    shape: tuple[int | None, ...] | None
    bytes: int
    level: int
    distance: int
    swap_ins: tuple[SwapIn, ...]


@dataclasses.dataclass(frozen=True)
class Recompute:
    """One recomputed tensor: its forward producer chain is run again before each group
    of its backward consumers, instead of swapping it.

    ``ops`` are the forward ops cloned, in execution order; the last is ``producer``.
    Their other inputs are on the device at the backward pass anyway (weights, small
    tensors, tensors swapped in for other backward ops). ``groups`` are the consumer
    groups, each with its own clones and a trigger (a :class:`SwapIn` record: the clones
    run after ``trigger``). ``work_bytes`` is what one run of the chain reads and writes.
    """

    tensor: str
    producer: str
    ops: tuple[str, ...]
    bytes: int
    work_bytes: int
    level: int
    distance: int
    groups: tuple[SwapIn, ...]

    def clone(self, op: str, group: int) -> str:
        """Name of the clone of ``op`` for consumer group ``group``."""
        return f"{RECOMPUTE_SCOPE}/{self.producer}/{group}/{op}"

    def clone_tensor(self, tensor: str, group: int) -> str:
        """Name of the clone of ``tensor`` (an output of one of ``ops``) for group ``group``."""
        op, _, index = tensor.rpartition(":")
        return f"{self.clone(op, group)}:{index}"

    def output(self, group: int) -> str:
        """Name of the tensor that feeds group ``group``'s consumers."""
        return self.clone_tensor(self.tensor, group)


@dataclasses.dataclass(frozen=True)
class Fence:
    """An ordering edge: the forward op ``op`` starts only after the swap-out of ``tensor``
    (a swapped tensor of the same plan) has reached the host. It bounds how far the forward
    pass runs ahead of the link (see ``Knobs.swapout_window``)."""

    tensor: str
    op: str


@dataclasses.dataclass(frozen=True, order=True)
class Order:
    """An ordering edge: ``op`` starts only after ``after`` has run. The memory-aware schedule
    (``Knobs.serialize``) makes a backward op wait for another, so that two branches of the
    backward pass do not hold their buffers at the same time; the pass ``order_updates`` makes
    a variable's in-place update wait for an op still reading the variable, so that TensorFlow
    does not copy it (:func:`tflms.plan.passes.schedule.update_orders`)."""

    op: str
    after: str


@dataclasses.dataclass(frozen=True)
class Sum:
    """A sum added as its terms arrive (the pass ``split_sums``): the ``AddN`` op ``op`` becomes a
    chain of ``AddV2`` ops over ``terms``, in the order Grappler sorts the ``AddN``'s inputs, which
    is the order the plain step sums them in (:mod:`tflms.plan.passes.sums`)."""

    op: str
    terms: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Stage:
    """One device of a placement: the ops that run on ``device`` (sorted names) and what the
    simulator predicts for it: its peak (``peak_bytes``, variables included where they live), its
    ops' compute time (``compute_seconds``) and the bytes it receives from the other devices per
    step (``received_bytes``). See :mod:`tflms.plan.passes.place`."""

    device: str
    ops: tuple[str, ...]
    peak_bytes: int
    compute_seconds: float
    received_bytes: int
