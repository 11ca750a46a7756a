"""Op profiles made from a profiled call of a step: the measured op times the planner's timeline reads.

:func:`profile_of_call` turns the kernel records of one call under TensorFlow's profiler
(:func:`tflms._tf_internal.profile_kernels`) into an :class:`~tflms.emulate.costs.OpProfile`:
on a GPU, the time of each op's kernels on the device, with the idle time of the stream before
each kernel (:func:`device_kernels_with_gaps`: a kernel that waits for the executor to launch
it makes the step that much slower); elsewhere, the executor's record of each op. An op that
ran inlined into a caller (Keras runs the step inside its own function, which names it
``StatefulPartitionedCall/.../op``) counts for the step's op of the same name.

``Knobs(op_profile="auto")`` (:data:`AUTO_PROFILE`) makes :class:`tflms.LMSFunction` and
:class:`tflms.LMSCallback` profile the first rewritten call of each input signature, save the
profile (:func:`auto_profile_path`) and plan that signature again with it.

    >>> ks = [{"source": "executor", "op": "outer/StatefulPartitionedCall/conv", "type": "Conv2D",
    ...        "duration_ns": 2000, "time_ns": 0, "thread": "t"},
    ...       {"source": "executor", "op": "relu", "type": "Relu", "duration_ns": 500, "time_ns": 9, "thread": "t"}]
    >>> p = profile_of_call(ks, ops={"conv", "relu"}, device="/device:CPU:0", function="step")
    >>> sorted((op, kind, round(s * 1e9)) for op, (kind, s) in p.ops.items())  # nanoseconds
    [('conv', 'Conv2D', 2000), ('relu', 'Relu', 500)]
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from ..emulate.costs import OpProfile
from ..emulate.static import VARIABLE_WRITE_TYPES

__all__ = [
    "AUTO_PROFILE",
    "MAX_GAP",
    "auto_profile_path",
    "device_kernels_with_gaps",
    "profile_of_call",
    "scratch_of_call",
]

#: ``Knobs.op_profile`` value: profile the first rewritten call of each input signature, then plan again.
AUTO_PROFILE = "auto"

#: The longest idle time of a GPU stream before a kernel that :func:`device_kernels_with_gaps`
#: counts to that kernel's op, seconds: longer gaps are the step waiting for something else
#: (the host, a transfer), not this op's launch.
MAX_GAP = 1e-3


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


def step_records(kernels: Sequence[Mapping[str, Any]], include_gaps: bool = True) -> list[dict[str, Any]]:
    """The records of one profiled call that time its ops: the GPU's kernels where there are
    any (with their gaps, :func:`device_kernels_with_gaps`, when ``include_gaps``), else the
    executor's records."""
    on_device = [dict(k) for k in kernels if k.get("source") == "device"]
    if on_device:
        return device_kernels_with_gaps(on_device) if include_gaps else on_device
    return [dict(k) for k in kernels if k.get("source") == "executor"]


def _own_name(name: str, ops: Collection[str]) -> str | None:
    """``name``, or its shortest-prefix-stripped suffix that is one of ``ops`` (an op inlined
    into a caller's function), or None where no suffix is."""
    if name in ops:
        return name
    rest = name
    while "/" in rest:
        rest = rest.split("/", 1)[1]
        if rest in ops:
            return rest
    return None


def profile_of_call(
    kernels: Sequence[Mapping[str, Any]],
    *,
    ops: Collection[str] | None = None,
    device: str = "",
    device_name: str = "",
    function: str = "",
) -> OpProfile:
    """An :class:`OpProfile` of one profiled call from its kernel records (module doc). With
    ``ops`` (the step's op names), records of other ops are left out and an inlined op's record
    (``caller/.../op``) counts for ``op``."""
    records = step_records(kernels)
    if ops is not None:
        named = []
        for k in records:
            own = _own_name(k["op"], ops)
            if own is not None:
                named.append({**k, "op": own})
        records = named
    profile = OpProfile.from_kernels([records], device=device, device_name=device_name, function=function)
    scratch = scratch_of_call(kernels, device, ops)
    return dataclasses.replace(profile, scratch={op: n for op, n in scratch.items() if op in profile.ops})


def scratch_of_call(
    records: Sequence[Mapping[str, Any]], device: str = "", ops: Collection[str] | None = None
) -> dict[str, int]:
    """Per op, the largest temporary buffer its kernel took from ``device``'s allocator in one
    profiled call: the allocation records (``source == 'allocator'``, as
    :func:`tflms._tf_internal.profile_kernels` gives them with ``allocations=True``) of region
    ``temp``. A GPU's allocator is named ``GPU_<n>_bfc``; any other allocator counts for a
    device that is not a GPU. The temporary copy a variable write makes (``AssignSubVariableOp``
    and the other :data:`tflms.emulate.static.VARIABLE_WRITE_TYPES`) is left out: the simulator
    counts it as the variable's copy (its rule 6). With ``ops``, an inlined op's record counts
    for its own name and other ops' are left out.

    >>> rs = [{"source": "allocator", "region": "temp", "allocator": "cpu_bfc", "op": op, "bytes": b}
    ...       for op, b in (("f/conv", 512), ("f/conv", 2048), ("f/assign", 4096))]
    >>> rs += [{"source": "executor", "op": "f/assign", "type": "AssignSubVariableOp"}]
    >>> scratch_of_call(rs, "/device:CPU:0", ops={"conv", "assign"}), scratch_of_call(rs, "/device:GPU:0")
    ({'conv': 2048}, {})
    """
    gpu = "GPU" in device.upper()
    type_of = {r["op"]: r.get("type", "") for r in records if r.get("source") != "allocator"}
    found: dict[str, int] = {}
    for r in records:
        if r.get("source") != "allocator" or r.get("region") != "temp" or not r.get("op"):
            continue
        allocator = str(r.get("allocator", "")).upper()
        if allocator.startswith("GPU") != gpu or "HOST" in allocator:
            continue
        own = _own_name(r["op"], ops) if ops is not None else r["op"]
        if own is None or type_of.get(r["op"]) in VARIABLE_WRITE_TYPES:
            continue
        found[own] = max(found.get(own, 0), int(r["bytes"]))
    return found


def auto_profile_path(function: str, signature: str, device: str) -> str:
    """Where ``op_profile="auto"`` saves the profile of ``function`` for one input ``signature``
    on ``device``: a file under the system's temporary directory named by the three (a plan made
    with it records this path in its options)."""
    digest = hashlib.sha1(f"{function}|{signature}|{device}".encode()).hexdigest()[:12]
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in function)[:60] or "step"
    folder = os.path.join(tempfile.gettempdir(), "tflms-profiles")
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f"{safe}-{digest}.json")
