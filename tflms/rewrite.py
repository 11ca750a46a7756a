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
    n_out = n_in = 0
    for swap in plan.swaps:
        try:
            tensor = graph.get_tensor_by_name(swap.tensor)
        except (KeyError, ValueError):
            raise _plan_error(plan, f"no tensor {swap.tensor!r}") from None
        safe = swap.tensor.replace(":", "_")
        with graph.as_default():
            with tf.device(host), tf.control_dependencies(None):
                out = tf.identity(tensor, name=f"{SWAP_OUT_SCOPE}/{safe}")
            tfi.set_attr(out.op, "_grappler_do_not_remove", True)
            tfi.set_attr(out.op, SWAP_ATTR, "out")
            n_out += 1
            for k, swap_in in enumerate(swap.swap_ins):
                deps = []
                if swap_in.trigger is not None:
                    try:
                        deps.append(graph.get_operation_by_name(swap_in.trigger))
                    except (KeyError, ValueError):
                        raise _plan_error(plan, f"no trigger op {swap_in.trigger!r}") from None
                with tf.device(device), tf.control_dependencies(None), tf.control_dependencies(deps):
                    back = tf.identity(out, name=f"{SWAP_IN_SCOPE}/{safe}/{k}")
                tfi.set_attr(back.op, "_grappler_do_not_remove", True)
                tfi.set_attr(back.op, SWAP_ATTR, "in")
                n_in += 1
                for op_name, index in swap_in.consumers:
                    try:
                        op = graph.get_operation_by_name(op_name)
                    except (KeyError, ValueError):
                        raise _plan_error(plan, f"no consumer op {op_name!r}") from None
                    if index >= len(op.inputs) or op.inputs[index].name != tensor.name:
                        raise _plan_error(plan, f"input {index} of {op_name!r} is not {swap.tensor!r}")
                    tfi.update_input(op, index, back)
    return {"swap_out": n_out, "swap_in": n_in}
