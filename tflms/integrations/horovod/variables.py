"""Keras 3 variables for Horovod: :func:`backing_variable`, :func:`broadcast_variables`.

Horovod's TensorFlow API works on ``tf.Variable`` (it calls ``.ref()`` and
``.assign``); Keras 3 variables wrap one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import tensorflow as tf

from . import runtime

__all__ = ["backing_variable", "broadcast_variables"]


def backing_variable(variable: Any) -> tf.Variable:
    """The ``tf.Variable`` that stores a Keras 3 variable (a ``tf.Variable`` is returned as is).

    Horovod's TensorFlow API works on ``tf.Variable`` (it calls ``.ref()`` and
    ``.assign``), Keras 3 variables wrap one.

    Example:
        >>> import keras
        >>> layer = keras.layers.Dense(2); layer.build((None, 3))
        >>> type(backing_variable(layer.kernel)).__name__
        'ResourceVariable'
    """
    if isinstance(variable, tf.Variable):
        return variable
    for attr in ("value", "_value"):  # .value may be an autocast/stateless-scope tensor
        try:
            inner = getattr(variable, attr, None)
        except Exception:  # noqa: BLE001 - a property that cannot be read here; try the next
            inner = None
        if isinstance(inner, tf.Variable):
            return inner
    raise TypeError(
        "Expected a tf.Variable or a Keras 3 variable (TensorFlow backend) backed by one. "
        f"Received: variable={variable!r}"
    )


def backing_or_self(x: Any) -> Any:
    """A tensor as is, a variable as its backing ``tf.Variable`` (what a tape is given)."""
    return x if isinstance(x, tf.Tensor) else backing_variable(x)


def broadcast_variables(variables: Iterable[Any], root_rank: int = 0) -> Any:
    """Set ``variables`` on every rank to their values on ``root_rank``.

    Accepts Keras 3 variables and ``tf.Variable`` (duplicates are broadcast once),
    e.g. ``model.variables + optimizer.variables`` after ``optimizer.build``. Call
    it on every rank, before the first step. Returns what
    ``hvd.broadcast_variables`` returns (an op when called in a graph).

    Example (in one process there is nothing to send, and it returns ``None``):
        >>> import keras, tflms.integrations.horovod as lms_hvd
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        >>> opt = keras.optimizers.Adam()
        >>> opt.build(model.trainable_variables)
        >>> lms_hvd.broadcast_variables(model.variables + opt.variables) is None
        True
    """
    hvd = runtime.active("broadcast_variables")
    n = 1 if hvd is None else hvd.size()
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not 0 <= root_rank < n:
        raise ValueError(f"root_rank must be a rank in [0, {n}). Received: root_rank={root_rank!r}")
    seen: set[Any] = set()
    unique = []
    for v in variables:
        tv = backing_variable(v)
        if tv.ref() not in seen:
            seen.add(tv.ref())
            unique.append(tv)
    if not unique or n == 1:
        return None
    return hvd.broadcast_variables(unique, root_rank=root_rank)
