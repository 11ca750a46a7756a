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
from collections.abc import Callable, Sequence
from typing import Any

from ..config import check_int
from ..emulate.costs import OpProfile

__all__ = ["profile_ops", "profile_once", "signature", "device_kernels_with_gaps", "MAX_GAP"]

#: The longest idle time of a GPU stream before a kernel that :func:`device_kernels_with_gaps`
#: counts to that kernel's op, seconds: longer gaps are the step waiting for something else
#: (the host, a transfer), not this op's launch.
MAX_GAP = 1e-3

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


def device_kernels_with_gaps(kernels: list[dict[str, Any]], max_gap: float = MAX_GAP) -> list[dict[str, Any]]:
    """GPU kernel records (``source == 'device'``) with the idle time of their stream before them
    (up to ``max_gap`` seconds) added to their ``duration_ns``: on one stream, the time from the
    end of the kernel before to this one's start. The first kernel of a stream gets none.

    >>> ks = [{"source": "device", "thread": "s", "time_ns": t, "duration_ns": 10, "op": o, "type": "X"}
    ...       for t, o in ((0, "a"), (15, "b"), (10**8, "c"))]
    >>> [k["duration_ns"] for k in device_kernels_with_gaps(ks)]  # b waited 5 ns; c's gap is too long
    [10, 15, 10]
    """
    out = []
    last_end: dict[str, int] = {}
    for k in sorted((k for k in kernels if k.get("source") == "device"), key=lambda k: (k["thread"], k["time_ns"])):
        k = dict(k)
        before = last_end.get(k["thread"])
        if before is not None and 0 < k["time_ns"] - before <= max_gap * 1e9:
            k["duration_ns"] += k["time_ns"] - before
        last_end[k["thread"]] = max(before or 0, k["time_ns"] + k["duration_ns"])
        out.append(k)
    return out


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
    runs = []
    with scope:
        for _ in range(warmup):
            step(*args)
        for _ in range(steps):
            kernels = tfi.profile_kernels(lambda: step(*args))
            on_device = [k for k in kernels if k["source"] == "device"]
            if on_device:
                runs.append(device_kernels_with_gaps(on_device) if include_gaps else on_device)
            else:
                runs.append([k for k in kernels if k["source"] == "executor"])
    name = ""
    gpus = [k for k in runs[0] if k.get("source") == "device"] if runs else []
    if gpus:
        try:
            physical = tf.config.list_physical_devices("GPU")
            name = tf.config.experimental.get_device_details(physical[0]).get("device_name", "") if physical else ""
        except (RuntimeError, ValueError, IndexError):  # details are optional
            name = ""
    function = getattr(step, "__name__", None) or getattr(getattr(step, "graph", None), "name", "") or ""
    return OpProfile.from_kernels(runs, device=device or "", device_name=name, function=str(function))


def profile_once(step: Callable[..., Any], args: Sequence[Any], **kwargs: Any) -> OpProfile:
    """:func:`profile_ops` of ``step`` for the input signature of ``args`` (:func:`signature`),
    made on the first call with that signature in this process and reused after."""
    key = (id(step), signature(args), tuple(sorted(kwargs.items())))
    found = _cache.get(key)
    if found is None:
        found = _cache[key] = profile_ops(step, args, **kwargs)
    return found
