"""Per-op compute time of a step: a measured profile where there is one, else a FLOP/byte estimate.

Pure data and arithmetic (no TensorFlow): :mod:`tflms.testing.profile` measures an
:class:`OpProfile` on the device, and :func:`op_seconds` turns a profile (or none) into
the compute time of every op of a :class:`~tflms.ir.graph.GraphModel`, which
:mod:`tflms.emulate.timeline` runs on a compute stream.

The estimate (:func:`estimate_seconds`) is a roofline per op: ``overhead + max(flops /
device.flops, bytes / device.bandwidth)``, where ``bytes`` is what the op reads and writes
(its inputs' and outputs' static sizes) and ``flops`` is counted for the op types whose
arithmetic dominates (:data:`FLOP_OP_TYPES`: convolutions and their gradients from the
filter shape, matrix products from the operands' sizes); ops that compute nothing (constants,
arguments, aliases, shape reads, :data:`FREE_OP_TYPES`) take no time.

A profile is saved and loaded as JSON (:meth:`OpProfile.to_json`, :meth:`OpProfile.load`),
so a plan for a GPU can be made and studied on a machine without one::

    {"format": "tflms-op-profile", "version": 1, "device": "/device:GPU:0",
     "device_name": "NVIDIA H100 80GB HBM3", "function": "train_step", "steps": 2,
     "ops": {"conv1/Conv2D": {"type": "Conv2D", "seconds": 0.00041}, ...}}

An op's record may also hold ``scratch_bytes``: the largest temporary buffer its kernel took
from the device's allocator (a convolution gradient's column buffer, a cuDNN workspace), which
the simulator allocates while the op runs (:func:`with_scratch`).

Example:
    >>> from tflms.ir.graph import GraphModel
    >>> f32 = lambda *s: ("float32", s, 4 * math.prod(s), False)
    >>> model = GraphModel.from_ops([
    ...     {"name": "a", "type": "Placeholder", "inputs": [], "outputs": [f32(64, 128)]},
    ...     {"name": "w", "type": "Placeholder", "inputs": [], "outputs": [f32(128, 256)]},
    ...     {"name": "mm", "type": "MatMul", "inputs": ["a:0", "w:0"], "outputs": [f32(64, 256)]},
    ... ])
    >>> flops(model, "mm")  # 2 * 64 * 256 * 128
    4194304
    >>> dev = DeviceRates(flops=1e12, bandwidth=1e12, overhead=0.0)
    >>> round(estimate_seconds(model, "mm", dev) * 1e6, 3)  # 4.19 MFLOP at 1 TFLOP/s: microseconds
    4.194
    >>> times = op_seconds(model, OpProfile({"mm": ("MatMul", 1e-3)}), dev)
    >>> times["mm"], times["a"]
    (0.001, 0.0)
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..config import DEVICE_BANDWIDTH, DEVICE_FLOPS
from ..ir.graph import ALIAS_OP_TYPES, GraphModel

__all__ = [
    "DeviceRates",
    "OpProfile",
    "PROFILE_FORMAT",
    "FLOP_OP_TYPES",
    "FREE_OP_TYPES",
    "DEVICE_FLOPS",
    "OP_OVERHEAD",
    "flops",
    "estimate_seconds",
    "op_seconds",
    "with_scratch",
]

PROFILE_FORMAT = "tflms-op-profile"
PROFILE_VERSION = 1
#: Default fixed cost of one op in the estimate, seconds (a kernel launch and the executor's work).
OP_OVERHEAD = 5e-6
#: Op types whose FLOPs :func:`flops` counts.
FLOP_OP_TYPES = frozenset(
    {
        "Conv2D",
        "Conv2DBackpropInput",
        "Conv2DBackpropFilter",
        "Conv3D",
        "Conv3DBackpropInputV2",
        "Conv3DBackpropFilterV2",
        "DepthwiseConv2dNative",
        "DepthwiseConv2dNativeBackpropInput",
        "DepthwiseConv2dNativeBackpropFilter",
        "_FusedConv2D",
        "MatMul",
        "_FusedMatMul",
        "BatchMatMul",
        "BatchMatMulV2",
        "BatchMatMulV3",
        "Einsum",
    }
)
#: Op types that take no compute time: they produce no new values on the device (arguments,
#: constants, views, shape reads, no-ops) or run on the host.
FREE_OP_TYPES = (
    frozenset(
        {
            "Placeholder",
            "_Arg",
            "_Retval",
            "Const",
            "HostConst",
            "NoOp",
            "VarHandleOp",
            "VariableV2",
            "Shape",
            "ShapeN",
            "Size",
            "Rank",
        }
    )
    | ALIAS_OP_TYPES
)

_ITEMSIZE = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4, "float64": 8, "double": 8}


@dataclasses.dataclass(frozen=True)
class DeviceRates:
    """What the estimate assumes of the device: FLOP/s, memory bytes/s, seconds per op (defaults:
    :data:`tflms.config.DEVICE_FLOPS`, :data:`tflms.config.DEVICE_BANDWIDTH`, :data:`OP_OVERHEAD`).

    >>> DeviceRates(flops=0)
    Traceback (most recent call last):
    ...
    ValueError: flops must be a positive number. Received: flops=0
    """

    flops: float = DEVICE_FLOPS
    bandwidth: float = DEVICE_BANDWIDTH
    overhead: float = OP_OVERHEAD

    def __post_init__(self) -> None:
        for name in ("flops", "bandwidth"):
            check_number(name, getattr(self, name), "a positive number")
        check_number("overhead", self.overhead, "a number of seconds >= 0", strict=False)


def check_number(name: str, value: Any, what: str, strict: bool = True) -> None:
    """Raise ``ValueError`` (``'<name> must be <what>. Received: ...'``) unless ``value`` is an int or
    a float, not a bool, above 0 (with ``strict=False``, 0 or above; NaN is neither).

    >>> check_number("latency", -1.0, "seconds >= 0", strict=False)
    Traceback (most recent call last):
    ...
    ValueError: latency must be seconds >= 0. Received: latency=-1.0
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 if strict else value >= 0):
        raise ValueError(f"{name} must be {what}. Received: {name}={value!r}")


def _elements(model: GraphModel, tensor: str) -> int:
    t = model.tensors[tensor]
    if t.shape is not None and None not in t.shape:
        return math.prod(t.shape)
    return t.bytes // _ITEMSIZE.get(t.dtype, 4) if t.bytes else 0


def _shape(model: GraphModel, tensor: str) -> tuple[int | None, ...] | None:
    return model.tensors[tensor].shape


def _window(shape: tuple[int | None, ...] | None, spatial: int) -> int | None:
    """Product of a filter's spatial dims times its input channels (``[*spatial, in, out]``), or None."""
    if shape is None or len(shape) != spatial + 2 or None in shape[: spatial + 1]:
        return None
    return math.prod(shape[: spatial + 1])  # type: ignore[arg-type]


def flops(model: GraphModel, op: str) -> int | None:
    """Floating-point operations of ``op`` (a multiply-add counts 2), or ``None`` where this model
    does not count them (an op type outside :data:`FLOP_OP_TYPES`, or shapes it cannot read).

    Convolutions: ``2 x output (or output-gradient) elements x kernel window x input channels``
    (depthwise: without the input channels); matrix products: ``2 x output elements x k``, with
    ``k`` from the operands' sizes (``sqrt(a * b / out)`` of their last two dimensions, whatever
    they are transposed by); ``Einsum``: see :func:`_einsum_flops`."""
    kind = model.dag.nodes[op]["type"]
    if kind not in FLOP_OP_TYPES:
        return None
    ins = model.inputs_of[op]
    outs = model.outputs_of[op]
    if not outs:
        return None
    if kind == "Einsum":
        return _einsum_flops(model, ins, outs[0])
    if kind in ("MatMul", "_FusedMatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"):
        if len(ins) < 2:
            return None
        a, b, o = _shape(model, ins[0]), _shape(model, ins[1]), _shape(model, outs[0])
        if not a or not b or not o or len(a) < 2 or len(b) < 2 or len(o) < 2:
            return None
        if None in (a[-2], a[-1], b[-2], b[-1], o[-2], o[-1]):
            return None
        k = math.sqrt(a[-2] * a[-1] * b[-2] * b[-1] / (o[-2] * o[-1]))  # type: ignore[operator]
        return int(2 * _elements(model, outs[0]) * round(k))
    spatial = 3 if kind.startswith("Conv3D") else 2
    depthwise = kind.startswith("Depthwise")
    if kind in ("Conv2D", "_FusedConv2D", "Conv3D", "DepthwiseConv2dNative"):
        filt, counted = _shape(model, ins[1]) if len(ins) > 1 else None, outs[0]
    elif "BackpropInput" in kind:
        filt, counted = _shape(model, ins[1]) if len(ins) > 2 else None, ins[-1]
    else:  # BackpropFilter: the output is the filter's gradient
        filt, counted = _shape(model, outs[0]), ins[-1] if ins else None
    window = _window(filt, spatial)
    if window is None or counted is None:
        return None
    if depthwise:
        window //= filt[spatial]  # type: ignore[index,operator]
    return int(2 * _elements(model, counted) * window)


def _einsum_flops(model: GraphModel, ins: list[str], out: str) -> int | None:
    """FLOPs of a two-operand ``Einsum`` from its shapes alone (the graph model keeps no equation):
    ``2 x output elements x contracted size``, where a dimension size ``v`` found ``n_a`` and
    ``n_b`` times in the operands and ``n_o`` times in the output is contracted
    ``(n_a + n_b - n_o) // 2`` times (a batch dimension is in all three, a free one in one operand
    and the output, a contracted one in both operands only). Exact where the sizes of different
    dimensions differ (Keras's attention: batch, sequence, heads, head width).

    >>> from tflms.ir.graph import GraphModel
    >>> f32 = lambda *s: ("float32", s, 4 * math.prod(s), False)
    >>> m = GraphModel.from_ops([
    ...     {"name": "q", "type": "Placeholder", "inputs": [], "outputs": [f32(2, 128, 8, 64)]},
    ...     {"name": "k", "type": "Placeholder", "inputs": [], "outputs": [f32(2, 128, 8, 64)]},
    ...     {"name": "s", "type": "Einsum", "inputs": ["q:0", "k:0"], "outputs": [f32(2, 8, 128, 128)]},
    ... ])
    >>> flops(m, "s") == 2 * (2 * 8 * 128 * 128) * 64
    True
    """
    if len(ins) != 2:
        return None
    a, b, o = _shape(model, ins[0]), _shape(model, ins[1]), _shape(model, out)
    if a is None or b is None or o is None or None in a or None in b or None in o:
        return None
    contracted = 1
    for v in set(a) | set(b):
        contracted *= v ** max(0, (a.count(v) + b.count(v) - o.count(v)) // 2)  # type: ignore[operator]
    return int(2 * _elements(model, out) * contracted)


def _bytes_moved(model: GraphModel, op: str) -> int:
    return sum(model.tensors[t].bytes for t in model.inputs_of[op]) + sum(
        model.tensors[t].bytes for t in model.outputs_of[op]
    )


def estimate_seconds(model: GraphModel, op: str, device: DeviceRates = DeviceRates()) -> float:
    """The estimated compute time of ``op`` (module doc): 0 for :data:`FREE_OP_TYPES`, else
    ``device.overhead + max(flops / device.flops, bytes read and written / device.bandwidth)``."""
    if model.dag.nodes[op]["type"] in FREE_OP_TYPES:
        return 0.0
    work = flops(model, op) or 0
    return device.overhead + max(work / device.flops, _bytes_moved(model, op) / device.bandwidth)


@dataclasses.dataclass(frozen=True)
class OpProfile:
    """Measured compute seconds per op of one step on one device: ``{op name: (op type, seconds)}``.

    ``device`` is the device it was measured on, ``device_name`` a readable name of it (a GPU's
    model), ``function`` the traced step's name and ``steps`` how many profiled steps the times
    are the median of. ``scratch``: per op, the bytes of the largest temporary buffer its kernel
    allocated on the device (ops without one are not listed). Make one with
    :func:`tflms.testing.profile.profile_ops` (or :meth:`from_kernels` from kernel records), save
    it with :meth:`save`, load it with :meth:`load`.
    """

    ops: Mapping[str, tuple[str, float]]
    device: str = ""
    device_name: str = ""
    function: str = ""
    steps: int = 1
    scratch: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        scratch = {}
        for name, nbytes in dict(self.scratch).items():
            if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
                raise ValueError(f"scratch must be bytes >= 0. Received: scratch[{name!r}]={nbytes!r}")
            if nbytes:
                scratch[str(name)] = nbytes
        object.__setattr__(self, "scratch", scratch)
        ops = {}
        for name, value in dict(self.ops).items():
            kind, seconds = value
            if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not seconds >= 0:
                raise ValueError(f"op times must be seconds >= 0. Received: ops[{name!r}]={value!r}")
            ops[str(name)] = (str(kind), float(seconds))
        object.__setattr__(self, "ops", ops)

    def __len__(self) -> int:
        return len(self.ops)

    def seconds(self, op: str) -> float | None:
        """The measured time of ``op``, or ``None`` where it has no record."""
        found = self.ops.get(op)
        return None if found is None else found[1]

    @classmethod
    def from_kernels(
        cls, runs: list[list[Mapping[str, Any]]], device: str = "", device_name: str = "", function: str = ""
    ) -> OpProfile:
        """A profile from the kernel records of one or more profiled steps (each a list of
        records with ``op``, ``type`` and ``duration_ns``, as :func:`tflms._tf_internal.profile_step`
        returns them): per op, the time of its records summed within a step (an op with several
        kernels), then the median over the steps it ran in."""
        per_step: dict[str, list[float]] = {}
        types: dict[str, str] = {}
        for kernels in runs:
            step: dict[str, float] = {}
            for k in kernels:
                step[k["op"]] = step.get(k["op"], 0.0) + k["duration_ns"] * 1e-9
                types.setdefault(k["op"], k.get("type", ""))
            for op, s in step.items():
                per_step.setdefault(op, []).append(s)
        ops = {op: (types[op], statistics.median(v)) for op, v in per_step.items()}
        return cls(ops, device=device, device_name=device_name, function=function, steps=len(runs))

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (module doc)."""
        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "device": self.device,
            "device_name": self.device_name,
            "function": self.function,
            "steps": self.steps,
            "ops": {
                op: {"type": kind, "seconds": s, **({"scratch_bytes": self.scratch[op]} if op in self.scratch else {})}
                for op, (kind, s) in sorted(self.ops.items())
            },
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OpProfile:
        """Inverse of :meth:`to_dict`; raises ``ValueError`` for data of another format."""
        if not isinstance(data, Mapping) or data.get("format") != PROFILE_FORMAT:
            got = data.get("format") if isinstance(data, Mapping) else type(data).__name__
            raise ValueError(
                f"not an op profile: expected format {PROFILE_FORMAT!r} (tflms.testing.profile.profile_ops writes "
                f"one). Received: format={got!r}"
            )
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(
                f"op profile version {data.get('version')!r} is not read by this tflms (it reads "
                f"{PROFILE_VERSION}). Received: version={data.get('version')!r}"
            )
        ops = {op: (rec.get("type", ""), rec["seconds"]) for op, rec in data["ops"].items()}
        scratch = {op: rec["scratch_bytes"] for op, rec in data["ops"].items() if "scratch_bytes" in rec}
        return cls(
            ops,
            device=data.get("device", ""),
            device_name=data.get("device_name", ""),
            function=data.get("function", ""),
            steps=int(data.get("steps", 1)),
            scratch=scratch,
        )

    def to_json(self) -> str:
        """:meth:`to_dict` as JSON text, one line per op."""
        data = self.to_dict()
        ops = data.pop("ops")
        head = json.dumps(data, indent=1)[:-2]
        body = ",\n".join(f"  {json.dumps(op)}: {json.dumps(rec)}" for op, rec in ops.items())
        empty = f'{head},\n "ops": {{}}\n}}'
        return f'{head},\n "ops": {{\n{body}\n }}\n}}' if ops else empty

    @classmethod
    def from_json(cls, text: str) -> OpProfile:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | Path) -> Path:
        """Write :meth:`to_json` to ``path`` (its folder is made); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json() + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> OpProfile:
        """Read a profile saved by :meth:`save`; a missing file raises ``FileNotFoundError`` naming it."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"op profile {str(path)!r} does not exist. Received: op_profile={str(path)!r}")
        return cls.from_json(path.read_text())


def with_scratch(model: GraphModel, scratch: Mapping[str, int]) -> GraphModel:
    """``model`` with each op of ``scratch`` (op name -> bytes, as :attr:`OpProfile.scratch`)
    marked to allocate a temporary buffer of that size while it runs (the node attribute
    ``scratch``, which :mod:`tflms.emulate.simulator` counts); ``model`` itself where no op of
    it is named. A recompute's clone gets its original's.

    >>> f32 = ("float32", (4,), 16, False)
    >>> m = GraphModel.from_ops([{"name": "c", "type": "Conv2DBackpropFilter", "inputs": [], "outputs": [f32]}])
    >>> with_scratch(m, {"c": 1 << 20}).dag.nodes["c"]["scratch"], with_scratch(m, {"x": 8}) is m
    (1048576, True)
    """
    if not scratch:
        return model
    profile = OpProfile({op: ("", 0.0) for op in scratch})
    found = {}
    for op in model.dag:
        name = _profiled_name(profile, op)
        if name is not None and scratch[name] > 0:
            found[op] = int(scratch[name])
    if not found:
        return model
    dag = model.dag.copy()
    for op, nbytes in found.items():
        dag.nodes[op]["scratch"] = nbytes
    return dataclasses.replace(model, dag=dag)


def _profiled_name(profile: OpProfile, op: str) -> str | None:
    """The name under which ``profile`` may hold ``op``'s time: the op itself, or for a
    recompute's clone (``tflms_recompute/<producer>/<group>/<op>``) the op it clones."""
    if op in profile.ops:
        return op
    from ..ir.decisions import RECOMPUTE_SCOPE

    if op.startswith(RECOMPUTE_SCOPE + "/"):
        parts = op.split("/")
        for i in range(2, len(parts) - 1):
            if parts[i].isdigit():
                original = "/".join(parts[i + 1 :])
                if original in profile.ops:
                    return original
    return None


def op_seconds(
    model: GraphModel, profile: OpProfile | None = None, device: DeviceRates = DeviceRates()
) -> dict[str, float]:
    """Compute seconds of every op of ``model``: the ``profile``'s time where it has the op (or,
    for a recompute's clone, the op it clones), else :func:`estimate_seconds` (an op of
    :data:`FREE_OP_TYPES` takes 0 either way)."""
    times = {}
    for op, kind in model.dag.nodes(data="type"):
        name = _profiled_name(profile, op) if profile is not None and kind not in FREE_OP_TYPES else None
        times[op] = profile.ops[name][1] if name is not None else estimate_seconds(model, op, device)  # type: ignore[union-attr]
    return times


def coverage(model: GraphModel, profile: OpProfile) -> float:
    """The fraction of ``model``'s timed ops (not :data:`FREE_OP_TYPES`) that ``profile`` has a time for."""
    timed = [op for op, kind in model.dag.nodes(data="type") if kind not in FREE_OP_TYPES]
    return sum(_profiled_name(profile, op) is not None for op in timed) / len(timed) if timed else 1.0
