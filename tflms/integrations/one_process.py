"""How :class:`tflms.LMSCallback` trains in one process: :class:`OneProcess`, the mode that Horovod's
(``tflms.integrations.horovod.fit.HorovodFit``) replaces under ``horovodrun``."""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import keras

from ..errors import LMSWarning
from ..plan.records import SwapPlan

__all__ = ["OneProcess", "TrainStep"]

#: A replacement for ``model.train_step``: called as ``train_step(model, data)``, returns the logs.
TrainStep = Callable[[keras.Model, Any], Any]


class OneProcess:
    """How :class:`LMSCallback` trains in one process: what Horovod's mode
    (``tflms.integrations.horovod.fit.HorovodFit``) does differently, done the plain way."""

    #: Whether the callback trains data-parallel under Horovod.
    horovod = False
    #: Whether Keras may call the batch-end hooks from a thread pool.
    async_safe = True
    #: Whether the step is installed (unrewritten) where it cannot be rewritten.
    installs_without_lms = False
    #: Appended to the ``run_eagerly=True`` warning.
    eager_note = ""

    def make_train_step(self, model: keras.Model, train_step: TrainStep | None) -> Callable[[Any], Any]:
        """``model.train_step``, or ``train_step`` given to the callback."""
        return model.train_step if train_step is None else functools.partial(train_step, model)

    def several_replicas(self, replicas: int) -> bool:
        """A distribution strategy with ``replicas`` > 1: warn and train plain (False)."""
        warnings.warn(
            f"tflms.LMSCallback does not support a distribution strategy with {replicas} replicas; "
            "fit runs without LMS. Use one replica per process (e.g. Horovod).",
            LMSWarning,
            stacklevel=3,
        )
        return False

    def step_to_trace(self, step: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """What is traced (and rewritten) as the per-batch step."""
        return step

    def set_params(self, params: dict) -> None:
        """Called with the parameters Keras hands the callbacks."""

    def train_begin(self, model: keras.Model) -> None:
        """Called at train begin, after the train function is installed."""

    def before_run(self, model_ref: weakref.ReferenceType, iterator: Any) -> None:
        """Called by the installed train function before each run of the step."""

    def first_plan(self, plan: SwapPlan) -> str | None:
        """Called once per installation with the first plan; returns the callback's ``fingerprint``."""
        return None

    def prints(self) -> bool:
        """Whether this process prints the plan (``verbose``)."""
        return True

    def batch_end(self, logs: dict) -> None:
        """Called at batch end with Keras's logs (to change in place)."""

    def epoch_end(self, logs: dict) -> None:
        """Called at epoch end with Keras's logs, before the memory entries are added."""
