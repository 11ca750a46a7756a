"""Large model support for Keras 3 ``model.fit``: :class:`LMSCallback`.

How it hooks into Keras 3 (TensorFlow backend; pinned by ``tests/test_keras.py``):

* ``fit`` calls ``model.make_train_function()``, then ``callbacks.on_train_begin()``,
  then ``model.train_function(iterator)`` once per step (or per ``steps_per_execution``
  steps), and ``callbacks.on_train_end()`` after the last epoch.
* ``make_train_function`` is ``model._make_function(model.train_step)``: it wraps the
  step it is given in ``one_step_on_data`` (a ``tf.function`` that runs the step through
  the distribute strategy) and that in ``multi_step_on_iterator`` (the
  ``steps_per_execution`` loop), and returns the Python ``function(iterator)`` that
  ``fit`` calls.

At train begin the callback hands ``_make_function`` a :class:`tflms.LMSFunction` around
the model's ``train_step`` instead of the bare method. That step is the one graph that
holds forward, backward and optimizer ops, so it is the one tflms rewrites (the outer
Keras functions only *call* it; tflms never rewrites inside call ops). Everything else,
the ``steps_per_execution`` loop, optionals, metric logs, distribute-strategy reduction,
is Keras's own code. At train end the plain Keras function is put back, so ``fit``
without the callback, ``train_on_batch``, ``evaluate`` and ``predict`` run as if the
callback had never been used. A later ``fit`` with the same callback re-installs the
same rewritten step: nothing is traced or rewritten twice (until ``model.compile``
makes Keras build a new train function).

Example:
    >>> cb = tflms.LMSCallback(swapout_threshold=40, verbose=1)      # doctest: +SKIP
    >>> model.compile(optimizer="adam", loss="mse", jit_compile=False)  # doctest: +SKIP
    >>> model.fit(x, y, batch_size=64, epochs=3, callbacks=[cb])     # doctest: +SKIP
    >>> print(cb.plan.summary())                                     # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from .config import LMSConfig
from .core import LMSFunction
from .core import function as lms_function
from .errors import LMSWarning
from .plan import SwapPlan

__all__ = ["LMSCallback"]

log = logging.getLogger("tflms")

#: A replacement for ``model.train_step``: called as ``train_step(model, data)``, returns the logs.
TrainStep = Callable[[keras.Model, Any], Any]


@dataclasses.dataclass
class _Installation:
    """What the callback built for one model's Keras train function."""

    model: weakref.ReferenceType
    keras_function: Callable[[Any], Any]  # what Keras built (restored at train end)
    step: LMSFunction  # the rewritten per-batch step
    function: Callable[[Any], Any]  # what is installed as model.train_function while fitting


class LMSCallback(keras.callbacks.Callback):
    """Train with large model support in Keras 3 ``model.fit``.

    At train begin the callback makes the per-batch training step an LMS step
    (activations swapped to the host, see :func:`tflms.function`) and installs it
    as ``model.train_function``; at train end the plain one is put back.

    Args:
        config: a :class:`tflms.LMSConfig`; keyword ``options`` override its fields.
        verbose: when true, print the plan summary once when the step is first
            traced (during the first training step).
        train_step: optional replacement for ``model.train_step``, called as
            ``train_step(model, data)`` inside the rewritten step; it must return the
            logs like ``Model.train_step``. Subclasses can override
            :meth:`make_train_step` instead.
        **options: :class:`tflms.LMSConfig` fields, e.g. ``device='/device:GPU:0'``,
            ``swapout_threshold=40``, ``batch_size=64``. Pass ``batch_size`` when the
            batches have no static size (a partial last batch, a dataset batched
            without ``drop_remainder``): the planner then needs it to size tensors,
            and the callback warns when it is missing.

    Attributes:
        plan: the :class:`tflms.SwapPlan` of the step (``None`` until the first
            training step has traced it).
        plans: plans of every input signature traced so far (usually one).

    Raises:
        TypeError: unknown option (the message lists the valid ones), or a
            ``train_step`` that is not callable.
        ValueError: an invalid option value; at train begin, a model compiled with
            ``jit_compile=True`` (XLA would drop the swap ops).

    The model runs plain, with a :class:`tflms.LMSWarning`, when it was compiled with
    ``run_eagerly=True`` or trains under a distribution strategy with several replicas.

    Example:
        >>> cb = tflms.LMSCallback(device="/device:GPU:0", verbose=True)    # doctest: +SKIP
        >>> model.compile("adam", "sparse_categorical_crossentropy", jit_compile=False)  # doctest: +SKIP
        >>> model.fit(ds, epochs=2, callbacks=[cb])                         # doctest: +SKIP
        >>> cb.plan.swaps[0].tensor                                         # doctest: +SKIP
        'resnet50_1/conv1_relu_1/Relu:0'
    """

    def __init__(
        self,
        config: LMSConfig | None = None,
        *,
        verbose: bool | int = 0,
        train_step: TrainStep | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        self.config = LMSConfig.from_options(config, **options)
        if isinstance(verbose, bool):
            verbose = int(verbose)
        if not isinstance(verbose, int) or verbose < 0:
            raise ValueError(f"verbose must be a bool or an integer >= 0. Received: verbose={verbose!r}")
        if train_step is not None and not callable(train_step):
            raise TypeError(
                f"train_step must be a callable (model, data) -> logs, or None. Received: train_step={train_step!r}"
            )
        self.verbose = verbose
        self._train_step = train_step
        self._installation: _Installation | None = None
        self._shown = 0  # plans already reported
        self._checked_batch = False  # batch dimension of the fed data looked at

    # -- extension point -------------------------------------------------------------

    def make_train_step(self, model: keras.Model) -> Callable[[Any], Any]:
        """The per-batch step to rewrite: ``step(data) -> logs``.

        Default: ``model.train_step`` (so a model that overrides ``train_step`` keeps
        its own), or the ``train_step`` given to the constructor. Override this to
        wrap or replace the step, e.g. to average gradients across workers; whatever
        it returns is traced into the one graph that tflms rewrites.
        """
        if self._train_step is not None:
            return functools.partial(self._train_step, model)
        return model.train_step

    # -- public state -----------------------------------------------------------------

    @property
    def plans(self) -> list[SwapPlan]:
        """Plans of every input signature traced so far for the current model."""
        return [] if self._installation is None else self._installation.step.plans

    @property
    def plan(self) -> SwapPlan | None:
        """The plan of the first traced step (``None`` before the first training step)."""
        plans = self.plans
        return plans[0] if plans else None

    @property
    def step(self) -> LMSFunction | None:
        """The rewritten per-batch step (an :class:`tflms.LMSFunction`), once built."""
        return None if self._installation is None else self._installation.step

    # -- Keras hooks ------------------------------------------------------------------

    def on_train_begin(self, logs: dict | None = None) -> None:
        model = self.model
        if not self._supported(model):
            return
        inst = self._installation
        current = model.train_function
        if inst is not None and inst.model() is model and current is inst.function:
            return  # still installed (a previous fit ended without on_train_end)
        if inst is None or inst.model() is not model or current is not inst.keras_function:
            if current is None:  # fit always builds it first; train_on_batch-style callers may not
                model.make_train_function()
                current = model.train_function
            inst = self._build(model, current)
            self._installation = inst
            self._shown = 0
            self._checked_batch = False
        model.train_function = inst.function

    def on_train_end(self, logs: dict | None = None) -> None:
        self.uninstall()

    def uninstall(self) -> None:
        """Put Keras's plain train function back (done at train end).

        Call it after a ``fit`` that was interrupted by an exception, so that a
        later ``fit`` without the callback runs without LMS.
        """
        inst = self._installation
        model = None if inst is None else inst.model()
        if model is not None and model.train_function is inst.function:
            model.train_function = inst.keras_function

    # -- internals --------------------------------------------------------------------

    def _supported(self, model: keras.Model) -> bool:
        if model.run_eagerly:
            warnings.warn(
                "tflms.LMSCallback: the model was compiled with run_eagerly=True, so fit runs eagerly "
                "without LMS. Compile with run_eagerly=False to swap tensors.",
                LMSWarning,
                stacklevel=2,
            )
            return False
        if model.jit_compile:
            raise ValueError(
                "tflms.LMSCallback cannot swap tensors in an XLA-compiled train step: XLA compiles the "
                "whole step and drops the swap ops. Compile the model with jit_compile=False (with the "
                "TensorFlow backend on a GPU, Keras's default jit_compile='auto' turns XLA on). "
                f"Received: model.jit_compile={model.jit_compile!r}"
            )
        replicas = model.distribute_strategy.num_replicas_in_sync
        if replicas > 1:
            warnings.warn(
                f"tflms.LMSCallback does not support a distribution strategy with {replicas} replicas; "
                "fit runs without LMS. Use one replica per process (e.g. Horovod).",
                LMSWarning,
                stacklevel=2,
            )
            return False
        return True

    def _build(self, model: keras.Model, keras_function: Callable[[Any], Any]) -> _Installation:
        # Traced as Keras traces its one_step_on_data: without AutoGraph (do_not_convert) and
        # with reduce_retracing=True.
        step = tf.autograph.experimental.do_not_convert(self.make_train_step(model))
        lms_step = lms_function(step, config=self.config, reduce_retracing=True)
        run = model._make_function(lms_step)  # noqa: SLF001 - pinned in tests/test_keras.py
        installation: _Installation

        def train_function(iterator: Any) -> Any:
            if not self._checked_batch:
                self._checked_batch = True
                self._check_batch_dimension(iterator)
            logs = run(iterator)
            if len(lms_step.plans) > self._shown:
                self._report(installation)
            return logs

        installation = _Installation(weakref.ref(model), keras_function, lms_step, train_function)
        return installation

    def _check_batch_dimension(self, iterator: Any) -> None:
        """Warn when the planner would size tensors with batch 1 for lack of ``batch_size``."""
        if self.config.batch_size is not None:
            return
        spec = getattr(iterator, "element_spec", None)
        specs = [s for s in tf.nest.flatten(spec) if isinstance(s, tf.TensorSpec) and s.shape.rank]
        if any(s.shape[0] is None for s in specs):
            warnings.warn(
                "tflms.LMSCallback: the batches fit feeds have an unknown batch dimension (a partial last "
                "batch, or a dataset batched without drop_remainder=True), so the planner sizes tensors "
                "as if the batch were 1 and may swap little or nothing. Pass batch_size=<your batch size> "
                "to LMSCallback. Received: batch_size=None",
                LMSWarning,
                stacklevel=3,
            )

    def _report(self, inst: _Installation) -> None:
        plans = inst.step.plans
        for plan in plans[self._shown :]:
            log.info("tflms.LMSCallback: %d tensors swapped in %s", len(plan.swaps), plan.function)
            if self.verbose:
                print(plan.summary())
        self._shown = len(plans)
