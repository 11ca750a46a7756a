"""Data-parallel ``model.fit`` under ``horovodrun``: the mode :class:`tflms.LMSCallback` holds
with ``horovod=True`` (:class:`HorovodFit`), and :func:`averaging_train_step`.

The rewritten step is :func:`averaging_train_step`, Keras's ``train_step`` with the
gradients averaged by :func:`tflms.integrations.horovod.allreduce_gradients` before
``optimizer.apply_gradients``: the allreduce is part of the one rewritten graph
(tflms never swaps Horovod ops nor uses them as swap-in triggers). Everything else
of :class:`tflms.LMSCallback` (installing the step, XLA, memory logs) is the callback's own;
pinned by ``tests/integrations/test_horovod_keras.py``.

The mode calls the collectives through the package (``tflms.integrations.horovod.<name>``),
as user code would, so that a test can count them by replacing those names.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from ... import _tf_internal as tfi
from ...errors import LMSWarning
from .. import horovod as lms_hvd
from .gradients import check_sparse_as_dense

__all__ = ["HorovodFit", "averaging_train_step"]

#: Horovod op types that reduce across ranks: a step without one of them does not average its gradients.
_ALLREDUCE_TYPES = frozenset({"HorovodAllreduce", "HorovodGroupedAllreduce"})

#: Models whose initial variables a Horovod callback broadcast in this process, mapped to (a weak
#: reference to) the optimizer whose variables went with them. Shared by all the callbacks of the
#: process: a later ``fit`` of the same model with a *new* callback must not broadcast the model
#: again (its variables are already the same on every rank). Weak keys: an entry goes away with
#: its model.
_BROADCAST_MODELS: weakref.WeakKeyDictionary[keras.Model, Callable[[], Any]] = weakref.WeakKeyDictionary()


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
    ``tflms.integrations.keras``.

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


class HorovodFit:
    """What :class:`tflms.LMSCallback` does differently under ``horovodrun`` (its ``horovod=True``
    mode; :class:`tflms.horovod.HorovodLMSCallback` documents the behaviour): the averaging train
    step, the broadcast of the initial variables, the averaged logs, the plan checked on every
    rank, printing on rank 0.

    Args:
        sparse_as_dense: whether :func:`averaging_train_step` densifies ``tf.IndexedSlices``
            gradients before the allreduce (``True``) or allgathers them (``False``).
    """

    horovod = True
    #: The log averaging at batch end is a collective that every rank must issue in the same
    #: order, so Keras must not call it from a thread pool.
    async_safe = False
    #: Without LMS (``run_eagerly=True``) the step is still installed: the gradients are averaged.
    installs_without_lms = True
    eager_note = " (gradients are still averaged across Horovod ranks)"

    def __init__(self, sparse_as_dense: bool = True) -> None:
        check_sparse_as_dense(sparse_as_dense)
        self.sparse_as_dense = sparse_as_dense
        #: Initial variables still to broadcast (an unbuilt model: at its first step); set at train begin.
        self.broadcast_pending = False

    def make_train_step(self, model: keras.Model, train_step: Any) -> Callable[[Any], Any]:
        """The per-batch step to rewrite: ``train_step`` given to the callback, else
        :func:`averaging_train_step` (with this mode's ``sparse_as_dense``); a model that
        overrides ``train_step`` without ``train_step=`` raises ``ValueError`` (its step would
        train every rank on its own gradients)."""
        if train_step is not None:
            return functools.partial(train_step, model)
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

        def averaged(data: Any) -> dict[str, Any]:  # one argument: tf.function traces its signature
            return averaging_train_step(model, data, sparse_as_dense=sparse_as_dense)

        averaged.__name__ = "train_step"  # names the traced graph and the plan, as Keras's step
        return averaged

    def several_replicas(self, replicas: int) -> bool:
        raise ValueError(
            "tflms.LMSCallback(horovod=True) runs one replica per Horovod rank; it cannot also train "
            f"under a distribution strategy. Build and compile the model outside the strategy's scope. "
            f"Received: a distribution strategy with {replicas} replicas"
        )

    def step_to_trace(self, step: Callable[[Any], Any]) -> Callable[[Any], Any]:
        return _checking_allreduce(step)

    def set_params(self, params: dict) -> None:
        # Keras hands every callback the same params dict, this one before the ProgbarLogger
        # it appends itself: verbose=0 here silences the progress bar of a non-root rank.
        if isinstance(params, dict) and params.get("verbose", 0) != 0 and not lms_hvd.is_root():
            params["verbose"] = 0

    def train_begin(self, model: keras.Model) -> None:
        # A built model is broadcast now; an unbuilt one at the first step, from the data's spec.
        self.broadcast_pending = not self._broadcast_initial_state(model)

    def before_run(self, model_ref: weakref.ReferenceType, iterator: Any) -> None:
        if self.broadcast_pending:
            self.broadcast_pending = False
            self._broadcast_initial_state(model_ref(), iterator)

    def first_plan(self, plan: Any) -> str:
        # Collective: every rank traced its first step in the same train_function call.
        return lms_hvd.assert_same_plan(plan)

    def prints(self) -> bool:
        return lms_hvd.is_root()

    def batch_end(self, logs: dict) -> None:
        # In place, so the callbacks after this one (Keras's progress bar among them) see the means.
        # Eagerly: an allreduce of the logs inside the step would have no consumer in the step, and
        # Horovod ops are stateless, so in the steps_per_execution while loop one step's could still
        # run when the next step submits its own under the same name (Horovod refuses that).
        logs.update(lms_hvd.average_logs(logs, name="tflms_average_batch_logs"))

    def epoch_end(self, logs: dict) -> None:
        # Keras recomputes the epoch logs from this rank's metrics: average them (in place, so the
        # History and progress bar that Keras appends after this callback see the averages). The
        # callback adds this rank's device memory afterwards: a rank whose device cannot report it
        # must not change the set of keys that the ranks allreduce.
        logs.update(lms_hvd.average_logs(logs))

    def _broadcast_initial_state(self, model: keras.Model, iterator: Any = None) -> bool:
        """Broadcast rank 0's model and optimizer variables, once per model (and optimizer).

        Builds the optimizer first, and a model with unbuilt layers from the spec of
        ``iterator``'s batches. Returns False (nothing done) for an unbuilt model
        without ``iterator``. Every rank takes the same branches (collective).
        """
        optimizer = model.optimizer
        done = _BROADCAST_MODELS.get(model)
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
        _BROADCAST_MODELS[model] = weakref.ref(optimizer) if optimizer is not None else _none
        return True


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
