"""``model.fit`` under ``horovodrun``: :class:`HorovodLMSCallback` and :func:`averaging_train_step`.

The rewritten step is :func:`averaging_train_step`, Keras's ``train_step`` with the
gradients averaged by :func:`tflms.integrations.horovod.allreduce_gradients` before
``optimizer.apply_gradients``: the allreduce is part of the one rewritten graph
(tflms never swaps Horovod ops nor uses them as swap-in triggers). Everything else
of :class:`tflms.LMSCallback` (installing the step, XLA, memory logs) is inherited;
pinned by ``tests/test_horovod_keras.py``.

The callback calls the collectives through the package (``tflms.integrations.horovod.<name>``),
as user code would, so that a test can count them by replacing those names.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import keras
import tensorflow as tf

from ... import _tf_internal as tfi
from ...config import LMSConfig
from ...errors import LMSWarning
from .. import horovod as lms_hvd
from ..keras import LMSCallback, TrainStep
from .gradients import _check_sparse_as_dense

__all__ = ["HorovodLMSCallback", "averaging_train_step"]

#: Horovod op types that reduce across ranks: a step without one of them does not average its gradients.
_ALLREDUCE_TYPES = frozenset({"HorovodAllreduce", "HorovodGroupedAllreduce"})


def averaging_train_step(model: keras.Model, data: Any, *, sparse_as_dense: bool = True) -> dict[str, Any]:
    """Keras 3's ``Model.train_step`` (TensorFlow backend) with Horovod gradient averaging.

    The same computation as ``keras.Model.train_step``: forward pass, ``compute_loss``
    with ``sample_weight`` (regularization losses included), the loss tracker, the
    optimizer's loss scaling (``LossScaleOptimizer``), ``tape.gradient``, then
    ``optimizer.apply_gradients`` and ``compute_metrics``, except that the gradients
    are averaged over all Horovod ranks with
    :func:`tflms.integrations.horovod.allreduce_gradients` first (``sparse_as_dense`` is its
    option: by default an ``Embedding``'s ``tf.IndexedSlices`` gradient is densified
    and allreduced; ``False`` allgathers its rows). With one rank (or without
    Horovod) it trains exactly like ``keras.Model.train_step`` (pinned by a test).
    :class:`HorovodLMSCallback` uses it; it can also be passed as
    ``tflms.LMSCallback(train_step=averaging_train_step)``. Also importable from
    ``tflms.integrations.keras``, where it used to live.

    Example (inside a traced step; in one process it is Keras's own ``train_step``):
        >>> import keras
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> model.compile("sgd", "mse", jit_compile=False)
        >>> step = tf.function(lambda data: averaging_train_step(model, data))
        >>> sorted(step((tf.ones((4, 3)), tf.zeros((4, 1)))))
        ['loss']
    """
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True) if tfi.keras_call_has_training_arg(model) else model(x)
        loss = tfi.keras_compute_loss(model, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
        tfi.keras_loss_tracker(model).update_state(
            tfi.keras_unscale_loss_for_distribution(loss),
            sample_weight=tf.shape(next(i for i in keras.tree.flatten(x) if i is not None))[0],
        )
        if model.optimizer is not None:
            loss = model.optimizer.scale_loss(loss)
    if model.trainable_weights:
        trainable_weights = model.trainable_weights
        gradients = tape.gradient(loss, trainable_weights)
        gradients = lms_hvd.allreduce_gradients(gradients, sparse_as_dense=sparse_as_dense)
        model.optimizer.apply_gradients(zip(gradients, trainable_weights))
    else:
        warnings.warn("The model does not have any trainable weights.", stacklevel=2)
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


class HorovodLMSCallback(LMSCallback):
    """:class:`tflms.LMSCallback` for data-parallel ``model.fit`` under ``horovodrun``.

    ``tflms.LMSCallback(horovod=True, ...)`` makes one of these (as does
    ``tflms.integrations.horovod.HorovodLMSCallback(...)``); arguments, attributes and epoch logs
    are :class:`tflms.LMSCallback`'s, except that ``train_step`` must average the
    gradients itself (see below), ``verbose`` prints on rank 0 only, the memory
    entries of the epoch logs are this rank's own (not averaged like the other
    logs) and ``fingerprint`` is the plan fingerprint that every rank was checked to
    share (``None`` before the first step). Without Horovod initialised, in a
    process not started by ``horovodrun``, it trains exactly like one rank
    (bit for bit like Keras's own ``fit``, plus LMS).

    Start every rank with ``horovodrun``, call :func:`tflms.integrations.horovod.init` first,
    then ``fit`` as usual. The callback

    * averages the gradients over the ranks inside the rewritten step
      (:func:`averaging_train_step`, i.e. Keras's ``train_step`` plus
      :func:`tflms.integrations.horovod.allreduce_gradients`; loss scaling, ``sample_weight``,
      ``class_weight``, metrics as in Keras). Sparse gradients (``tf.IndexedSlices``,
      e.g. an ``Embedding``'s) are densified and allreduced like the others; pass
      ``sparse_as_dense=False`` to allgather their looked-up rows instead (see
      :func:`tflms.integrations.horovod.allreduce_gradients` for when that moves less);
    * broadcasts rank 0's model and optimizer variables (building the optimizer,
      and a subclassed model that was never called, first) at the first ``fit`` of
      each model in this process, whichever callback object runs it, so ranks may
      build their models from different seeds; a later ``fit`` broadcasts nothing
      (only the variables of a new optimizer after a re-``compile``). To
      re-synchronise weights you changed on one rank, call
      ``tflms.integrations.horovod.broadcast_variables(model.variables + model.optimizer.variables)``;
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
      (:func:`tflms.integrations.horovod.assert_same_plan`), and warns when the traced step
      holds no Horovod allreduce.

    A model compiled with ``run_eagerly=True`` trains without LMS, with a
    :class:`tflms.LMSWarning`, and its gradients are still averaged.

    What stays yours: shard the data so that every rank runs the *same number of
    steps* (a rank with an extra batch waits forever in the allreduce); scale the
    learning rate (e.g. by ``tflms.integrations.horovod.size()``) if you want; save and print on
    rank 0 (:func:`tflms.integrations.horovod.is_root`). Epoch logs are means of the per-rank
    values: exact for mean metrics (loss, accuracy) with equal per-rank batches,
    approximate for others (e.g. AUC, precision). ``BatchNormalization`` moving
    statistics (and other non-trainable state updated in the forward pass) stay
    per rank: each rank normalises with its own batch's statistics and keeps its
    own moving averages, so evaluate/save on rank 0 (or broadcast them).
    ``model.evaluate`` outside ``fit`` returns this rank's numbers: average them
    with ``tflms.integrations.horovod.average_logs(model.evaluate(..., return_dict=True))``. A model
    that overrides ``train_step`` must average its gradients itself, with
    ``grads = tflms.integrations.horovod.allreduce_gradients(grads)`` before
    ``apply_gradients``, and say so with ``train_step=MyModel.train_step``
    (called as ``train_step(model, data)``); the callback then does all the rest.

    Args:
        sparse_as_dense: ``True`` (default): densify ``tf.IndexedSlices`` gradients
            before the allreduce; ``False``: allgather their values and indices. Used
            by :func:`averaging_train_step` only: with a ``train_step=`` of yours, pass
            it to your :func:`tflms.horovod.allreduce_gradients` call instead
            (``sparse_as_dense=False`` with ``train_step=`` raises ``ValueError``).
        config, verbose, train_step, horovod, xla, options: as :class:`tflms.LMSCallback`.

    Raises:
        TypeError, ValueError: as :class:`tflms.LMSCallback`; ``TypeError`` also for a
            ``sparse_as_dense`` that is not a bool; ``ValueError`` also for
            ``horovod=False``, ``sparse_as_dense=False`` with ``train_step=``, and at
            train begin for a model that overrides ``train_step`` (unless
            ``train_step=`` is given) or a distribution strategy with several replicas.
        RuntimeError: in a process started by ``horovodrun`` before
            :func:`tflms.integrations.horovod.init`.
        tflms.integrations.horovod.PlanMismatchError: when the ranks made different plans
            (raised on every rank after the first step).

    Example (``train.py``, run with ``horovodrun -np 2 -H localhost:2 python train.py``)::

        import keras
        import numpy as np
        import tensorflow as tf

        import tflms.integrations.horovod as lms_hvd

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
        lms = lms_hvd.HorovodLMSCallback(swapout_threshold=40, verbose=True)  # = tflms.LMSCallback(horovod=True, ...)
        history = model.fit(x, y, batch_size=batch, epochs=3, callbacks=[lms])  # the LMS callback first
        # history.history is the same on every rank; only rank 0 printed (and the plan, verbose=True).
        if lms_hvd.is_root():
            print(f"{len(lms.plan.swaps)} tensors swapped per step; history: {history.history}")
            model.save("model.keras")
    """

    horovod = True

    #: Models whose initial variables a Horovod callback broadcast in this process, mapped to
    #: (a weak reference to) the optimizer whose variables went with them. Shared by all the
    #: callback objects of the process, not kept per object: a later ``fit`` of the same model
    #: with a *new* callback must not broadcast the model again (its variables are already the
    #: same on every rank). Weak keys: an entry goes away with its model.
    _broadcast_models: ClassVar[weakref.WeakKeyDictionary[keras.Model, Callable[[], Any]]] = weakref.WeakKeyDictionary()

    _eager_note = " (gradients are still averaged across Horovod ranks)"

    #: Initial variables still to broadcast (an unbuilt model: at its first step); set at train begin.
    _broadcast_pending = False

    def __init__(
        self,
        config: LMSConfig | None = None,
        *,
        sparse_as_dense: bool = True,
        verbose: bool | int = 0,
        train_step: TrainStep | None = None,
        horovod: bool | None = None,
        xla: str = "disable",
        **options: Any,
    ) -> None:
        _check_sparse_as_dense(sparse_as_dense)
        if train_step is not None and not sparse_as_dense:
            raise ValueError(
                "sparse_as_dense=False applies to the callback's own train step, and a train_step= of yours "
                "averages its gradients itself: pass it there, e.g. "
                "`tflms.horovod.allreduce_gradients(grads, sparse_as_dense=False)`. "
                f"Received: sparse_as_dense=False with train_step={train_step!r}"
            )
        super().__init__(config, verbose=verbose, train_step=train_step, horovod=horovod, xla=xla, **options)
        #: Whether :func:`averaging_train_step` densifies sparse gradients before the allreduce.
        self.sparse_as_dense = sparse_as_dense

    def make_train_step(self, model: keras.Model) -> Callable[[Any], Any]:
        """The per-batch step to rewrite: ``step(data) -> logs``.

        The ``train_step`` given to the constructor, else :func:`averaging_train_step`
        (with this callback's ``sparse_as_dense``);
        a model that overrides ``train_step`` without ``train_step=`` raises
        ``ValueError`` (its step would train every rank on its own gradients).
        Override this to wrap or replace the step; whatever it returns is traced into
        the one graph that tflms rewrites, and must average the gradients.
        """
        if self._train_step is not None:
            return functools.partial(self._train_step, model)
        if _overrides_train_step(model):
            name = type(model).__name__
            raise ValueError(
                f"tflms.LMSCallback(horovod=True) averages the gradients in its own copy of Keras's "
                f"train_step, but the model ({name}) overrides train_step, which would train every rank "
                "on its own gradients. Average them in your train_step, e.g. "
                "`grads = tflms.integrations.horovod.allreduce_gradients(grads)` before `apply_gradients`, and pass "
                f"`LMSCallback(horovod=True, train_step={name}.train_step)`; the callback then still "
                "broadcasts the initial variables, averages the logs and checks the plan. "
                f"Received: a model of class {name} with its own train_step"
            )
        sparse_as_dense = self.sparse_as_dense

        def train_step(data: Any) -> dict[str, Any]:  # one argument: tf.function traces its signature
            return averaging_train_step(model, data, sparse_as_dense=sparse_as_dense)

        return train_step

    @property
    def async_safe(self) -> bool:
        """False: the log averaging at batch end is a collective that every rank must issue
        in the same order, so Keras must not call it from a thread pool."""
        return False

    # -- Keras hooks ------------------------------------------------------------------

    def set_params(self, params: dict) -> None:
        # Keras hands every callback the same params dict, this one before the ProgbarLogger
        # it appends itself: verbose=0 here silences the progress bar of a non-root rank.
        if isinstance(params, dict) and params.get("verbose", 0) != 0 and not lms_hvd.is_root():
            params["verbose"] = 0
        super().set_params(params)

    def on_train_begin(self, logs: dict | None = None) -> None:
        model = self.model
        self._install(model, lms=self._supported(model))  # without LMS too: the gradients are averaged
        # A built model is broadcast now; an unbuilt one at the first step, from the data's spec.
        self._broadcast_pending = not self._broadcast_initial_state(model)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        # In place, so the callbacks after this one (Keras's progress bar among them) see the means.
        # Eagerly: an allreduce of the logs inside the step would have no consumer in the step, and
        # Horovod ops are stateless, so in the steps_per_execution while loop one step's could still
        # run when the next step submits its own under the same name (Horovod refuses that).
        if logs:
            logs.update(lms_hvd.average_logs(logs, name="tflms_average_batch_logs"))

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        # Keras recomputes the epoch logs from this rank's metrics: average them (in place, so the
        # History and progress bar that Keras appends after this callback see the averages).
        if logs:
            logs.update(lms_hvd.average_logs(logs))
        # Then this rank's device memory: a rank whose device cannot report it must not change
        # the set of keys that the ranks allreduce.
        super().on_epoch_end(epoch, logs)

    # -- hooks of tflms.LMSCallback ---------------------------------------------------

    def _several_replicas(self, replicas: int) -> bool:
        raise ValueError(
            "tflms.LMSCallback(horovod=True) runs one replica per Horovod rank; it cannot also train "
            f"under a distribution strategy. Build and compile the model outside the strategy's scope. "
            f"Received: a distribution strategy with {replicas} replicas"
        )

    def _step_to_trace(self, model: keras.Model) -> Callable[[Any], Any]:
        return _checking_allreduce(super()._step_to_trace(model))

    def _before_run(self, model_ref: weakref.ReferenceType, iterator: Any) -> None:
        if self._broadcast_pending:
            self._broadcast_pending = False
            self._broadcast_initial_state(model_ref(), iterator)

    def _first_plan(self, plan: Any) -> None:
        # Collective: every rank traced its first step in the same train_function call.
        self.fingerprint = lms_hvd.assert_same_plan(plan)

    def _prints(self) -> bool:
        return lms_hvd.is_root()

    # -- internals --------------------------------------------------------------------

    def _broadcast_initial_state(self, model: keras.Model, iterator: Any = None) -> bool:
        """Broadcast rank 0's model and optimizer variables, once per model (and optimizer).

        Builds the optimizer first, and a model with unbuilt layers from the spec of
        ``iterator``'s batches. Returns False (nothing done) for an unbuilt model
        without ``iterator``. Every rank takes the same branches (collective).
        """
        optimizer = model.optimizer
        done = self._broadcast_models.get(model)
        if done is not None and done() is optimizer:
            return True
        if not tfi.keras_layers_built(model):
            if iterator is None:
                return False
            tfi.keras_symbolic_build(model, _symbolic_batch(iterator))  # builds the optimizer too
        if optimizer is not None and not optimizer.built:
            optimizer.build(model.trainable_variables)
        variables = [] if done is not None else list(model.variables)
        if optimizer is not None:
            variables += list(optimizer.variables)
        lms_hvd.broadcast_variables(variables, root_rank=0)
        self._broadcast_models[model] = weakref.ref(optimizer) if optimizer is not None else _none
        return True


@functools.cache
def horovod_class(cls: type[LMSCallback]) -> type[HorovodLMSCallback]:
    """What ``cls(horovod=True)`` makes: :class:`HorovodLMSCallback`, or for a subclass ``cls`` of
    ``tflms.LMSCallback``, ``Horovod<cls name>(cls, HorovodLMSCallback)`` (``cls``'s overrides first)."""
    if issubclass(cls, HorovodLMSCallback):
        return cls
    if cls is LMSCallback:
        return HorovodLMSCallback
    name = f"Horovod{cls.__name__}"
    return type(name, (cls, HorovodLMSCallback), {"__module__": cls.__module__, "__qualname__": name})


def _overrides_train_step(model: keras.Model) -> bool:
    return "train_step" in vars(model) or type(model).train_step is not keras.Model.train_step


def _none() -> None:
    return None


def _symbolic_batch(iterator: Any) -> Any:
    """Keras tensors shaped like the batches ``iterator`` yields (to build the model)."""
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

    A Horovod step without an allreduce does not average its gradients.
    """

    @functools.wraps(step)
    def checked(data: Any) -> Any:
        logs = step(data)
        if tf.inside_function() and lms_hvd.size() > 1 and not _has_allreduce(tf.compat.v1.get_default_graph()):
            warnings.warn(
                "tflms.LMSCallback(horovod=True): the training step holds no Horovod allreduce, so every "
                "rank applies its own gradients and the ranks drift apart. Average the gradients in your "
                "train_step with tflms.integrations.horovod.allreduce_gradients(grads) before apply_gradients.",
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
