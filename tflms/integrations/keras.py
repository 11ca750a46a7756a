"""Large model support for Keras 3 and tf-keras 2.x ``model.fit``: :class:`LMSCallback`.

How it hooks into Keras 3 (TensorFlow backend; pinned by ``tests/integrations/test_keras.py``):

* ``fit`` calls ``model.make_train_function()``, then ``callbacks.on_train_begin()``,
  then ``model.train_function(iterator)`` once per step (or per ``steps_per_execution``
  steps), and ``callbacks.on_train_end()`` after the last epoch.
* ``make_train_function`` is ``model._make_function(model.train_step)``: it wraps the
  step it is given in ``one_step_on_data`` (a ``tf.function`` that runs the step through
  the distribute strategy) and that in ``multi_step_on_iterator`` (the
  ``steps_per_execution`` loop), and returns the Python ``function(iterator)`` that
  ``fit`` calls.

At train begin the callback installs, as ``model.train_function``, a function that takes each
batch from ``fit``'s iterator as concrete tensors and runs a :class:`tflms.LMSFunction` around
the model's ``train_step`` on it, as Keras's ``one_step_on_data`` runs the step (optional
inputs as ``None``, under the model's distribution strategy, outputs reduced across replicas),
``steps_per_execution`` batches per call. That step is the one graph that holds forward,
backward and optimizer ops, so it is the one tflms rewrites; fed concrete batches, it is
traced and planned once per batch shape, so every plan is made for the real batch even where
the dataset's shapes are unknown (KerasHub's tasks, a partial last batch, a generator). At
train end the plain Keras function is put back, so ``fit``
without the callback, ``train_on_batch``, ``evaluate`` and ``predict`` run as if the
callback had never been used. A later ``fit`` with the same callback re-installs the
same rewritten step: nothing is traced or rewritten twice (until ``model.compile``
makes Keras build a new train function). The Keras internals used are wrapped in
:mod:`tflms._tf_internal` (``keras_*``).

A tf-keras model (``import tf_keras``, or ``tf.keras`` under ``TF_USE_LEGACY_KERAS=1``;
pinned by ``tests/integrations/test_tf_keras.py``) is fitted the same way: tf-keras's
``fit`` also calls ``make_train_function()``, ``on_train_begin`` and then
``model.train_function(iterator)``, and its ``CallbackList`` asks each callback
``_implements_train_batch_hooks()`` (and the test and predict ones), which the callback
answers. The installed function runs the rewritten step as tf-keras's ``step_function``
runs ``run_step``: ``train_step``, then ``model._train_counter`` counted inside the step,
under the strategy, reduced by ``model.distribute_reduction_method``, as many batches as
``model.steps_per_execution`` holds at each call (``tflms._tf_internal``'s ``tf_keras_*``).
``horovod=True`` and ``offload`` need a Keras 3 model.

What differs between one process and data parallelism under ``horovodrun`` is a *mode*
the callback holds: :class:`OneProcess` here, Horovod's (``tflms.integrations.horovod.fit``,
pinned by ``tests/integrations/test_horovod_keras.py``) with ``LMSCallback(horovod=True)`` or
:class:`tflms.horovod.HorovodLMSCallback`. This module imports nothing of Horovod until that
is asked for.

Example (without a GPU, or ``device=``, a warning says the step trains unrewritten;
the plan is made all the same)::

    >>> import keras, numpy as np, tflms
    >>> L = keras.layers
    >>> model = keras.Sequential([keras.Input((64,)), L.Dense(1024, activation="relu"),
    ...                           L.Dense(1024, activation="relu"), L.Dense(1)])
    >>> model.compile(optimizer="adam", loss="mse", jit_compile=False)
    >>> cb = tflms.LMSCallback(knobs=tflms.Knobs(swapout_threshold=2))
    >>> history = model.fit(np.ones((128, 64)), np.zeros((128, 1)), batch_size=64, epochs=2,
    ...                     callbacks=[cb], verbose=0)
    >>> print(cb.plan.summary().splitlines()[0])  # doctest: +ELLIPSIS
    tflms plan for train_step: 2 tensors swapped (512.0 KiB out, 2 swap-ins), ... ops
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from .. import _tf_internal as tfi
from ..config import LMSConfig
from ..errors import LMSWarning
from ..plan.records import SwapPlan
from ..report.summary import short_summary
from .function import LMSFunction, check_call_settings, device_memory, resolve_device
from .one_process import OneProcess, TrainStep

__all__ = ["LMSCallback", "XLA_MODES"]

log = logging.getLogger("tflms")


#: Values of ``LMSCallback(xla=...)``: what to do with a model whose ``jit_compile`` is on.
XLA_MODES = ("disable", "error")

#: Keys of the epoch logs the callback adds where the device reports its memory.
MEASURED_PEAK_KEY = "measured_peak_bytes"
PREDICTED_PEAK_KEY = "predicted_peak_bytes"
#: Key of the epoch logs: how many times the rewritten step was planned again after it ran out of
#: device memory, so far (:mod:`tflms.integrations.recovery`).
REPLANS_KEY = "tflms_replans"


@dataclasses.dataclass
class _Installation:
    """What the callback built for one model's Keras train function."""

    model: weakref.ReferenceType
    keras_function: Callable[[Any], Any]  # what Keras built (restored at train end)
    step: LMSFunction | None  # the rewritten per-batch step (None: no LMS, or before the first batch)
    function: Callable[[Any], Any]  # what is installed as model.train_function while fitting
    lms: bool = True  # whether the installed function runs the rewritten step


class LMSCallback(keras.callbacks.Callback):
    """Train with large model support in Keras 3 ``model.fit`` (tf-keras 2.x ``model.fit`` too).

    At train begin the callback makes the per-batch training step an LMS step
    (activations swapped to the host, see :func:`tflms.function`) and installs it
    as ``model.train_function``; at train end the plain one is put back.

    Args:
        config: a :class:`tflms.LMSConfig`; keyword ``options`` override its fields.
        verbose: 0 prints nothing; 1 (or True) prints a short summary once, when
            the step is first traced (during the first training step): tensors
            swapped, bytes moved per step, the predicted device peak before and
            after, and where the device reports its memory the measured peak of that
            first step; 2 prints the full plan table (:meth:`tflms.SwapPlan.summary`)
            instead. On rank 0 only under Horovod.
        xla: what to do with a model compiled with XLA (``model.jit_compile`` true),
            whose swap ops XLA would drop. ``"disable"`` (default): when the XLA
            setting can come from Keras's default ``jit_compile="auto"`` (which turns
            XLA on when a GPU is present), build the rewritten training step without
            XLA and warn once (:class:`tflms.LMSWarning`); Keras's own ``evaluate``
            and ``predict`` keep XLA. ``"error"``: raise ``ValueError`` instead.
            Where ``"auto"`` would not have chosen XLA (no GPU, a distribution
            strategy, a model XLA does not support), ``jit_compile=True`` was an
            explicit request and raises in both modes. Keras keeps only the
            resolved value, so on a GPU an explicit ``jit_compile=True`` looks like
            ``"auto"``: pass ``xla="error"`` to be sure XLA is never turned off.
        train_step: optional replacement for ``model.train_step``, called as
            ``train_step(model, data)`` inside the rewritten step; it must return the
            logs like ``Model.train_step``. Subclasses can override
            :meth:`make_train_step` instead.
        horovod: ``True``: data-parallel training under ``horovodrun``, as
            :class:`tflms.horovod.HorovodLMSCallback` documents it (which is this callback
            with ``horovod=True`` and Horovod's own options); also for a subclass of this
            class. ``False`` (default): one process.
        manual_memory_optimizer: how the rewritten train function is called, as
            :func:`tflms.function` documents it (default ``True``).
        layout_optimizer: how the rewritten train function is called, as
            :func:`tflms.function` documents it (default ``False``).
        **options: :class:`tflms.LMSConfig` fields, e.g. ``device='/device:GPU:0'`` or
            ``devices=['/device:GPU:0', '/device:GPU:1']`` (the step placed across them),
            ``knobs=tflms.Knobs(swapout_threshold=40)``. No batch size is needed: the callback plans for the
            shapes ``fit`` feeds (one plan per concrete shape, a last partial batch
            included). With ``offload="optimizer"`` the
            callback builds the model's optimizer with its state on the host at train begin
            (:func:`tflms.build_optimizer`; the Keras 3 optimizers checked are
            :data:`tflms.integrations.offload.CHECKED_OPTIMIZERS`), and the
            optimizer's update runs there (:mod:`tflms.plan.passes.offload`). With
            ``offload="weights"`` it first moves the model's trainable variables to the host
            (:func:`tflms.integrations.offload.place_weights`; the model must fit the device
            once, as built, and its optimizer must not be built yet).

    Epoch logs (Keras ``logs``, hence ``History`` and the progress bar): where the
    compute device reports its memory (``tf.config.experimental.get_memory_info``:
    a GPU; a CPU device only in a process started with
    ``TF_CPU_ALLOCATOR_USE_BFC=true``) the callback adds, at each epoch end,

    * ``measured_peak_bytes``: the *measured* peak of the device's allocator during
      the epoch (training and validation; the statistics are reset at each epoch
      begin with ``tf.config.experimental.reset_memory_stats``);
    * ``predicted_peak_bytes``: the simulator's predicted peak of the rewritten
      step, ``plan.peak_bytes_after`` (the largest over the traced signatures).

    Elsewhere (or when the rewrite is skipped for lack of a device) neither is added. Once the
    rewritten step was planned again after running out of device memory, ``tflms_replans``
    counts those times (each such step is undone and runs again on the same batch:
    :mod:`tflms.integrations.recovery`).

    Attributes:
        plan: the :class:`tflms.SwapPlan` of the step (``None`` until the first
            training step has traced it).
        plans: plans of every input signature traced so far (usually one).
        horovod: whether the callback trains data-parallel under Horovod.
        fingerprint: under Horovod, the plan fingerprint that every rank was
            checked to share; always ``None`` here.

    Raises:
        TypeError: unknown option (the message lists the valid ones), a knob's name given
            as an option (the message says to write ``knobs=tflms.Knobs(...)``), a
            ``train_step`` that is not callable, or a ``horovod`` that is not a bool.
        ValueError: an invalid option value; at train begin, a model compiled with
            ``jit_compile=True`` where that cannot be Keras's ``"auto"``, or with
            ``xla="error"`` (XLA would drop the swap ops).

    A tf-keras model (``tf_keras``, or ``tf.keras`` under ``TF_USE_LEGACY_KERAS=1``) trains the
    same way, bit-identical to tf-keras's own ``fit``; ``jit_compile=True`` raises (tf-keras
    has no ``"auto"``), and ``horovod=True`` and ``offload`` raise ``ValueError`` at train begin.

    The model runs plain, with a :class:`tflms.LMSWarning`, when it was compiled with
    ``run_eagerly=True`` or trains under a distribution strategy with several replicas.

    Example (one process; ``device=None`` is the first GPU, and without one the step
    trains unrewritten, with a warning):
        >>> import keras, tensorflow as tf, tflms
        >>> from tflms.testing.zoo import build
        >>> model, x, y, _ = build("cnn", batch=32, size=32)
        >>> model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
        >>> ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8, drop_remainder=True)
        >>> cb = tflms.LMSCallback(knobs=tflms.Knobs(swapout_threshold=20))
        >>> history = model.fit(ds, epochs=2, callbacks=[cb], verbose=0)
        >>> cb.plan.swaps[0].tensor  # doctest: +ELLIPSIS
        '...:0'
    """

    def __init__(
        self,
        config: LMSConfig | None = None,
        *,
        verbose: bool | int = 0,
        train_step: TrainStep | None = None,
        horovod: bool = False,
        xla: str = "disable",
        manual_memory_optimizer: bool = True,
        layout_optimizer: bool = False,
        **options: Any,
    ) -> None:
        super().__init__()
        self.config = LMSConfig.from_options(config, **options)
        check_call_settings(manual_memory_optimizer=manual_memory_optimizer, layout_optimizer=layout_optimizer)
        self._call_settings = {"manual_memory_optimizer": manual_memory_optimizer, "layout_optimizer": layout_optimizer}
        if isinstance(verbose, bool):
            verbose = int(verbose)
        if not isinstance(verbose, int) or verbose < 0:
            raise ValueError(f"verbose must be a bool or an integer >= 0. Received: verbose={verbose!r}")
        if train_step is not None and not callable(train_step):
            raise TypeError(
                f"train_step must be a callable (model, data) -> logs, or None. Received: train_step={train_step!r}"
            )
        if not isinstance(horovod, bool):
            raise TypeError(f"horovod must be True or False. Received: horovod={horovod!r}")
        if xla not in XLA_MODES:
            raise ValueError(f"xla must be one of {', '.join(map(repr, XLA_MODES))}. Received: xla={xla!r}")
        self.verbose = verbose
        self.xla = xla
        self.fingerprint: str | None = None
        self._train_step = train_step
        self._installation: _Installation | None = None
        self._shown = 0  # plans already reported
        self._measured_device: str | None = None  # device whose peak this epoch's logs report
        self._peaks_seen = 0  # the step's measured peaks before this epoch
        self._mode: Any = OneProcess()
        if horovod and self.config.knobs.op_profile == "auto":
            raise ValueError(
                "op_profile='auto' is not available with horovod=True: each rank would profile its own first step "
                "and plan again from its own times, so the ranks' plans could differ. Profile one rank's step "
                "(tflms.testing.profile.profile_ops(...).save(path)) and pass knobs=tflms.Knobs(op_profile=path) "
                "on every rank. "
                "Received: op_profile='auto'"
            )
        if horovod and self.config.offload == "weights":
            raise ValueError(
                "offload='weights' is not available with horovod=True yet: each rank's weights would live on its "
                "host and its copies be averaged there. Pass offload='optimizer' (averaged on the host) or None. "
                "Received: offload='weights'"
            )
        if horovod:
            from .horovod.fit import HorovodFit  # imports Horovod's integration only when asked

            self._mode = HorovodFit()

    # -- extension point -------------------------------------------------------------

    def make_train_step(self, model: keras.Model) -> Callable[[Any], Any]:
        """The per-batch step to rewrite: ``step(data) -> logs``.

        Default: ``model.train_step`` (so a model that overrides ``train_step`` keeps
        its own), or the ``train_step`` given to the constructor. Override this to
        wrap or replace the step; whatever it returns is traced into the one graph
        that tflms rewrites.
        """
        return self._mode.make_train_step(model, self._train_step)

    # -- public state -----------------------------------------------------------------

    @property
    def plans(self) -> list[SwapPlan]:
        """Plans of every input signature traced so far for the current model."""
        inst = self._installation
        return [] if inst is None or inst.step is None else inst.step.plans

    @property
    def plan(self) -> SwapPlan | None:
        """The plan of the first traced step (``None`` before the first training step)."""
        plans = self.plans
        return plans[0] if plans else None

    @property
    def step(self) -> LMSFunction | None:
        """The rewritten per-batch step (an :class:`tflms.LMSFunction`), once built."""
        return None if self._installation is None else self._installation.step

    @property
    def horovod(self) -> bool:
        """Whether the callback trains data-parallel under Horovod."""
        return self._mode.horovod

    @property
    def async_safe(self) -> bool:
        """Whether Keras may call the batch-end hooks from a thread pool: in one process (they do
        nothing); not under Horovod (the log averaging is a collective every rank issues in order)."""
        return self._mode.async_safe

    # -- Keras hooks ------------------------------------------------------------------

    def set_params(self, params: dict) -> None:
        self._mode.set_params(params)
        super().set_params(params)

    def on_train_begin(self, logs: dict | None = None) -> None:
        model = self.model
        if tfi.tf_keras_model(model):
            self._check_tf_keras()
        lms = self._supported(model)
        if lms and self.config.offload:
            self._build_optimizer(model)
        if lms or self._mode.installs_without_lms:
            self._install(model, lms=lms)
        self._mode.train_begin(model)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if logs:
            self._mode.batch_end(logs)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        step = self.step
        self._peaks_seen = 0 if step is None else len(step.measured_peaks)  # none before the first batch
        self._measured_device = self._memory_device()
        if self._measured_device is not None:
            try:
                tf.config.experimental.reset_memory_stats(self._measured_device)
            except (ValueError, tf.errors.OpError):
                self._measured_device = None

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs:
            self._mode.epoch_end(logs)
        if logs is not None:
            logs.update(self._memory_logs())

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

    # -- tf-keras's callback protocol (its CallbackList asks every callback these) ----

    def _implements_train_batch_hooks(self) -> bool:
        """Whether tf-keras calls the train batch hooks: where a subclass overrides one (the callback's
        own do nothing in one process, so tf-keras need not sync each batch's logs for it)."""
        return _overrides(self, ("on_batch_begin", "on_batch_end", "on_train_batch_begin", "on_train_batch_end"))

    def _implements_test_batch_hooks(self) -> bool:
        """Whether tf-keras calls the test batch hooks: where a subclass overrides one."""
        return _overrides(self, ("on_test_batch_begin", "on_test_batch_end"))

    def _implements_predict_batch_hooks(self) -> bool:
        """Whether tf-keras calls the predict batch hooks: where a subclass overrides one."""
        return _overrides(self, ("on_predict_batch_begin", "on_predict_batch_end"))

    # -- internals --------------------------------------------------------------------

    def _install(self, model: keras.Model, lms: bool) -> None:
        """Install the callback's train function (built at most once per Keras train function)."""
        inst = self._installation
        current = model.train_function
        if inst is not None and inst.model() is model and current is inst.function:
            return  # still installed (a previous fit ended without on_train_end)
        if inst is None or inst.model() is not model or current is not inst.keras_function:
            if current is None:  # fit always builds it first; train_on_batch-style callers may not
                model.make_train_function()
                current = model.train_function
            inst = self._build(model, current, lms)
            self._installation = inst
            self._shown = 0
            self.fingerprint = None
        model.train_function = inst.function

    def _check_tf_keras(self) -> None:
        """Refuse, for a tf-keras model, the options that need Keras 3 (raises ``ValueError``)."""
        refused = {
            "horovod": self.horovod,
            "offload": self.config.offload,
        }
        asked = {name: value for name, value in refused.items() if value}
        if asked:
            raise ValueError(
                "tflms.LMSCallback with a tf-keras model (tf_keras, or tf.keras under TF_USE_LEGACY_KERAS=1) "
                "swaps activations only: horovod=True and offload handle a Keras 3 model's optimizer and "
                "variables. Leave them out, or use a Keras 3 model for them. Received: "
                + ", ".join(f"{name}={value!r}" for name, value in asked.items())
            )

    def _supported(self, model: keras.Model) -> bool:
        """Whether the model's step can be rewritten (warns or raises when not)."""
        if model.run_eagerly:
            warnings.warn(
                f"tflms.LMSCallback: the model was compiled with run_eagerly=True, so fit runs eagerly "
                f"without LMS{self._mode.eager_note}. Compile with run_eagerly=False to swap tensors.",
                LMSWarning,
                stacklevel=2,
            )
            return False
        if model.jit_compile and (self.xla == "error" or not _auto_would_choose_xla(model)):
            if tfi.tf_keras_model(model):
                why = "a tf-keras model is compiled with XLA only when asked (jit_compile=True)"
                fix = "Compile the model without jit_compile (tf-keras's default)"
            else:
                why = (
                    "LMSCallback(xla='error') was given"
                    if self.xla == "error"
                    else "jit_compile=True was asked for explicitly (Keras's default 'auto' would not choose XLA here)"
                )
                fix = (
                    "Compile the model with jit_compile=False, or leave Keras's default jit_compile='auto' and "
                    "LMSCallback(xla='disable') to train the rewritten step without XLA"
                )
            raise ValueError(
                "tflms.LMSCallback cannot swap tensors in an XLA-compiled train step: XLA compiles the "
                f"whole step and drops the swap ops, and {why}. {fix}. "
                f"Received: model.jit_compile={model.jit_compile!r}, xla={self.xla!r}"
            )
        replicas = model.distribute_strategy.num_replicas_in_sync
        if replicas > 1:
            return self._mode.several_replicas(replicas)
        return True

    def _build_optimizer(self, model: keras.Model) -> None:
        """``offload="optimizer"``: build the model's optimizer with its slots on the host, before
        Keras first traces the step (it would build it there, beside the weights);
        ``offload="weights"``: move the trainable variables to the host first."""
        from .function import check_host
        from .offload import build_optimizer, place_weights

        check_host(self.config)
        if self.config.offload == "weights":
            place_weights(model, self.config.host)
        build_optimizer(model.optimizer, model.trainable_variables, self.config.host)

    def _build(self, model: keras.Model, keras_function: Callable[[Any], Any], lms: bool = True) -> _Installation:
        step = self.make_train_step(model)
        if tfi.tf_keras_model(model):  # tf-keras counts the step inside its traced run_step
            step = tfi.tf_keras_counted_step(model, step)
            steps_per_execution, run_step = tfi.tf_keras_steps_per_execution, tfi.tf_keras_run_step
        else:
            steps_per_execution, run_step = tfi.keras_steps_per_execution, tfi.keras_run_step
        # Traced as Keras traces its one_step_on_data (and tf-keras the train_step its step_function
        # calls): without AutoGraph (do_not_convert).
        step = tf.autograph.experimental.do_not_convert(self._mode.step_to_trace(step))
        model_ref = weakref.ref(model)
        if not lms:  # Horovod's mode installs its averaging step unrewritten (run eagerly, ...)
            run = tfi.keras_make_function(model, step, jit_compile=bool(model.jit_compile))

            def plain_function(iterator: Any) -> Any:
                self._mode.before_run(model_ref, iterator)
                return run(iterator)

            return _Installation(model_ref, keras_function, None, plain_function, lms=False)
        # Made at the first call, traced as Keras traces the step (the iterator's element spec, so that
        # Grappler sees the plain step's graph) and sized from the first batch's concrete shapes.
        lms_step: LMSFunction | None = None
        if model.jit_compile:  # only where it may be Keras's jit_compile="auto": _supported raised otherwise
            warnings.warn(
                "tflms.LMSCallback: the model is compiled with XLA (model.jit_compile=True; Keras's default "
                "jit_compile='auto' turns XLA on when a GPU is present), which would drop the swap ops, so the "
                "callback builds its training step without XLA; Keras's own evaluate and predict keep XLA. "
                "Compile with jit_compile=False to silence this, or pass LMSCallback(xla='error') to make it "
                "an error.",
                LMSWarning,
                stacklevel=4,
            )
        installation: _Installation

        def train_function(iterator: Any) -> Any:
            """Keras's train function, fed from Python: each batch is taken from ``iterator`` as
            concrete tensors and handed to the rewritten step, planned for the first batch's sizes."""
            nonlocal lms_step
            model = model_ref()
            self._mode.before_run(model_ref, iterator)
            if lms_step is None:
                lms_step = LMSFunction(
                    step, self.config, input_signature=_fit_signature(iterator), **self._call_settings
                )
                installation.step = lms_step
            logs = None
            for _ in range(steps_per_execution(model)):
                try:
                    data = next(iterator)
                except (StopIteration, tf.errors.OutOfRangeError):
                    if logs is None:
                        raise StopIteration from None
                    break
                logs = run_step(model, lms_step, data)
            if len(lms_step.plans) > self._shown:
                self._report(installation)
            return logs

        installation = _Installation(model_ref, keras_function, None, train_function)
        return installation

    def _report(self, inst: _Installation) -> None:
        plans = inst.step.plans
        if self._shown == 0 and plans:
            self.fingerprint = self._mode.first_plan(plans[0])  # collective under Horovod
        root = self._mode.prints()
        measured = self._measured_peak() if self.verbose == 1 and root else None
        for plan in plans[self._shown :]:
            log.info("tflms.LMSCallback: %d tensors swapped in %s", len(plan.swaps), plan.function)
            if self.verbose and root:
                print(plan.summary() if self.verbose >= 2 else short_summary(plan, measured))
        self._shown = len(plans)

    def _memory_device(self) -> str | None:
        """The compute device of the installed rewritten step, if it reports its memory here.

        A GPU, or a CPU device in a process started with ``TF_CPU_ALLOCATOR_USE_BFC=true``
        (:func:`tflms.integrations.function.device_memory`); None without an installed LMS step or a device.
        """
        inst = self._installation
        model = None if inst is None else inst.model()
        if inst is None or not inst.lms or model is None or model.train_function is not inst.function:
            return None
        try:
            device = resolve_device(self.config)
        except ValueError:
            return None
        return device if device is not None and device_memory(device) is not None else None

    def _measured_peak(self) -> int | None:
        """The measured device peak since the epoch began, or None where not measured (the step
        resets the device's statistics before each call on probation and keeps each call's peak)."""
        info = None if self._measured_device is None else device_memory(self._measured_device)
        if info is None:
            return None
        step = self.step
        probation = [] if step is None else step.measured_peaks[self._peaks_seen :]
        return max([int(info["peak"]), *probation])

    def _memory_logs(self) -> dict[str, int]:
        """The epoch-end log entries on device memory (see the class doc); empty where not measured."""
        peak, plans, step = self._measured_peak(), self.plans, self.step
        logs = {REPLANS_KEY: len(step.replans)} if step is not None and step.replans else {}
        if not peak or not plans:
            return logs
        return {**logs, MEASURED_PEAK_KEY: peak, PREDICTED_PEAK_KEY: max(p.peak_bytes_after for p in plans)}


def _fit_signature(iterator: Any) -> list[Any] | None:
    """The input signature Keras's own train function traces the step with: the batches' element
    spec (``[spec]``, the step's one argument); ``None`` where it is not all tensors (an optional
    input): then the step is traced for each batch's concrete shapes."""
    spec = getattr(iterator, "element_spec", None)
    if spec is None or not all(isinstance(s, tf.TensorSpec) for s in tf.nest.flatten(spec)):
        return None
    return [spec]


def _auto_would_choose_xla(model: keras.Model) -> bool:
    """Whether Keras's ``jit_compile="auto"`` turns XLA on for ``model`` here (a GPU, no strategy, ...).

    Then ``model.jit_compile == True`` may be Keras's default rather than the user's request.
    Keras's own resolution (pinned in tests/integrations/test_keras.py); when it cannot be asked, True.
    """
    if tfi.tf_keras_model(model):
        return False  # tf-keras has no "auto": jit_compile=True is the user's
    auto = tfi.keras_auto_jit_compile(model)
    return True if auto is None else auto


def _overrides(callback: LMSCallback, hooks: tuple[str, ...]) -> bool:
    """Whether ``callback``'s class overrides any of the Keras callback methods ``hooks`` (beyond
    :class:`LMSCallback`'s own)."""
    return any(getattr(type(callback), hook) is not getattr(LMSCallback, hook) for hook in hooks)


def __getattr__(name: str) -> Any:
    # Horovod's train step: still reachable here, without importing Horovod's integration before.
    if name == "averaging_train_step":
        from .horovod.fit import averaging_train_step

        return averaging_train_step
    raise AttributeError(f"module 'tflms.integrations.keras' has no attribute {name!r}")
