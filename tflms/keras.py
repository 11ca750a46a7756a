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

With ``horovod=True`` (data parallelism under ``horovodrun``; pinned by
``tests/test_horovod_keras.py``) the rewritten step is :func:`averaging_train_step`,
Keras's ``train_step`` with the gradients averaged by
:func:`tflms.horovod.allreduce_gradients` before ``optimizer.apply_gradients``: the
allreduce is part of the one rewritten graph (tflms never swaps Horovod ops nor uses
them as swap-in triggers). The callback also broadcasts rank 0's initial model and
optimizer variables, averages the logs over the ranks and keeps the progress bar to
rank 0 (see :class:`LMSCallback`).

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

from . import horovod as lms_hvd
from .config import LMSConfig
from .core import LMSFunction, device_memory, resolve_device
from .core import function as lms_function
from .errors import LMSWarning
from .plan import SwapPlan, format_bytes

__all__ = ["LMSCallback", "averaging_train_step", "XLA_MODES"]

log = logging.getLogger("tflms")

#: A replacement for ``model.train_step``: called as ``train_step(model, data)``, returns the logs.
TrainStep = Callable[[keras.Model, Any], Any]

#: Horovod op types that reduce across ranks: a ``horovod=True`` step without one of them
#: does not average its gradients.
_ALLREDUCE_TYPES = frozenset({"HorovodAllreduce", "HorovodGroupedAllreduce"})

#: Values of ``LMSCallback(xla=...)``: what to do with a model whose ``jit_compile`` is on.
XLA_MODES = ("disable", "error")

#: Keys of the epoch logs the callback adds where the device reports its memory.
MEASURED_PEAK_KEY = "measured_peak_bytes"
PREDICTED_PEAK_KEY = "predicted_peak_bytes"

#: Models whose initial variables ``LMSCallback(horovod=True)`` broadcast in this process,
#: mapped to (a weak reference to) the optimizer whose variables went with them.
_BROADCAST: weakref.WeakKeyDictionary[keras.Model, Callable[[], Any]] = weakref.WeakKeyDictionary()


@dataclasses.dataclass
class _Installation:
    """What the callback built for one model's Keras train function."""

    model: weakref.ReferenceType
    keras_function: Callable[[Any], Any]  # what Keras built (restored at train end)
    step: LMSFunction | None  # the rewritten per-batch step (None: runs eagerly, no LMS)
    function: Callable[[Any], Any]  # what is installed as model.train_function while fitting


def averaging_train_step(model: keras.Model, data: Any) -> dict[str, Any]:
    """Keras 3's ``Model.train_step`` (TensorFlow backend) with Horovod gradient averaging.

    The same computation as ``keras.Model.train_step``: forward pass, ``compute_loss``
    with ``sample_weight`` (regularization losses included), the loss tracker, the
    optimizer's loss scaling (``LossScaleOptimizer``), ``tape.gradient``, then
    ``optimizer.apply_gradients`` and ``compute_metrics``, except that the gradients
    are averaged over all Horovod ranks with
    :func:`tflms.horovod.allreduce_gradients` first. With one rank (or without
    Horovod) it trains exactly like ``keras.Model.train_step`` (pinned by a test).
    ``LMSCallback(horovod=True)`` uses it; it can also be passed as
    ``LMSCallback(train_step=averaging_train_step)``.

    Example:
        >>> logs = averaging_train_step(model, (x, y))  # inside a traced step  # doctest: +SKIP
    """
    from keras.src.losses.loss import unscale_loss_for_distribution  # what Keras's train_step calls

    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True) if model._call_has_training_arg else model(x)  # noqa: SLF001
        loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)  # noqa: SLF001
        model._loss_tracker.update_state(  # noqa: SLF001
            unscale_loss_for_distribution(loss),
            sample_weight=tf.shape(next(i for i in keras.tree.flatten(x) if i is not None))[0],
        )
        if model.optimizer is not None:
            loss = model.optimizer.scale_loss(loss)
    if model.trainable_weights:
        trainable_weights = model.trainable_weights
        gradients = tape.gradient(loss, trainable_weights)
        gradients = lms_hvd.allreduce_gradients(gradients)
        model.optimizer.apply_gradients(zip(gradients, trainable_weights))
    else:
        warnings.warn("The model does not have any trainable weights.", stacklevel=2)
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def _overrides_train_step(model: keras.Model) -> bool:
    return "train_step" in vars(model) or type(model).train_step is not keras.Model.train_step


class LMSCallback(keras.callbacks.Callback):
    """Train with large model support in Keras 3 ``model.fit``.

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
            instead. On rank 0 only with ``horovod``.
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
            :meth:`make_train_step` instead. With ``horovod=True`` it must average
            the gradients itself (see below).
        horovod: data-parallel training under ``horovodrun`` (see below). Without
            Horovod initialised, in a process not started by ``horovodrun``, it
            trains exactly like one rank.
        **options: :class:`tflms.LMSConfig` fields, e.g. ``device='/device:GPU:0'``,
            ``swapout_threshold=40``, ``batch_size=64``. Pass ``batch_size`` when the
            batches have no static size (a partial last batch, a dataset batched
            without ``drop_remainder``): the planner then needs it to size tensors,
            and the callback warns when it is missing.

    Epoch logs (Keras ``logs``, hence ``History`` and the progress bar): where the
    compute device reports its memory (``tf.config.experimental.get_memory_info``:
    a GPU; a CPU device only in a process started with
    ``TF_CPU_ALLOCATOR_USE_BFC=true``) the callback adds, at each epoch end,

    * ``measured_peak_bytes``: the *measured* peak of the device's allocator during
      the epoch (training and validation; the statistics are reset at each epoch
      begin with ``tf.config.experimental.reset_memory_stats``);
    * ``predicted_peak_bytes``: the simulator's predicted peak of the rewritten
      step, ``plan.peak_bytes_after`` (the largest over the traced signatures).

    Elsewhere (or when the rewrite is skipped for lack of a device) neither is added.
    With ``horovod=True`` they are this rank's own (not averaged like the other logs).

    Attributes:
        plan: the :class:`tflms.SwapPlan` of the step (``None`` until the first
            training step has traced it).
        plans: plans of every input signature traced so far (usually one).
        fingerprint: with ``horovod=True``, the plan fingerprint that every rank
            was checked to share (``None`` before the first step).

    Raises:
        TypeError: unknown option (the message lists the valid ones), a
            ``train_step`` that is not callable, or a ``horovod`` that is not a bool.
        ValueError: an invalid option value; at train begin, a model compiled with
            ``jit_compile=True`` where that cannot be Keras's ``"auto"``, or with
            ``xla="error"`` (XLA would drop the swap ops); with ``horovod=True``,
            a model that overrides ``train_step`` (unless ``train_step=`` is given)
            or a distribution strategy with several replicas.
        tflms.horovod.PlanMismatchError: with ``horovod=True``, when the ranks made
            different plans (raised on every rank after the first step).

    The model runs plain, with a :class:`tflms.LMSWarning`, when it was compiled with
    ``run_eagerly=True`` (with ``horovod=True`` the gradients are still averaged) or
    trains under a distribution strategy with several replicas.

    **Horovod** (``horovod=True``). Start every rank with ``horovodrun``, call
    :func:`tflms.horovod.init` first, then ``fit`` as usual. The callback

    * averages the gradients over the ranks inside the rewritten step
      (:func:`averaging_train_step`, i.e. Keras's ``train_step`` plus
      :func:`tflms.horovod.allreduce_gradients`; loss scaling, ``sample_weight``,
      ``class_weight``, metrics as in Keras);
    * broadcasts rank 0's model and optimizer variables (building the optimizer,
      and a subclassed model that was never called, first) at the first ``fit`` of
      each model, so ranks may build their models from different seeds; a later
      ``fit`` broadcasts nothing (only the variables of a new optimizer after a
      re-``compile``). To re-synchronise weights you changed on one rank, call
      ``tflms.horovod.broadcast_variables(model.variables + model.optimizer.variables)``;
    * averages the logs over the ranks, in place, at every batch end (one eager
      allreduce of a few numbers per ``train_function`` call) and at every epoch
      end (validation included), so ``History`` is the same on every rank. Place
      it *before* callbacks that read the logs (``EarlyStopping``,
      ``ReduceLROnPlateau``, ``ModelCheckpoint``) so that every rank takes the
      same decision; Keras's own ``History`` and progress bar come after it;
    * silences the progress bar on every rank but 0 (it sets ``verbose`` to 0 in
      the parameters Keras hands the callbacks, before Keras's ``ProgbarLogger``
      reads them);
    * checks, after the first step, that every rank made the same plan
      (:func:`tflms.horovod.assert_same_plan`), and warns when the traced step
      holds no Horovod allreduce.

    What stays yours: shard the data so that every rank runs the *same number of
    steps* (a rank with an extra batch waits forever in the allreduce); scale the
    learning rate (e.g. by ``tflms.horovod.size()``) if you want; save and print on
    rank 0 (:func:`tflms.horovod.is_root`). Epoch logs are means of the per-rank
    values: exact for mean metrics (loss, accuracy) with equal per-rank batches,
    approximate for others (e.g. AUC, precision). ``BatchNormalization`` moving
    statistics (and other non-trainable state updated in the forward pass) stay
    per rank: each rank normalises with its own batch's statistics and keeps its
    own moving averages, so evaluate/save on rank 0 (or broadcast them).
    ``model.evaluate`` outside ``fit`` returns this rank's numbers: average them
    with ``tflms.horovod.average_logs(model.evaluate(..., return_dict=True))``. A model
    that overrides ``train_step`` must average its gradients itself, with
    ``grads = tflms.horovod.allreduce_gradients(grads)`` before
    ``apply_gradients``, and say so with ``train_step=MyModel.train_step``
    (called as ``train_step(model, data)``); the callback then does all the rest.

    Example (``train.py``, run with ``horovodrun -np 2 -H localhost:2 python train.py``)::

        import keras
        import numpy as np
        import tensorflow as tf

        import tflms
        import tflms.horovod as lms_hvd

        lms_hvd.init()  # first, before TensorFlow initialises the GPUs
        gpus = tf.config.list_physical_devices("GPU")
        if gpus:  # one GPU per rank
            tf.config.set_visible_devices(gpus[lms_hvd.local_rank()], "GPU")

        # The same global data on every rank (replace with yours), then one shard per
        # rank with the same number of whole batches on every rank.
        rng = np.random.default_rng(0)
        x = rng.normal(size=(4096, 64, 64, 3)).astype("float32")
        y = rng.integers(0, 10, size=(4096,))
        batch = 32
        per_rank = len(x) // (lms_hvd.size() * batch) * batch
        lo = lms_hvd.rank() * per_rank
        x, y = x[lo : lo + per_rank], y[lo : lo + per_rank]

        model = keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10)
        model.compile(
            optimizer=keras.optimizers.SGD(0.01 * lms_hvd.size(), momentum=0.9),  # LR scaling: yours
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
            jit_compile=False,  # XLA would drop the swap ops
        )
        lms = tflms.LMSCallback(horovod=True, swapout_threshold=40, verbose=True)
        history = model.fit(x, y, batch_size=batch, epochs=3, callbacks=[lms])  # LMSCallback first
        # history.history is the same on every rank; only rank 0 printed (and the plan, verbose=True).
        if lms_hvd.is_root():
            print(f"{len(lms.plan.swaps)} tensors swapped per step; history: {history.history}")
            model.save("model.keras")

    Example (one process):
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
        horovod: bool = False,
        xla: str = "disable",
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
        if not isinstance(horovod, bool):
            raise TypeError(f"horovod must be True or False. Received: horovod={horovod!r}")
        if xla not in XLA_MODES:
            raise ValueError(f"xla must be one of {', '.join(map(repr, XLA_MODES))}. Received: xla={xla!r}")
        self.verbose = verbose
        self.horovod = horovod
        self.xla = xla
        self.fingerprint: str | None = None
        self._train_step = train_step
        self._installation: _Installation | None = None
        self._shown = 0  # plans already reported
        self._checked_batch = False  # batch dimension of the fed data looked at
        self._broadcast_pending = False  # horovod: initial variables still to broadcast
        self._measured_device: str | None = None  # device whose peak this epoch's logs report

    # -- extension point -------------------------------------------------------------

    def make_train_step(self, model: keras.Model) -> Callable[[Any], Any]:
        """The per-batch step to rewrite: ``step(data) -> logs``.

        Default: ``model.train_step`` (so a model that overrides ``train_step`` keeps
        its own), or the ``train_step`` given to the constructor; with
        ``horovod=True`` and no ``train_step`` given, :func:`averaging_train_step`
        (and a model that overrides ``train_step`` raises ``ValueError``). Override
        this to wrap or replace the step; whatever it returns is traced into the one
        graph that tflms rewrites.
        """
        if self._train_step is not None:
            return functools.partial(self._train_step, model)
        if self.horovod:
            if _overrides_train_step(model):
                name = type(model).__name__
                raise ValueError(
                    f"tflms.LMSCallback(horovod=True) averages the gradients in its own copy of Keras's "
                    f"train_step, but the model ({name}) overrides train_step, which would train every rank "
                    "on its own gradients. Average them in your train_step, e.g. "
                    "`grads = tflms.horovod.allreduce_gradients(grads)` before `apply_gradients`, and pass "
                    f"`LMSCallback(horovod=True, train_step={name}.train_step)`; the callback then still "
                    "broadcasts the initial variables, averages the logs and checks the plan. "
                    f"Received: a model of class {name} with its own train_step"
                )
            return functools.partial(averaging_train_step, model)
        return model.train_step

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
    def async_safe(self) -> bool:
        """Keras may call batch-end hooks from a thread pool only without ``horovod``: the log
        averaging at batch end is a collective that every rank must issue in the same order."""
        return not self.horovod

    # -- Keras hooks ------------------------------------------------------------------

    def set_params(self, params: dict) -> None:
        # Keras hands every callback the same params dict, this one before the ProgbarLogger
        # it appends itself: verbose=0 here silences the progress bar of a non-root rank.
        if self.horovod and isinstance(params, dict) and params.get("verbose", 0) != 0 and not lms_hvd.is_root():
            params["verbose"] = 0
        super().set_params(params)

    def on_train_begin(self, logs: dict | None = None) -> None:
        model = self.model
        lms = self._supported(model)
        if not lms and not self.horovod:
            return
        inst = self._installation
        current = model.train_function
        if inst is not None and inst.model() is model and current is inst.function:
            pass  # still installed (a previous fit ended without on_train_end)
        else:
            if inst is None or inst.model() is not model or current is not inst.keras_function:
                if current is None:  # fit always builds it first; train_on_batch-style callers may not
                    model.make_train_function()
                    current = model.train_function
                inst = self._build(model, current, lms)
                self._installation = inst
                self._shown = 0
                self._checked_batch = False
                self.fingerprint = None
            model.train_function = inst.function
        if self.horovod:
            # A built model is broadcast now; an unbuilt one at the first step, from the data's spec.
            self._broadcast_pending = not self._broadcast_initial_state(model)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        # In place, so the callbacks after this one (Keras's progress bar among them) see the means.
        # Eagerly: an allreduce of the logs inside the step would have no consumer in the step, and
        # Horovod ops are stateless, so in the steps_per_execution while loop one step's could still
        # run when the next step submits its own under the same name (Horovod refuses that).
        if self.horovod and logs:
            logs.update(lms_hvd.average_logs(logs, name="tflms_average_batch_logs"))

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._measured_device = self._memory_device()
        if self._measured_device is not None:
            try:
                tf.config.experimental.reset_memory_stats(self._measured_device)
            except (ValueError, tf.errors.OpError):
                self._measured_device = None

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        # Keras recomputes the epoch logs from this rank's metrics: average them (in place, so the
        # History and progress bar that Keras appends after this callback see the averages).
        if self.horovod and logs:
            logs.update(lms_hvd.average_logs(logs))
        # This rank's device memory, after the averaging: a rank whose device cannot report it
        # must not change the set of keys that the ranks allreduce.
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

    # -- internals --------------------------------------------------------------------

    def _supported(self, model: keras.Model) -> bool:
        """Whether the model's step can be rewritten (warns or raises when not)."""
        if model.run_eagerly:
            averaged = " (gradients are still averaged across Horovod ranks)" if self.horovod else ""
            warnings.warn(
                f"tflms.LMSCallback: the model was compiled with run_eagerly=True, so fit runs eagerly "
                f"without LMS{averaged}. Compile with run_eagerly=False to swap tensors.",
                LMSWarning,
                stacklevel=2,
            )
            return False
        if model.jit_compile and (self.xla == "error" or not _auto_would_choose_xla(model)):
            why = (
                "LMSCallback(xla='error') was given"
                if self.xla == "error"
                else "jit_compile=True was asked for explicitly (Keras's default 'auto' would not choose XLA here)"
            )
            raise ValueError(
                "tflms.LMSCallback cannot swap tensors in an XLA-compiled train step: XLA compiles the "
                f"whole step and drops the swap ops, and {why}. Compile the model with jit_compile=False, or "
                "leave Keras's default jit_compile='auto' and LMSCallback(xla='disable') to train the rewritten "
                f"step without XLA. Received: model.jit_compile={model.jit_compile!r}, xla={self.xla!r}"
            )
        replicas = model.distribute_strategy.num_replicas_in_sync
        if replicas > 1:
            if self.horovod:
                raise ValueError(
                    "tflms.LMSCallback(horovod=True) runs one replica per Horovod rank; it cannot also train "
                    f"under a distribution strategy. Build and compile the model outside the strategy's scope. "
                    f"Received: a distribution strategy with {replicas} replicas"
                )
            warnings.warn(
                f"tflms.LMSCallback does not support a distribution strategy with {replicas} replicas; "
                "fit runs without LMS. Use one replica per process (e.g. Horovod).",
                LMSWarning,
                stacklevel=2,
            )
            return False
        return True

    def _build(self, model: keras.Model, keras_function: Callable[[Any], Any], lms: bool = True) -> _Installation:
        # Traced as Keras traces its one_step_on_data: without AutoGraph (do_not_convert) and
        # with reduce_retracing=True.
        step = self.make_train_step(model)
        if self.horovod:
            step = _checking_allreduce(step)
        step = tf.autograph.experimental.do_not_convert(step)
        lms_step = lms_function(step, config=self.config, reduce_retracing=True) if lms else None
        xla = bool(model.jit_compile)
        if lms and xla:  # only where it may be Keras's jit_compile="auto": _supported raised otherwise
            warnings.warn(
                "tflms.LMSCallback: the model is compiled with XLA (model.jit_compile=True; Keras's default "
                "jit_compile='auto' turns XLA on when a GPU is present), which would drop the swap ops, so the "
                "callback builds its training step without XLA; Keras's own evaluate and predict keep XLA. "
                "Compile with jit_compile=False to silence this, or pass LMSCallback(xla='error') to make it "
                "an error.",
                LMSWarning,
                stacklevel=3,
            )
        # _make_function reads model.jit_compile once, when it wraps the step in its tf.function.
        saved = model._jit_compile  # noqa: SLF001 - pinned in tests/test_keras.py
        model._jit_compile = saved and not (lms and xla)  # noqa: SLF001
        try:
            run = model._make_function(lms_step if lms else step)  # noqa: SLF001 - pinned in tests/test_keras.py
        finally:
            model._jit_compile = saved  # noqa: SLF001
        model_ref = weakref.ref(model)
        installation: _Installation

        def train_function(iterator: Any) -> Any:
            if not self._checked_batch:
                self._checked_batch = True
                if lms:
                    self._check_batch_dimension(iterator)
            if self._broadcast_pending:
                self._broadcast_pending = False
                self._broadcast_initial_state(model_ref(), iterator)
            logs = run(iterator)
            if lms and len(lms_step.plans) > self._shown:
                self._report(installation)
            return logs

        installation = _Installation(model_ref, keras_function, lms_step, train_function)
        return installation

    def _broadcast_initial_state(self, model: keras.Model, iterator: Any = None) -> bool:
        """Broadcast rank 0's model and optimizer variables, once per model (and optimizer).

        Builds the optimizer first, and a model with unbuilt layers from the spec of
        ``iterator``'s batches. Returns False (nothing done) for an unbuilt model
        without ``iterator``. Every rank takes the same branches (collective).
        """
        optimizer = model.optimizer
        done = _BROADCAST.get(model)
        if done is not None and done() is optimizer:
            return True
        if not all(layer.built for layer in model._flatten_layers()):  # noqa: SLF001 - Keras's own check
            if iterator is None:
                return False
            model._symbolic_build(data_batch=_symbolic_batch(iterator))  # noqa: SLF001 - builds the optimizer too
        if optimizer is not None and not optimizer.built:
            optimizer.build(model.trainable_variables)
        variables = [] if done is not None else list(model.variables)
        if optimizer is not None:
            variables += list(optimizer.variables)
        lms_hvd.broadcast_variables(variables, root_rank=0)
        _BROADCAST[model] = weakref.ref(optimizer) if optimizer is not None else _none
        return True

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
        if self.horovod and self._shown == 0 and plans:
            # Collective: every rank traced its first step in the same train_function call.
            self.fingerprint = lms_hvd.assert_same_plan(plans[0])
        root = not self.horovod or lms_hvd.is_root()
        measured = self._measured_peak() if self.verbose == 1 and root else None
        for plan in plans[self._shown :]:
            log.info("tflms.LMSCallback: %d tensors swapped in %s", len(plan.swaps), plan.function)
            if self.verbose and root:
                print(plan.summary() if self.verbose >= 2 else short_summary(plan, measured))
        self._shown = len(plans)

    def _memory_device(self) -> str | None:
        """The compute device of the installed rewritten step, if it reports its memory here.

        A GPU, or a CPU device in a process started with ``TF_CPU_ALLOCATOR_USE_BFC=true``
        (:func:`tflms.core.device_memory`); None without an installed LMS step or a device.
        """
        inst = self._installation
        model = None if inst is None else inst.model()
        if inst is None or inst.step is None or model is None or model.train_function is not inst.function:
            return None
        try:
            device = resolve_device(self.config)
        except ValueError:
            return None
        return device if device is not None and device_memory(device) is not None else None

    def _measured_peak(self) -> int | None:
        """The measured device peak since the epoch began, or None where not measured."""
        info = None if self._measured_device is None else device_memory(self._measured_device)
        return None if info is None else int(info["peak"])

    def _memory_logs(self) -> dict[str, int]:
        """The epoch-end log entries on device memory (see the class doc); empty where not measured."""
        peak, plans = self._measured_peak(), self.plans
        if not peak or not plans:
            return {}
        return {MEASURED_PEAK_KEY: peak, PREDICTED_PEAK_KEY: max(p.peak_bytes_after for p in plans)}


def short_summary(plan: SwapPlan, measured_peak: int | None = None) -> str:
    """Two lines on ``plan`` (what ``LMSCallback(verbose=1)`` prints): swaps, bytes moved, peaks.

    ``measured_peak`` (bytes, the device's measured peak of the first step) is shown
    next to the predicted one when given.

    Example:
        >>> print(short_summary(cb.plan))  # doctest: +SKIP
        tflms plan for train_step: 11 tensors swapped, 13.8 MiB out and 20.2 MiB back in per step (15 swap-ins)
        predicted device peak (simulator): 17.7 MiB -> 13.2 MiB (26% less); full table: LMSCallback(verbose=2)
    """
    before, after = plan.peak_bytes_before, plan.peak_bytes_after
    back = sum(s.bytes * len(s.swap_ins) for s in plan.swaps)
    less = (1 - after / before) * 100 if before else 0.0
    lines = [
        f"tflms plan for {plan.function or '<function>'}: {len(plan.swaps)} tensors swapped, "
        f"{format_bytes(plan.swapped_bytes)} out and {format_bytes(back)} back in per step "
        f"({plan.n_swap_ins} swap-ins)",
        f"predicted device peak (simulator): {format_bytes(before)} -> {format_bytes(after)} "
        f"({abs(less):.0f}% {'less' if less >= 0 else 'more'})"
        + (f"; measured peak of the first step: {format_bytes(measured_peak)}" if measured_peak else "")
        + "; full table: LMSCallback(verbose=2)",
    ]
    if plan.reason:
        lines.append(f"note: {plan.reason}")
    return "\n".join(lines)


def _auto_would_choose_xla(model: keras.Model) -> bool:
    """Whether Keras's ``jit_compile="auto"`` turns XLA on for ``model`` here (a GPU, no strategy, ...).

    Then ``model.jit_compile == True`` may be Keras's default rather than the user's request.
    Keras's own resolution (pinned in tests/test_keras.py); when it cannot be asked, True.
    """
    resolve = getattr(model, "_resolve_auto_jit_compile", None)
    if resolve is None:
        return True
    try:
        return bool(resolve())
    except Exception:  # noqa: BLE001 - a Keras internal: any failure means "cannot tell"
        return True


def _none() -> None:
    return None


def _symbolic_batch(iterator: Any) -> Any:
    """Keras tensors shaped like the batches ``iterator`` yields (for ``model._symbolic_build``)."""
    spec = getattr(iterator, "element_spec", None)
    if spec is None:
        raise ValueError(
            "tflms.LMSCallback(horovod=True) must broadcast the initial variables before the first step, "
            "but the model is not built and fit's batches have no element_spec to build it from. Build the "
            "model before fit, e.g. by calling it on a batch: model(x[:1]). "
            f"Received: iterator={iterator!r}"
        )

    def symbolic(s: Any) -> Any:
        return keras.KerasTensor(s.shape, s.dtype.name) if isinstance(s, tf.TensorSpec) else None

    return tf.nest.map_structure(symbolic, spec)


def _checking_allreduce(step: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``step`` that, traced on several Horovod ranks, warns when it holds no Horovod allreduce.

    A ``horovod=True`` step without an allreduce does not average its gradients.
    """

    @functools.wraps(step)
    def checked(data: Any) -> Any:
        logs = step(data)
        if tf.inside_function() and lms_hvd.size() > 1 and not _has_allreduce(tf.compat.v1.get_default_graph()):
            warnings.warn(
                "tflms.LMSCallback(horovod=True): the training step holds no Horovod allreduce, so every "
                "rank applies its own gradients and the ranks drift apart. Average the gradients in your "
                "train_step with tflms.horovod.allreduce_gradients(grads) before apply_gradients.",
                LMSWarning,
                stacklevel=2,
            )
        return logs

    checked.__name__ = getattr(step, "__name__", "train_step")  # names the traced graph and the plan
    return checked


def _has_allreduce(graph: tf.Graph) -> bool:
    """Whether ``graph``, or a function it calls, holds a Horovod allreduce op."""
    if any(op.type in _ALLREDUCE_TYPES for op in graph.get_operations()):
        return True
    library = graph.as_graph_def().library
    return any(node.op in _ALLREDUCE_TYPES for f in library.function for node in f.node_def)
