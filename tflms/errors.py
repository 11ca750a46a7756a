"""Exceptions and warnings of tflms."""

from __future__ import annotations

__all__ = ["TflmsError", "LMSWarning", "BudgetError"]


class TflmsError(Exception):
    """Base class of the errors tflms raises itself (each also keeps its usual base, e.g. ``ValueError``)."""


class LMSWarning(UserWarning):
    """tflms could not apply LMS as asked and ran the step without (part of) it."""


class BudgetError(TflmsError, ValueError):
    """No plan of the autotuner's search brings the predicted device peak within the budget.

    ``best_peak_bytes`` is the lowest predicted peak the search saw;
    ``plain_peak_bytes`` the peak without LMS. Both are simulator predictions.
    """

    def __init__(self, budget: int, best_peak_bytes: int, plain_peak_bytes: int) -> None:
        from ._util import format_sizes

        self.budget = budget
        self.best_peak_bytes = best_peak_bytes
        self.plain_peak_bytes = plain_peak_bytes
        super().__init__(
            f"No swap plan brings the predicted device peak within budget={budget} ({format_sizes(budget)}): "
            f"the best plan's predicted peak is {format_sizes(best_peak_bytes, exact=True)} "
            f"({format_sizes(plain_peak_bytes)} without LMS; simulator). Raise the budget, lower the batch size, "
            "or lower min_bytes (size strings: KB/MB/GB are powers of 10, KiB/MiB/GiB and K/M/G powers of 2); "
            "on_budget_miss='best' plans with the best plan anyway. "
            f"Received: budget={budget}"
        )
