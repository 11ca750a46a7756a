"""Input signatures of traced steps, as text: ``'x: float32[64, 64], first_batch=True'``."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

__all__ = ["signature_text", "unknown_dimensions"]


def _inputs(cf: Any) -> list[tuple[str, Any]]:
    """Each input of ``cf`` as ``(text, spec)``: a tensor as ``('x: float32[?, 64]', TensorSpec)``, a
    Python argument as ``('first_batch=True', None)``; tensors first, in the traced order."""
    args, kwargs = cf.structured_input_signature
    names = [a.name for a in cf.graph.inputs[: len(cf.graph.inputs) - len(cf.graph.captures)]]
    params = list(cf.function_type.parameters)
    labels = params[: len(args)] + [f"arg{i}" for i in range(len(params), len(args))]
    tensors: list[tuple[str, Any]] = []
    literals: list[tuple[str, Any]] = []
    for label, value in [*zip(labels, args), *kwargs.items()]:
        leaves = tf.nest.flatten(value)
        for k, leaf in enumerate(leaves):
            if isinstance(leaf, tf.TensorSpec):
                i = len(tensors)
                name = leaf.name or (names[i].split(":")[0] if i < len(names) else f"arg{i}")
                dims = (
                    ", ".join("?" if d is None else str(d) for d in leaf.shape.as_list())
                    if leaf.shape.rank is not None
                    else "..."
                )
                tensors.append((f"{name}: {leaf.dtype.name}[{dims}]", leaf))
            elif leaf is not None:
                literals.append((f"{label}{f'[{k}]' if len(leaves) > 1 else ''}={leaf!r}", None))
    return tensors + literals


def signature_text(cf: Any) -> str:
    """``'x: float32[64, 64], y: int32[64]'`` for a ConcreteFunction's flat tensor inputs, then its
    Python arguments by name (``'x: float32[8, 64], first_batch=True'``): two traces that differ only
    in a Python argument get two texts."""
    return ", ".join(text for text, _ in _inputs(cf))


def unknown_dimensions(cf: Any, batch_known: bool = False) -> list[str]:
    """The tensor inputs of ``cf`` with a dimension of unknown size, as ``'x: float32[?, 64]'``;
    with ``batch_known``, an unknown leading (batch) dimension alone does not count."""
    unknown = []
    for text, spec in _inputs(cf):
        if spec is None:
            continue
        dims = spec.shape.as_list() if spec.shape.rank is not None else None
        if dims is None or None in (dims[1:] if batch_known else dims):
            unknown.append(text)
    return unknown
