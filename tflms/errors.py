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
        from .plan import format_bytes

        self.budget = budget
        self.best_peak_bytes = best_peak_bytes
        self.plain_peak_bytes = plain_peak_bytes
        super().__init__(
            f"No swap plan found fits budget={budget} bytes ({format_bytes(budget)}): the best plan's predicted "
            f"device peak is {best_peak_bytes} bytes ({format_bytes(best_peak_bytes)}; "
            f"{format_bytes(plain_peak_bytes)} without LMS; simulator). Raise the budget, lower the "
            f"batch size, or lower min_bytes. Received: budget={budget}"
        )
