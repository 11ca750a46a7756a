"""Exceptions and warnings of tflms."""

from __future__ import annotations

__all__ = ["LMSWarning"]


class LMSWarning(UserWarning):
    """tflms could not apply LMS as asked and ran the step without (part of) it."""
