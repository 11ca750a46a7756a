"""``offload="optimizer"`` on TensorFlow objects: the optimizer's state made on the host, and checked.

* :func:`build_optimizer`: build a Keras 3 optimizer with its slot variables on the host. Keras's
  TensorFlow backend makes each slot beside its weight (``TFOptimizer.add_variable_from_reference``
  colocates it through the distribution strategy, whatever the device scope); this calls the
  backend-independent ``BaseOptimizer.add_variable_from_reference`` under ``tf.device(host)``
  instead, for this one build. ``LMSCallback(offload="optimizer")`` calls it at train begin; with
  ``tflms.function`` call it yourself before the first step (``tests/integrations/test_offload.py`` pins where
  the variables land).
* :func:`check_optimizer`: the Keras 3 optimizers whose update was checked with the offload.
* :func:`check_state_on_host`: refuse a traced step whose optimizer state is on the device.
* :func:`place_weights`: for ``offload="weights"``, move a built Keras model's trainable variables
  to the host (each variable's ``tf.Variable`` made again there with its value; the Keras
  variables, which the layers and the optimizer hold, stay the same objects).
  ``LMSCallback(offload="weights")`` calls it at train begin; with ``tflms.function`` call it
  before the first step (or build the model under ``tf.device(host)``), then
  :func:`build_optimizer`.
* :func:`check_weights_on_host`: refuse a traced step whose weights are on the device.

Example (one process split into two logical CPUs: ``/device:CPU:0`` plays the host)::

    >>> import keras, tflms
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> opt = tflms.build_optimizer(keras.optimizers.Adam(), model.trainable_variables, "/device:CPU:0")
    >>> sorted({v.value.device.rpartition("device:")[2] for v in opt.variables})
    ['CPU:0']
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from .. import _tf_internal as tfi
from .._devices import same_device

__all__ = [
    "CHECKED_OPTIMIZERS",
    "build_optimizer",
    "check_optimizer",
    "check_state_on_host",
    "check_weights_on_host",
    "place_weights",
]

#: The Keras 3 optimizers whose offloaded step was checked against the plain one
#: (``tests/integrations/test_offload.py``): bit-identical, but for SGD (with and without momentum),
#: whose plain step Grappler's arithmetic optimizer rounds differently in the last bits.
CHECKED_OPTIMIZERS = (
    "Adam",
    "AdamW",
    "SGD",
    "RMSprop",
    "Adagrad",
    "Adadelta",
    "Adamax",
    "Nadam",
    "Lion",
    "Lamb",
    "Adafactor",
    "Ftrl",
)


def check_optimizer(optimizer: Any) -> None:
    """Raise ``ValueError`` unless ``optimizer`` is a Keras 3 optimizer of :data:`CHECKED_OPTIMIZERS`
    (a subclass of one counts; a ``LossScaleOptimizer`` wrapping one does not)."""
    checked = tuple(getattr(keras.optimizers, name) for name in CHECKED_OPTIMIZERS)
    if not isinstance(optimizer, checked) or getattr(optimizer, "gradient_accumulation_steps", None):
        why = "gradient accumulation is on" if isinstance(optimizer, checked) else "its update was not checked"
        raise ValueError(
            f"offload='optimizer' cannot offload {type(optimizer).__name__}: {why}. The Keras 3 optimizers checked "
            f"are {', '.join(CHECKED_OPTIMIZERS)} (without loss scaling or gradient accumulation); use one of them, "
            f"or offload=None. Received: offload='optimizer' with optimizer={optimizer!r}"
        )


def _state(optimizer: Any) -> list[Any]:
    """The optimizer's variables that are not scalars (its slots; not the iteration or learning rate)."""
    return [v for v in optimizer.variables if len(v.shape) > 0]


def build_optimizer(optimizer: Any, variables: Sequence[Any], host: str) -> Any:
    """Build ``optimizer`` (a Keras 3 optimizer of :data:`CHECKED_OPTIMIZERS`) for ``variables`` with
    its slot variables on ``host``, for ``offload="optimizer"``; return it.

    Call it before the step is first traced, with the variables the step updates
    (``model.trainable_variables``). An optimizer already built is returned as it is when its
    slots are on ``host``, and refused (``ValueError``) when they are elsewhere.
    """
    check_optimizer(optimizer)
    if optimizer.built:
        _check_built(optimizer, host)
        return optimizer
    base = tfi.keras_base_optimizer()

    def on_host(self: Any, reference_variable: Any, name: Any = None, initializer: Any = "zeros") -> Any:
        with tf.device(host):
            return base.add_variable_from_reference(self, reference_variable, name=name, initializer=initializer)

    optimizer.add_variable_from_reference = types.MethodType(on_host, optimizer)
    try:  # the device scope also places what build makes with add_variable (Adafactor's factored slots)
        with tf.init_scope(), tf.device(host):
            optimizer.build(list(variables))
    finally:
        del optimizer.add_variable_from_reference
    _check_built(optimizer, host)
    return optimizer


def _check_built(optimizer: Any, host: str) -> None:
    away = [v for v in _state(optimizer) if not same_device(v.value.device, host)]
    if away:
        raise ValueError(
            f"offload='optimizer' needs the optimizer's state on the host {host!r}, but {type(optimizer).__name__} "
            f"was built with {len(away)} of its slot variables elsewhere (e.g. {away[0].path!r} on "
            f"{away[0].value.device!r}). Build a new optimizer with tflms.build_optimizer(optimizer, "
            "model.trainable_variables, host) before the first step, instead of optimizer.build(...). "
            "Received: offload='optimizer'"
        )


def check_state_on_host(graph: Any, state: Sequence[str], host: str) -> None:
    """Raise ``ValueError`` when a variable of the optimizer's state that ``graph`` captures (its
    handle tensors ``state``, :attr:`tflms.plan.passes.offload.OffloadDecisions.variables`) is not
    a scalar and does not live on ``host``."""
    handles = {id(external): internal.name for external, internal in graph.captures}
    wanted = set(state)
    away = [
        v
        for v in graph.variables
        if handles.get(id(getattr(v, "handle", None))) in wanted
        and v.shape.rank != 0
        and not same_device(v.device, host)
    ]
    if away:
        raise ValueError(
            f"offload='optimizer' needs the optimizer's state on the host {host!r}, but {len(away)} of the "
            f"variables that only the update reads and writes live elsewhere (e.g. {away[0].name!r} on "
            f"{away[0].device!r}): the optimizer was built before tflms could place it. Build the optimizer with "
            "tflms.build_optimizer(optimizer, model.trainable_variables, host) before the first step "
            "(tflms.LMSCallback does it for model.fit). Received: offload='optimizer'"
        )


def place_weights(model: Any, host: str) -> list[Any]:
    """Move the trainable variables of ``model`` (a built Keras model, or a list of Keras
    variables) to ``host``, for ``offload="weights"``; return the variables moved.

    Each variable's value is made again as a ``tf.Variable`` on ``host`` (same value, dtype, name
    and trainability) and the Keras variable reads and writes it from then on; the variables
    already on ``host`` are left. Call it before the step is first traced (a traced step keeps
    reading the old variables) and before the optimizer is built (:func:`build_optimizer`): Keras's
    optimizer knows each variable by its ``tf.Variable`` (refused, ``ValueError``, for a model
    whose ``optimizer`` is built).
    Non-trainable variables (a BatchNorm's moving statistics) stay where they are: the update
    does not write them, and the step reads them on the device. Raises ``ValueError`` for a
    non-trainable variable given in a list.

    Example (one process split into two logical CPUs: ``/device:CPU:0`` plays the host)::

        >>> import keras, tflms
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> moved = place_weights(model, "/device:CPU:0")
        >>> sorted({v.value.device.rpartition("device:")[2] for v in model.trainable_variables})
        ['CPU:0']
    """
    if isinstance(model, (list, tuple)):
        variables = list(model)
        frozen = [v for v in variables if not v.trainable]
        if frozen:
            raise ValueError(
                f"offload='weights' places only trainable variables on the host (the update writes those); "
                f"{frozen[0].path!r} is not trainable. Pass model.trainable_variables, or the model itself. "
                f"Received: variables with {frozen[0].path!r} (trainable=False)"
            )
    else:
        optimizer = getattr(model, "optimizer", None)
        away = [v for v in model.trainable_variables if not same_device(v.value.device, host)]
        if away and optimizer is not None and getattr(optimizer, "built", False):  # a second fit passes
            raise ValueError(
                "offload='weights' must move the weights before the optimizer is built (Keras's optimizer "
                "knows each variable by its tf.Variable), but the model's optimizer is built. Call "
                "place_weights(model, host) before the first step, or compile the model with a new optimizer. "
                f"Received: model={model.name!r} with a built {type(optimizer).__name__}"
            )
        variables = list(model.trainable_variables)
    moved = []
    for v in variables:
        old = v.value
        if same_device(old.device, host):
            continue
        with tf.init_scope(), tf.device(host):
            new = tf.Variable(old.read_value(), trainable=old.trainable, name=old.name.split(":")[0], dtype=old.dtype)
        v._value = new  # noqa: SLF001 (Keras's TensorFlow variable: the tf.Variable it reads and writes)
        moved.append(v)
    return moved


def check_weights_on_host(graph: Any, weights: Sequence[str], host: str) -> None:
    """Raise ``ValueError`` when a weight that ``graph`` captures (its handle tensors ``weights``:
    :attr:`tflms.plan.passes.offload.OffloadDecisions.weights`, the variables its update writes)
    does not live on ``host``, or is not trainable."""
    handles = {id(external): internal.name for external, internal in graph.captures}
    wanted = set(weights)
    written = [v for v in graph.variables if handles.get(id(getattr(v, "handle", None))) in wanted]
    # A variable that the step reads without watching it (a non-trainable one) is not in graph.variables.
    unlisted = sorted(wanted - {handles.get(id(getattr(v, "handle", None))) for v in graph.variables})
    frozen = [v.name for v in written if not v.trainable] + unlisted
    if frozen:
        raise ValueError(
            f"offload='weights' moves the trainable variables that the update writes to the host, but the step "
            f"reads {frozen[0]!r} in its forward pass and writes it from the gradients, and it is not trainable. "
            f"Make it trainable, write it in the forward pass, or use offload='optimizer'. "
            f"Received: offload='weights'"
        )
    away = [v for v in written if not same_device(v.device, host)]
    if away:
        raise ValueError(
            f"offload='weights' needs the weights on the host {host!r}, but {len(away)} of the variables that the "
            f"update writes live elsewhere (e.g. {away[0].name!r} on {away[0].device!r}). Move them before the "
            "first step: tflms.integrations.offload.place_weights(model, host) (or build the model under "
            "tf.device(host)), then tflms.build_optimizer(optimizer, model.trainable_variables, host); "
            "tflms.LMSCallback does both for model.fit. Received: offload='weights'"
        )
