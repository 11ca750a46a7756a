"""Short summaries of plans, as ``LMSCallback(verbose=1)`` prints them: :func:`short_summary`."""

from __future__ import annotations

from ..plan.records import SwapPlan, format_bytes

__all__ = ["short_summary"]


def short_summary(plan: SwapPlan, measured_peak: int | None = None) -> str:
    """Two lines on ``plan`` (what ``LMSCallback(verbose=1)`` prints): swaps, recomputes, bytes moved, peaks.

    ``measured_peak`` (bytes, the device's measured peak of the first step) is shown
    next to the predicted one when given.

    Example (for ``cb.plan`` after ``fit`` with ``cb = LMSCallback(...)``; here a plan of
    :func:`tflms.optimize`):
        >>> import tensorflow as tf, tflms
        >>> from tflms.testing.zoo import build
        >>> _, x, y, train_step = build("cnn", batch=16, size=64)
        >>> cf = tf.function(train_step).get_concrete_function(x, y)
        >>> config = tflms.LMSConfig(knobs=tflms.Knobs(swapout_threshold=20))
        >>> plan = tflms.make_plan(tflms.GraphModel.from_func_graph(cf.graph), config)
        >>> print(short_summary(plan))  # doctest: +ELLIPSIS
        tflms plan for ...: ... tensors swapped, ... MiB out and ... MiB back in per step (... swap-ins)...
        predicted device peak (simulator): ... MiB -> ... MiB (...% less); full table: LMSCallback(verbose=2)
    """
    before, after = plan.peak_bytes_before, plan.peak_bytes_after
    back = sum(s.bytes * len(s.swap_ins) for s in plan.swaps)
    less = (1 - after / before) * 100 if before else 0.0
    clones = sum(len(r.ops) * len(r.groups) for r in plan.recomputes)
    lines = [
        f"tflms plan for {plan.function or '<function>'}"
        + (f" ({plan.budget_text})" if plan.budget_text else "")
        + f": {len(plan.swaps)} tensors swapped, "
        f"{format_bytes(plan.swapped_bytes)} out and {format_bytes(back)} back in per step "
        f"({plan.n_swap_ins} swap-ins)"
        + (f"; {_count(len(plan.recomputes), 'tensor')} recomputed ({clones} op clones)" if plan.recomputes else "")
        + (f"; {_count(len(plan.orders), 'ordering edge')}" if plan.orders else "")
        + (f"; {_count(len(plan.sums), 'sum')} added as the terms arrive" if plan.sums else "")
        + (f"; {_count(len(plan.tiles), 'tile')} left out" if plan.tiles else "")
        + {
            "optimizer": "; the optimizer's state and update on the host",
            "weights": "; the weights, the optimizer's state and update on the host",
        }.get(plan.options.get("offload"), ""),
        f"predicted device peak (simulator): {format_bytes(before)} -> {format_bytes(after)} "
        f"({abs(less):.0f}% {'less' if less >= 0 else 'more'})"
        + (f"; measured peak of the first step: {format_bytes(measured_peak)}" if measured_peak else "")
        + "; full table: LMSCallback(verbose=2)",
    ]
    if plan.reason:
        lines.append(f"note: {plan.reason}")
    return "\n".join(lines)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")
