"""Measure a step's per-op compute times on its device: an :class:`~tflms.emulate.costs.OpProfile`.

:func:`profile_ops` calls a step a few times under TensorFlow's profiler
(:func:`tflms._tf_internal.profile_kernels`) and keeps, per op, the median over the profiled
calls of its time: on a GPU, the time of the kernels it ran on the device (with the idle time
of the stream before each kernel, when ``include_gaps``: a step whose kernels wait for the
executor to launch them is that much slower); elsewhere, the executor's record of the op.
:func:`profile_once` keeps one profile per step and input signature in this process, so that
the first call of a signature is profiled and the others reuse it. Save a profile with
:meth:`OpProfile.save` and plan with it anywhere (``tflms.Knobs(op_profile=path)``)::

    >>> import tensorflow as tf
    >>> from tflms.testing.measure import build
    >>> _, x, y, train_step = build("cnn", batch=4, size=16)
    >>> step = tf.function(train_step)
    >>> profile = profile_ops(step, (x, y), steps=1)
    >>> len(profile) > 20, profile.steps
    (True, 1)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from ..config import check_int
from ..emulate.costs import OpProfile
from ..plan.profiles import MAX_GAP, device_kernels_with_gaps, scratch_of_call, step_records

__all__ = ["profile_ops", "profile_once", "signature", "device_kernels_with_gaps", "MAX_GAP"]

_cache: dict[tuple[int, tuple], OpProfile] = {}


def signature(args: Sequence[Any]) -> tuple:
    """A hashable input signature of ``args``: each tensor's dtype and shape, anything else's repr."""
    out = []
    for a in args:
        shape, dtype = getattr(a, "shape", None), getattr(a, "dtype", None)
        if shape is not None and dtype is not None:
            out.append((str(getattr(dtype, "name", dtype)), tuple(shape)))
        else:
            out.append(repr(a))
    return tuple(out)


def profile_ops(
    step: Callable[..., Any],
    args: Sequence[Any],
    *,
    steps: int = 2,
    warmup: int = 1,
    device: str | None = None,
    include_gaps: bool = True,
) -> OpProfile:
    """Profile ``step(*args)``: ``warmup`` plain calls (the first traces and instantiates the
    function), then ``steps`` calls under the profiler; per op, the median of its time over
    them (module doc). ``device``: the device to run on (``tf.device``) and to record in the
    profile; where the profiler saw GPU kernels, their times are used, else the executor's.

    The calls train: a training step's variables change as in ``warmup + steps`` steps."""
    import tensorflow as tf

    from .. import _tf_internal as tfi

    check_int("steps", steps, 1)
    check_int("warmup", warmup, 0)
    if not callable(step):
        raise TypeError(f"step must be callable (a tf.function or a ConcreteFunction). Received: step={step!r}")
    args = tuple(args)
    scope = tf.device(device) if device is not None else contextlib.nullcontext()
    runs: list[list[dict[str, Any]]] = []
    scratch: list[dict[str, int]] = []
    with scope:
        for _ in range(warmup):
            step(*args)
        for _ in range(steps):
            records = tfi.profile_kernels(lambda: step(*args), allocations=True)
            runs.append(step_records(records, include_gaps))
            on_gpu = any(k.get("source") == "device" for k in records)
            scratch.append(scratch_of_call(records, device or ("/device:GPU:0" if on_gpu else "")))
    name = ""
    gpus = [k for k in runs[0] if k.get("source") == "device"] if runs else []
    if gpus:
        try:
            physical = tf.config.list_physical_devices("GPU")
            name = tf.config.experimental.get_device_details(physical[0]).get("device_name", "") if physical else ""
        except (RuntimeError, ValueError, IndexError):  # details are optional
            name = ""
    function = getattr(step, "__name__", None) or getattr(getattr(step, "graph", None), "name", "") or ""
    profile = OpProfile.from_kernels(runs, device=device or "", device_name=name, function=str(function))
    most = {op: max(s.get(op, 0) for s in scratch) for op in set().union(*scratch) if op in profile.ops}
    return dataclasses.replace(profile, scratch=most)


def profile_once(step: Callable[..., Any], args: Sequence[Any], **kwargs: Any) -> OpProfile:
    """:func:`profile_ops` of ``step`` for the input signature of ``args`` (:func:`signature`),
    made on the first call with that signature in this process and reused after."""
    key = (id(step), signature(args), tuple(sorted(kwargs.items())))
    found = _cache.get(key)
    if found is None:
        found = _cache[key] = profile_ops(step, args, **kwargs)
    return found
