"""Swaps and fences (the passes ``swaps`` and ``fences``): decided by the planner and the autotuner
(:mod:`tflms.plan.planner`, :mod:`tflms.plan.autotune`) with the budget, run by the simulator on the
graph model, and applied here to the TensorFlow graph.

For each swap: one ``Identity`` on ``host`` (the swap-out) reading the device tensor; for each
swap-in a second ``Identity`` **on the host** reading the swap-out, with a control input from its
trigger, then an ``Identity`` on the device (the landing) reading the swap-in; the consumers of the
group (on the device) rewired to the landing. Every swap op carries ``_grappler_do_not_remove=True``
and :data:`SWAP_ATTR` (``"out"``/``"in"``/``"landing"``). Swap-outs and swap-ins are named under
:data:`SWAP_OUT_SCOPE` and :data:`SWAP_IN_SCOPE`; a landing under the swapped tensor's producer
(:func:`landing_name`), so that Grappler's name sort of a commutative op's inputs keeps the plain
step's order (a three-term ``AddN`` in another order rounds differently).

Why the swap-in sits on the host: TensorFlow's partitioner turns each edge between devices into a
send on the producing side and a receive on the consuming side, and a receive has no inputs. A
swap-in on the device would therefore receive the tensor as soon as the swap-out holds it, and the
trigger would delay only the ``Identity`` after the copy: the tensor would be back on the device for
the whole forward-to-backward gap, freeing nothing. Gated on the host, the send of each swap-in runs
only after its trigger, so the device buffer exists only from the trigger to the group's last
consumer. Each swap-in is its own host tensor, so each group gets its own transfer (TensorFlow makes
one send/receive pair per tensor and destination device).

Why the landing: the consumers then read a tensor of their own device, as in the plain step.
Grappler leaves alone some rewrites whose inputs sit on another device: constant folding's
push-down (``Mul(C, Mul(x, y))`` -> ``Mul(x, Mul(C, y))``) checks that the parent and both leaves
share a device, so with ``y`` read straight from the host swap-in the constant can stay where it
was, and the product then rounds differently from the plain step's. The landing is an ``Identity``: it
forwards the received buffer and does not change when the tensor arrives.

Fences (:class:`~tflms.ir.decisions.Fence`) are control inputs from a swap-out (on the host) to a
forward op on the device: TensorFlow's partitioner turns such an edge into a send of a control
signal after the host's ``Identity`` has its copy, so the op waits for the transfer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from .base import Edges, GraphEdit, Pass

if TYPE_CHECKING:
    from ...ir.decisions import Swap, SwapIn

__all__ = [
    "SWAP_ATTR",
    "SWAP_OUT_SCOPE",
    "SWAP_IN_SCOPE",
    "LANDING_SCOPE",
    "Swaps",
    "Fences",
    "landing_name",
    "is_landing",
    "group_ops",
    "mark",
]

SWAP_OUT_SCOPE = "tflms_swapout"
SWAP_IN_SCOPE = "tflms_swapin"
LANDING_SCOPE = "tflms_landing"
#: The attribute that marks every op a pass adds or changes, with what it is for.
SWAP_ATTR = "_tflms_swap"


def landing_name(tensor: str, k: int) -> str:
    """Name of the device-side landing ``Identity`` of swap-in ``k`` of ``tensor``: under the
    producer's name, so that Grappler's name sort of a commutative op's inputs (an ``AddN``
    of three terms) keeps the order of the plain step, and the sum rounds the same.

    >>> landing_name("gradient_tape/bn/mul_1/Mul:0", 1)
    'gradient_tape/bn/mul_1/Mul/tflms_landing_0_1'
    """
    op, _, index = tensor.rpartition(":")
    return f"{op}/{LANDING_SCOPE}_{index}_{k}"


def is_landing(name: str) -> bool:
    """Whether op ``name`` is a landing ``Identity`` (see :func:`landing_name`)."""
    return f"/{LANDING_SCOPE}_" in name


def mark(op: Any, kind: str, keep: bool = True) -> None:
    """Mark ``op`` with :data:`SWAP_ATTR` ``kind`` and, with ``keep``, ``_grappler_do_not_remove``."""
    from ... import _tf_internal as tfi

    if keep:
        tfi.set_attr(op, "_grappler_do_not_remove", True)
    tfi.set_attr(op, SWAP_ATTR, kind)


def group_ops(groups: Iterable[SwapIn]) -> list[str]:
    """The triggers, then the consumers, of ``groups`` (swap-ins, or a recompute's groups)."""
    return [g.trigger for g in groups if g.trigger] + [c for g in groups for c, _ in g.consumers]


class Swaps(Pass):
    """Tensors go to the host and come back, each swap-in gated on the host by its trigger."""

    name, field, adds_edges = "swaps", "swaps", True

    def names(self, decisions: Sequence[Swap]) -> list[str]:
        return [name for s in decisions for name in (s.producer, *group_ops(s.swap_ins))]

    def rewrote(self, op: Any, attr: bytes | None) -> bool:
        return op.name.startswith((SWAP_OUT_SCOPE + "/", SWAP_IN_SCOPE + "/"))

    def edges(self, edit: GraphEdit) -> Edges:
        """Each trigger runs before its group's consumers (through the swap-in)."""
        added: Edges = {}
        for s in edit.plan.swaps:
            for si in s.swap_ins:
                for consumer, _ in si.consumers if si.trigger is not None else ():
                    added.setdefault((si.trigger, consumer), f"swap-in trigger {si.trigger!r} of {s.tensor!r}")
        return added

    def rewrite(self, edit: GraphEdit) -> dict[str, int]:
        import tensorflow as tf

        from ... import _tf_internal as tfi

        graph, swaps, on_host = edit.graph, edit.plan.swaps, edit.swap_in_on == "host"
        tensors = [edit.tensor(s.tensor) for s in swaps]
        with graph.as_default(), tf.control_dependencies(None):
            with tf.device(edit.host):
                outs = [
                    tf.identity(t, name=f"{SWAP_OUT_SCOPE}/{s.tensor.replace(':', '_')}")
                    for s, t in zip(swaps, tensors)
                ]
            with tf.device(edit.host if on_host else edit.device):
                backs = [
                    [
                        tf.identity(out, name=f"{SWAP_IN_SCOPE}/{s.tensor.replace(':', '_')}/{k}")
                        for k in range(len(s.swap_ins))
                    ]
                    for s, out in zip(swaps, outs)
                ]
            lands = backs
            if on_host:
                with tf.device(edit.device):
                    lands = [
                        [tf.identity(b, name=landing_name(s.tensor, k)) for k, b in enumerate(group)]
                        for s, group in zip(swaps, backs)
                    ]
        for swap, tensor, out, group, landed in zip(swaps, tensors, outs, backs, lands):
            mark(out.op, "out")
            for swap_in, back, land in zip(swap.swap_ins, group, landed):
                mark(back.op, "in")
                if land is not back:
                    mark(land.op, "landing")
                if swap_in.trigger is not None:
                    tfi.add_control_input(back.op, edit.op("trigger op", swap_in.trigger))
                edit.rewire(swap_in.consumers, tensor, land, swap.tensor)
        edit.made[self.name] = {s.tensor: out for s, out in zip(swaps, outs)}
        n_in = sum(len(g) for g in backs)
        return {"swap_out": len(outs), "swap_in": n_in, "landing": n_in if on_host else 0}


class Fences(Pass):
    """A forward op waits for an earlier swap-out: a control input from the swap-out (made by
    ``swaps``, which it needs before it)."""

    name, field, needs, adds_edges = "fences", "fences", ("swaps",), True

    def edges(self, edit: GraphEdit) -> Edges:
        """Each fence's op runs after the producer of its tensor (through the swap-out). Refuses a
        fence on a tensor the plan does not swap."""
        swapped = {s.tensor for s in edit.plan.swaps}
        added: Edges = {}
        for fence in edit.plan.fences:
            if fence.tensor not in swapped:
                raise edit.error(f"fence on {fence.tensor!r}, which the plan does not swap")
            added.setdefault((fence.tensor.rpartition(":")[0], fence.op), f"fence on {fence.tensor!r} at {fence.op!r}")
        return added

    def rewrite(self, edit: GraphEdit) -> dict[str, int]:
        from ... import _tf_internal as tfi

        swapped_out = edit.made.get("swaps", {})
        for fence in edit.plan.fences:
            tfi.add_control_input(edit.op("fence op", fence.op), swapped_out[fence.tensor].op)
        return {"fence": len(edit.plan.fences)}
