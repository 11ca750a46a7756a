"""Apply a :class:`~tflms.SwapPlan` to a (copied) FuncGraph.

For each swap: one ``Identity`` on ``host`` (the swap-out) reading the device
tensor; for each swap-in an ``Identity`` on ``device`` reading the swap-out, with
a control input from its trigger; the consumers of the group rewired to it. Every
swap op carries ``_grappler_do_not_remove=True`` and ``_tflms_swap`` ("out"/"in"),
and is named under ``tflms_swapout/`` or ``tflms_swapin/``.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from . import _tf_internal as tfi
from .plan import SwapPlan

__all__ = ["apply_plan", "SWAP_OUT_SCOPE", "SWAP_IN_SCOPE", "SWAP_ATTR", "is_rewritten"]

SWAP_OUT_SCOPE = "tflms_swapout"
SWAP_IN_SCOPE = "tflms_swapin"
SWAP_ATTR = "_tflms_swap"


def is_rewritten(graph: Any) -> bool:
    """True if ``graph`` already holds tflms swap ops."""
    return any(op.name.startswith((SWAP_OUT_SCOPE + "/", SWAP_IN_SCOPE + "/")) for op in graph.get_operations())


def _plan_error(plan: SwapPlan, what: str) -> ValueError:
    return ValueError(
        f"The plan does not fit this function: {what}. Make the plan from the same traced "
        f"function (same model, input signature and options). Received: plan for {plan.function!r}"
    )


def apply_plan(graph: Any, plan: SwapPlan, device: str, host: str) -> dict[str, int]:
    """Edit ``graph`` in place; return op-count changes, e.g. ``{'swap_out': 3, 'swap_in': 4}``."""

    def lookup(kind: str, get: Any, name: str) -> Any:
        try:
            return get(name)
        except (KeyError, ValueError):
            raise _plan_error(plan, f"no {kind} {name!r}") from None

    tensors = [lookup("tensor", graph.get_tensor_by_name, s.tensor) for s in plan.swaps]
    with graph.as_default(), tf.control_dependencies(None):
        with tf.device(host):
            outs = [
                tf.identity(t, name=f"{SWAP_OUT_SCOPE}/{s.tensor.replace(':', '_')}")
                for s, t in zip(plan.swaps, tensors)
            ]
        with tf.device(device):
            backs = [
                [
                    tf.identity(out, name=f"{SWAP_IN_SCOPE}/{s.tensor.replace(':', '_')}/{k}")
                    for k in range(len(s.swap_ins))
                ]
                for s, out in zip(plan.swaps, outs)
            ]
    for swap, tensor, out, group in zip(plan.swaps, tensors, outs, backs):
        tfi.set_attr(out.op, "_grappler_do_not_remove", True)
        tfi.set_attr(out.op, SWAP_ATTR, "out")
        for swap_in, back in zip(swap.swap_ins, group):
            tfi.set_attr(back.op, "_grappler_do_not_remove", True)
            tfi.set_attr(back.op, SWAP_ATTR, "in")
            if swap_in.trigger is not None:
                tfi.add_control_input(back.op, lookup("trigger op", graph.get_operation_by_name, swap_in.trigger))
            for op_name, index in swap_in.consumers:
                op = lookup("consumer op", graph.get_operation_by_name, op_name)
                if index >= len(op.inputs) or op.inputs[index].name != tensor.name:
                    raise _plan_error(plan, f"input {index} of {op_name!r} is not {swap.tensor!r}")
                tfi.update_input(op, index, back)
    return {"swap_out": len(outs), "swap_in": sum(len(g) for g in backs)}
