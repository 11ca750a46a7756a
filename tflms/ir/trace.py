"""The TensorFlow importer for Keras models: a compiled model's training step, traced for the graph model."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from ..config import check_int
from .graph import GraphModel, func_graph_sizer

__all__ = ["batch_sized", "graph_source", "keras_step_source", "keras_structure", "keras_train_step", "specs_text"]


def keras_step_source(model: Any, step: Any, label_shape: Any = None, label_dtype: Any = None) -> Any:
    """What to size a Keras model's training step by per batch: ``step`` (its
    :func:`keras_train_step`, traced with an unknown batch), or a ``factory(batch) ->
    ConcreteFunction`` tracing it with static shapes where the batch does not tell the size of
    a forward tensor. Plans could not swap such a tensor: a ``Dense`` on a 3-D input reshapes
    it to ``(None, None)``, and the product's leading dimension is batch x sequence.
    """
    traced = GraphModel.from_func_graph(step.graph)
    if all(batch_sized(traced, t) for t in traced.tensors.values() if traced.phase(t.op) == "forward"):
        return step
    return lambda batch: keras_train_step(model, label_shape, label_dtype, batch_size=batch)


def batch_sized(model: GraphModel, t: Any) -> bool:
    """True when the batch size tells ``t``'s size: its dimensions other than the leading one are static
    (tensors of no data, such as resources, count as sized), and it is not a ``Reshape`` that changes
    the elements per row of an unknown leading dimension (``reshape(t, (-1, C))`` of a ``(None, H, W,
    C)`` tensor gives ``(None, C)``: batch x H x W rows)."""
    if t.dtype in ("resource", "variant", "string"):
        return True
    if t.shape is None or None in t.shape[1:]:
        return False
    if t.shape and t.shape[0] is None and model.dag.nodes[t.op]["type"] == "Reshape":
        source = model.tensors[model.inputs_of[t.op][0]]
        if source.shape is None or not source.shape or source.shape[0] is not None or None in source.shape[1:]:
            return False
        return math.prod(source.shape[1:]) == math.prod(t.shape[1:])
    return True


def graph_source(step: Any) -> Callable[[int], GraphModel]:
    import keras

    from .. import _tf_internal as tfi

    if isinstance(step, keras.Model):
        step = keras_step_source(step, keras_train_step(step))
    if isinstance(step, tfi.ConcreteFunction):
        return func_graph_sizer(step.graph)  # the graph read once, sized per batch
    if callable(step):
        return lambda batch: GraphModel.from_func_graph(step(batch).graph, batch_size=batch)
    raise TypeError(
        "step must be a ConcreteFunction, a compiled keras.Model or a callable batch_size -> "
        f"ConcreteFunction. Received: step={step!r}"
    )


def keras_train_step(
    model: Any,
    label_shape: Sequence[int | None] | None = None,
    label_dtype: str | None = None,
    batch_size: int | None = None,
) -> Any:
    """The training step of a compiled Keras model, traced with an unknown batch size
    (or with ``batch_size``: every shape static).

    Inputs: every input of the model (``model.inputs``, in the structure the model
    takes them: one tensor, a list or a dict), with its shape and dtype. Labels: one
    per model output, in the outputs' structure, derived from the output and its
    loss: the output's shape as float32, or, for a sparse loss (e.g.
    ``sparse_categorical_crossentropy``), integer class ids (int32) shaped like the
    output without its last axis: ``(batch,)`` for a classifier, ``(batch, H, W)``
    for a per-pixel segmentation loss. ``label_shape`` (without the batch axis) and
    ``label_dtype`` override that for a model with one output.

    Raises ``ValueError`` for a model that is not compiled (with an optimizer and a
    loss), a model without known inputs (a subclassed model that was never built on
    ``keras.Input``), or bad ``label_shape``/``label_dtype``; ``TypeError`` when
    ``model`` is no ``keras.Model``.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Conv2D(8, 3), keras.layers.Flatten(),
        ...                           keras.layers.Dense(10)])
        >>> model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        >>> cf = keras_train_step(model)
        >>> [(s.shape.as_list(), s.dtype.name) for s in cf.structured_input_signature[0]]
        [([None, 32, 32, 3], 'float32'), ([None], 'int32')]
    """
    import keras
    import tensorflow as tf

    _check_compiled(model)
    name = model.name
    x_struct = keras_structure(model, "inputs")
    y_struct = keras_structure(model, "outputs")
    if x_struct is None or y_struct is None:
        raise ValueError(
            f"The Keras model {name!r} has no known inputs and outputs (a subclassed model, or a Sequential "
            "model without keras.Input): tflms reads the input shapes from model.inputs. Start the model with "
            "keras.Input(shape), or pass a ConcreteFunction of your training step traced with an unknown batch "
            f"dimension. Received: model={name!r} of class {type(model).__name__}"
        )
    outputs = keras.tree.flatten(y_struct)
    label_shape, label_dtype = _label_options(name, len(outputs), label_shape, label_dtype, batch_size)
    losses = _output_losses(model.loss, y_struct, getattr(model, "output_names", None))

    def label_spec(output: Any, loss: Any) -> Any:
        sparse = _is_sparse_loss(loss)
        shape = label_shape if label_shape is not None else tuple(output.shape[1 : -1 if sparse else None])
        dtype = label_dtype or ("int32" if sparse else "float32")
        return tf.TensorSpec((batch_size, *shape), dtype)

    x_spec = keras.tree.map_structure(lambda t: tf.TensorSpec((batch_size, *t.shape[1:]), t.dtype), x_struct)
    y_spec = keras.tree.pack_sequence_as(y_struct, [label_spec(o, loss) for o, loss in zip(outputs, losses)])
    optimizer = model.optimizer
    if not optimizer.built:
        optimizer.build(model.trainable_variables)

    return _trace_step(model, x_spec, y_spec, label_shape, label_dtype)


def _check_compiled(model: Any) -> None:
    """Raise unless ``model`` is a ``keras.Model`` compiled with an optimizer and a loss (:func:`keras_train_step`)."""
    import keras

    if not isinstance(model, keras.Model):
        raise TypeError(f"model must be a compiled keras.Model. Received: model={model!r}")
    name = model.name
    if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
        raise ValueError(
            f"The Keras model {name!r} is not compiled: compile it first with an optimizer and a loss, e.g. "
            f"model.compile(optimizer='adam', loss='sparse_categorical_crossentropy'). Received: model={name!r} "
            "(not compiled)"
        )
    if getattr(model, "loss", None) is None:
        raise ValueError(
            f"The Keras model {name!r} was compiled without a loss: compile it with one, e.g. "
            f"model.compile(optimizer='adam', loss='mse'). Received: model={name!r} (loss=None)"
        )


def _label_options(
    name: str,
    n_outputs: int,
    label_shape: Sequence[int | None] | None,
    label_dtype: str | None,
    batch_size: int | None,
) -> tuple[tuple[int | None, ...] | None, str | None]:
    """:func:`keras_train_step`'s ``label_shape`` and ``label_dtype`` checked (for the model ``name``
    of ``n_outputs`` outputs) and normalised, ``batch_size`` checked."""
    import tensorflow as tf

    if (label_shape is not None or label_dtype is not None) and n_outputs != 1:
        raise ValueError(
            f"label_shape and label_dtype apply to a model with one output; the model {name!r} has "
            f"{n_outputs}, whose labels are derived from each output and its loss. "
            f"Received: label_shape={label_shape!r}, label_dtype={label_dtype!r}"
        )
    if label_shape is not None:
        label_shape = _check_label_shape(label_shape)
    if batch_size is not None:
        check_int("batch_size", batch_size, 1)
    if label_dtype is not None:
        try:
            label_dtype = tf.as_dtype(label_dtype).name
        except TypeError:
            raise ValueError(
                f"label_dtype must be a TensorFlow dtype name such as 'int32' or 'float32'. "
                f"Received: label_dtype={label_dtype!r}"
            ) from None
    return label_shape, label_dtype


def _trace_step(model: Any, x_spec: Any, y_spec: Any, label_shape: Any, label_dtype: str | None) -> Any:
    """The training step of ``model`` (its optimizer built) traced on ``x_spec`` and ``y_spec``: one
    train step of :func:`keras_train_step`, its error, if any, told with the specs and label options."""
    import tensorflow as tf

    name = model.name
    optimizer = model.optimizer

    def train_step(x, y):
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            loss = model.compute_loss(x=x, y=y, y_pred=y_pred, training=True)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    try:
        return tf.function(train_step).get_concrete_function(x_spec, y_spec)
    except Exception as err:
        first = " ".join(str(err).split())
        first = first if len(first) <= 300 else first[:297] + "..."
        raise ValueError(
            f"Tracing the training step of the Keras model {name!r} failed with inputs {specs_text(x_spec)} and "
            f"labels {specs_text(y_spec)} (derived from the outputs and the loss {_loss_name(model.loss)}): "
            f"{type(err).__name__}: {first} If the loss expects other labels, pass label_shape= and label_dtype= "
            f"(tflms plan: --label-shape, --label-dtype). Received: label_shape={label_shape!r}, "
            f"label_dtype={label_dtype!r}"
        ) from err


def specs_text(structure: Any) -> str:
    """``(None, 64, 64, 3) float32``, several joined by ', ' (the structure flattened)."""
    import tensorflow as tf

    return ", ".join(f"{tuple(s.shape.as_list())} {s.dtype.name}" for s in tf.nest.flatten(structure))


def _loss_name(loss: Any) -> str:
    if isinstance(loss, (str, dict, list, tuple)):
        return repr(loss) if not isinstance(loss, (dict, list, tuple)) else type(loss).__name__
    return getattr(loss, "__name__", None) or type(loss).__name__


def keras_structure(model: Any, which: str) -> Any:
    """``model``'s symbolic inputs or outputs in the structure it takes/returns them, or None.

    Functional models keep the structure (one tensor, a list, a dict) in ``_inputs_struct`` /
    ``_outputs_struct``; a Sequential model in its inner Functional; otherwise the flat
    public list (one element: the tensor itself).
    """
    functional = model if hasattr(model, "_inputs_struct") else getattr(model, "_functional", None)
    struct = getattr(functional, f"_{which}_struct", None)
    if struct is not None:
        return struct
    try:
        tensors = list(getattr(model, which))
    except (AttributeError, ValueError, TypeError):
        return None
    return tensors[0] if len(tensors) == 1 else (tensors or None)


def _output_losses(loss: Any, y_struct: Any, output_names: Sequence[str] | None) -> list[Any]:
    """The compiled loss of each output, in ``keras.tree.flatten(y_struct)`` order (None: none)."""
    import keras

    n = len(keras.tree.flatten(y_struct))
    if isinstance(loss, dict):
        if isinstance(y_struct, dict):
            names = sorted(y_struct)  # keras.tree flattens a dict in sorted key order
        else:
            names = list(output_names or [])
        return [loss.get(k) for k in names] if len(names) == n else [None] * n
    if isinstance(loss, (list, tuple)):
        return list(loss) if len(loss) == n else [None] * n
    return [loss] * n


def _is_sparse_loss(loss: Any) -> bool:
    """Whether ``loss`` takes integer class ids (``sparse_categorical_crossentropy`` and friends)."""
    if loss is None:
        return False
    if isinstance(loss, str):
        return "sparse" in loss.lower()
    fn = getattr(loss, "fn", None)  # keras.losses.LossFunctionWrapper
    names = (type(loss).__name__, getattr(loss, "name", ""), getattr(loss, "__name__", ""), getattr(fn, "__name__", ""))
    return any("sparse" in str(n).lower() for n in names)


def _check_label_shape(label_shape: Any) -> tuple[int | None, ...]:
    ok = isinstance(label_shape, Sequence) and not isinstance(label_shape, str)
    ok = ok and all(d is None or (isinstance(d, int) and not isinstance(d, bool) and d >= 1) for d in label_shape)
    if not ok:
        raise ValueError(
            "label_shape must be a sequence of dimensions >= 1 (or None), without the batch axis, e.g. (64, 64) "
            f"or () for one label per sample. Received: label_shape={label_shape!r}"
        )
    return tuple(label_shape)
