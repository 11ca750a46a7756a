"""Validated, frozen options of the LMS pass.

Every knob of the planner lives here; nothing else decides. ``LMSConfig`` is
immutable and hashable, so a plan can record exactly the options it was made
with, and so a config can key caches.

Example:
    >>> from tflms import LMSConfig
    >>> cfg = LMSConfig(swapout_threshold=40, swapin_ahead=8)
    >>> cfg.swapin_groupby
    5
    >>> LMSConfig(swapout_threshold=-3)
    Traceback (most recent call last):
    ...
    ValueError: swapout_threshold must be an integer >= 0. Received: swapout_threshold=-3
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

from . import devices
from .devices import KNOWN_DEVICE_TYPES

__all__ = [
    "LMSConfig",
    "KNOWN_DEVICE_TYPES",
    "LINK_BANDWIDTH",
    "LINK_LATENCY",
    "DEVICE_BANDWIDTH",
    "MIN_BYTES",
    "check_int",
    "parse_bytes",
]


#: Default ``link_bandwidth``, bytes per second: a PCIe Gen4 x16 host link as achieved by
#: pinned copies (about 25 GB/s of its 31.5 GB/s per direction).
LINK_BANDWIDTH = 25 * 10**9
#: Default ``link_latency``, seconds: the fixed cost of one transfer (copy launch, events,
#: TensorFlow's send/receive), of the order of 10 µs.
LINK_LATENCY = 10e-6
#: Default ``min_bytes``: 256 KiB, about ``LINK_BANDWIDTH * LINK_LATENCY`` (250 kB). A
#: smaller transfer spends over half its link time on the fixed cost, and the most it can
#: free is its own size: ResNet50's ``[1, 1, 1, C]`` BatchNorm tensors (4-8 KiB) cost
#: their transfers' latency and free nothing that matters.
MIN_BYTES = 256 * 1024
#: Default ``device_bandwidth``, bytes per second: the device memory bandwidth that
#: recomputed element-wise ops are limited by (1 TB/s: a V100's HBM2 gives 0.9, an A100's
#: 1.6-2, an H100's 3.35). Compute time is estimated from bytes read and written, not
#: FLOPs, because only memory-bound element-wise ops are recomputed.
DEVICE_BANDWIDTH = 10**12
#: What ``swapout_window='auto'`` (the default) means where the device is a GPU: two swap-outs in
#: flight. Measured on an NVIDIA H200 (README, "Fences on the GPU"): without fences the forward pass runs ahead of
#: the link and ResNet50 224² at batch 44 held 2.6 times the predicted peak; with a window of 1, 2
#: and 4 it held 1.07-1.17 times it, at about the same step time (window 2, alone on the GPU: 246 ms
#: against 240 and 258 ms without fences).
GPU_SWAPOUT_WINDOW = 2


#: The values of ``LMSConfig.on_budget_miss``.
ON_BUDGET_MISS = ("raise", "best")


def _received(name: str, value: Any) -> str:
    return f"Received: {name}={value!r}"


_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}  # fmt: skip


def parse_bytes(value: Any, name: str = "size") -> int:
    """Bytes from an int or a size string: ``parse_bytes("16GiB") == 16 * 2**30``.

    Units: B, KB/MB/GB/TB (powers of 10), KiB/MiB/GiB/TiB and K/M/G/T (powers of 2);
    case and spaces do not matter; fractions are allowed (``"1.5GiB"``).

    >>> parse_bytes("1.5 GiB"), parse_bytes("500MB"), parse_bytes(4096)
    (1610612736, 500000000, 4096)
    """
    hint = "Use a positive number of bytes or a size such as '16GiB' or '500MB'."
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a size. {hint} {_received(name, value)}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{name} must be positive. {hint} {_received(name, value)}")
        return value
    if isinstance(value, str):
        import re

        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
            if n > 0:
                return n
    raise ValueError(f"{name} is not a valid size. {hint} {_received(name, value)}")


def check_int(name: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an int >= ``minimum`` (or allowed None)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        none = " or None" if allow_none else ""
        raise ValueError(f"{name} must be an integer >= {minimum}{none}. {_received(name, value)}")


def _check_bandwidth(name: str, value: Any) -> int:
    """Bytes per second from a positive number or a size string (``"25GB"``, ``"25GB/s"``)."""
    if isinstance(value, float) and math.isfinite(value) and value >= 1:
        return int(value)
    per_second = isinstance(value, str) and value.rstrip().lower().endswith("/s")
    try:
        return parse_bytes(value.rstrip()[:-2] if per_second else value, name)
    except ValueError:
        raise ValueError(
            f"{name} must be bytes per second: a positive number (25e9) or a size string ('25GB/s'). "
            f"{_received(name, value)}"
        ) from None


def _check_seconds(name: str, value: Any) -> float:
    """``value`` as a float number of seconds >= 0, or ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a number of seconds >= 0, e.g. 10e-6. {_received(name, value)}")
    return float(value)


def _check_device(name: str, value: Any, allow_none: bool) -> str | None:
    """Return the canonical form of a device string (:func:`tflms.devices.canonical`), or raise.

    Job, replica and task are kept: ``/job:worker/replica:0/task:0/device:CPU:0`` names a
    CPU in another process and is never taken for this process's ``/device:CPU:0``.
    """
    if value is None and allow_none:
        return None
    hint = "Use a string such as '/device:GPU:0', '/device:CPU:1' or '/job:worker/replica:0/task:0/device:CPU:0'."
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a device string. {hint} {_received(name, value)}")
    try:
        spec = devices.parse(value)
    except ValueError:
        raise ValueError(f"{name} is not a device string. {hint} {_received(name, value)}") from None
    if spec.type is None or spec.type not in KNOWN_DEVICE_TYPES:
        raise ValueError(
            f"{name} names an unknown device type {spec.type!r}; known types are "
            f"{', '.join(KNOWN_DEVICE_TYPES)}. {hint} {_received(name, value)}"
        )
    if spec.index is None:
        raise ValueError(f"{name} must name one device, with an index. {hint} {_received(name, value)}")
    return spec.to_string()


def _check_names(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Iterable) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{name} must be a sequence of non-empty strings. {_received(name, value)}")
    return tuple(sorted(set(value)))


def _check_op_types(name: str, value: tuple[str, ...]) -> None:
    if not value:
        return
    from ._tf_internal import op_type_registered  # imports TensorFlow: only when op types are given

    unknown = [t for t in value if not op_type_registered(t)]
    if unknown:
        raise ValueError(
            f"{name} names op types TensorFlow does not know: {', '.join(unknown)}. Use op type "
            f"names as in `op.type`, e.g. 'Conv2D', 'Relu'. {_received(name, value)}"
        )


@dataclasses.dataclass(frozen=True)
class LMSConfig:
    """Options of the LMS (large model support) pass.

    Attributes:
        device: compute device whose memory is relieved, e.g. ``'/device:GPU:0'``.
            ``None`` picks the Horovod local-rank GPU under Horovod, else the first
            GPU; with no GPU the plan is still made but the rewrite is skipped.
        host: device that holds swapped tensors. Default ``'/device:CPU:0'``.
        swapout_threshold: a tensor is swapped only for backward consumers more than
            this many topological levels after its producer.
        swapin_ahead: the swap-in is triggered by an op about this many levels
            before the first consumer it serves (larger = earlier prefetch).
        swapin_groupby: consumers whose levels lie within this many levels of the
            first one in a group share one swap-in.
        min_bytes: tensors smaller than this are never swapped (default
            :data:`MIN_BYTES`, 256 KiB: about ``link_bandwidth * link_latency`` of the
            default link; for another link, that product is a good value).
        n_tensors: swap at most this many tensors (the largest first); ``None`` = all.
        incl_scopes / excl_scopes: op-name prefixes; a tensor is a candidate only if its
            producer matches an include prefix (when any is given) and no exclude prefix.
        incl_types / excl_types: the same for producer op types (``op.type``).
        batch_size: size used for an unknown leading (batch) dimension when
            estimating tensor bytes; ``None`` = 1. Other unknown dimensions count as 1.
        budget: device memory budget in bytes (an int, or a string such as
            ``"16GiB"``/``"500MB"``). When set, the planner chooses
            ``swapout_threshold``, ``swapin_ahead``, ``swapin_groupby`` and ``n_tensors``
            itself (:mod:`tflms.autotune`); an unreachable budget raises
            :class:`tflms.BudgetError` carrying the best achievable predicted peak. A budget
            is met when the predicted peak is within it; a plan that leaves less room than
            the step's largest tensor warns (:func:`tflms.planner.check_placement`).
        on_budget_miss: what a ``budget`` that no plan is predicted to meet does:
            ``"raise"`` (default) raises :class:`tflms.BudgetError`; ``"best"`` warns
            (:class:`tflms.LMSWarning`, with the best predicted peak) and plans with the
            lowest plan the search found. The plan's options record it only when it was
            used (it changes the plan then, and its fingerprint).
        link_bandwidth: bytes per second of the device-host link, each direction (an int
            or a size string read as per second: ``"25GB"``); default
            :data:`LINK_BANDWIDTH` (PCIe Gen4 x16).
        link_latency: fixed cost of one transfer in seconds; default :data:`LINK_LATENCY`.
            With ``link_bandwidth`` it gives a plan's predicted link time
            (:attr:`tflms.SwapPlan.link_seconds`), which the autotuner minimises.
        recompute: when ``True``, a swap candidate whose producer is a chain of cheap
            element-wise ops over tensors that are on the device anyway at the backward
            pass (weights, tensors under ``min_bytes``, other swapped tensors) is
            recomputed just before its backward consumers instead of swapped, if the
            cost model (:mod:`tflms.recompute`) predicts less time. Default ``False``.
        device_bandwidth: device memory bandwidth in bytes per second (like
            ``link_bandwidth``); the recompute cost model's compute speed. Default
            :data:`DEVICE_BANDWIDTH`.
        swapout_window: at most this many swap-outs in flight: the forward op that
            produces the k-th swapped tensor (in execution order) starts only after the
            swap-out of the (k - ``swapout_window``)-th has reached the host (a
            :class:`tflms.Fence` per swap). A swapped-out buffer stays on the device
            until the link has sent it, so when the forward pass runs ahead of the link,
            several wait at once and the peak exceeds the prediction. A producer that is an
            ``Add``, ``AddV2`` or ``AddN`` gets no fence (a control input there changes
            how Grappler associates the sum; :data:`tflms.planner.UNFENCED_TYPES`).
            ``'auto'`` (default): :data:`GPU_SWAPOUT_WINDOW` where the device is a GPU
            (there the executor only enqueues kernels, and without fences the forward
            pass ran far ahead of the link: measured, README "Fences on the GPU"), no
            fences elsewhere (a CPU's executor waits for each op); the plan's options
            record the value used. ``None``: no fences.
        serialize: when ``True``, a memory-aware schedule: ordering edges
            (:class:`tflms.Order`) that make one branch of the backward pass wait for
            another where the simulator predicts a lower peak (:mod:`tflms.schedule`).
            Default ``True`` (since 2026-11-25; measured lower peaks on the test bed, see the
            README); ``False``: the swaps alone, and faster planning (a ResNet50 step 3-4 s,
            a ResNet152 224² step 40 s faster on 2 CPUs).
        swap_gradients: when ``True``, tensors of the backward pass are swap candidates too, by
            the same rules as the forward pass's: an activation gradient read again more than
            ``swapout_threshold`` levels later (in a residual network, the gradient that
            reaches a block waits at the shortcut while the block's main branch runs its
            backward pass). Default ``False``: more bytes over the link for a lower peak;
            with a ``budget`` the autotuner swaps only what it needs.
        split_sums: when ``True``, each ``AddN`` of the backward pass with three or more terms
            (a gradient that several consumers contribute to) becomes a chain of ``AddV2`` ops
            that adds each term as it arrives, in the association of TensorFlow's ``AddN``
            kernel and Grappler's order of its inputs, so the numbers are bit-identical
            (:mod:`tflms.sums`). The terms already added are freed instead of waiting on the
            device for the last one. Default ``False``: lower predicted peaks on DenseNet121
            and ResNet50, no measured capacity gain yet, a few more ops and memory traffic per sum
            (README, "Sums added as their terms arrive").
        drop_tiles: when ``True`` (needs ``split_sums=True``), each ``Tile`` or ``BroadcastTo`` of
            the backward pass that copies a value to an activation's size where broadcasting gives the same
            numbers (the gradient of a mean: two per BatchNorm and LayerNorm of Keras 3) is
            left out, and the element-wise ops that read its value broadcast it, bit-identically
            (:mod:`tflms.tiles`). Default ``False``: see the README, "Tiles left out".
        order_updates: when ``True``, each in-place update of a variable
            (``AssignSubVariableOp``, ``AssignAddVariableOp``: the optimizer's) waits for the
            ops that still hold a value read from that variable earlier in the step (a
            kernel's ``Conv2DBackpropInput``), through ordering edges (:class:`tflms.Order`,
            :func:`tflms.schedule.update_orders`). Otherwise TensorFlow copies the variable
            before updating it (``PrepareToUpdateVariable``) and the copy becomes the variable,
            in the middle of the memory the activations need. Kept only where the simulator
            predicts no higher plain peak with them. Default ``False``: measured on the test bed
            the updates copy nothing with them, but the peaks fell only for some models and
            batches, and the simulator predicts too large a fall (README, "Variable updates
            wait for their reads").
        manual_memory_optimizer: when ``True`` (default), ``tflms.function`` and
            ``tflms.LMSCallback`` call the step within :func:`tflms.manual_memory_optimizer`
            (Grappler's memory optimizer at ``MANUAL``): Grappler's default level may rewrite
            a large ``AddN`` into an accumulation whose constant of zeros stays in device
            memory, which the plan's predicted peak does not count. A level set by the
            caller's own ``function_call_options`` is kept. It changes no plan; steps from
            :func:`tflms.optimize` are called by the caller, who can wrap the calls.
        layout_optimizer: when ``False`` (default), ``tflms.function`` calls a step it
            rewrote, and ``tflms.LMSCallback`` its train function, with Grappler's layout
            optimizer off. On a GPU it converts convolutions to NCHW and adds ``Transpose``
            ops at the edges of what it converted: activation-sized buffers that the plan does
            not count (measured on an H200: two plans ran out of memory allocating one; README
            "Grappler's layout optimizer"). ``True``: TensorFlow's setting (on by default). A
            layout optimizer the caller turned on explicitly is kept. On a CPU it converts
            nothing unless ``cpu_layout_conversion`` is set. It changes no plan; steps from
            :func:`tflms.optimize` are called by the caller
            (``tf.config.optimizer.set_experimental_options({"layout_optimizer": False})``).
    """

    device: str | None = None
    host: str = "/device:CPU:0"
    swapout_threshold: int = 10
    swapin_ahead: int = 3
    swapin_groupby: int = 5
    min_bytes: int = MIN_BYTES
    n_tensors: int | None = None
    incl_scopes: tuple[str, ...] = ()
    excl_scopes: tuple[str, ...] = ()
    incl_types: tuple[str, ...] = ()
    excl_types: tuple[str, ...] = ()
    batch_size: int | None = None
    budget: int | None = None
    link_bandwidth: int = LINK_BANDWIDTH
    link_latency: float = LINK_LATENCY
    recompute: bool = False
    device_bandwidth: int = DEVICE_BANDWIDTH
    swapout_window: int | str | None = "auto"
    serialize: bool = True
    swap_gradients: bool = False
    split_sums: bool = False
    drop_tiles: bool = False
    order_updates: bool = False
    manual_memory_optimizer: bool = True
    layout_optimizer: bool = False
    on_budget_miss: str = "raise"

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "device", _check_device("device", self.device, allow_none=True))
        set_(self, "host", _check_device("host", self.host, allow_none=False))
        if self.device is not None and devices.same_device(self.device, self.host):
            raise ValueError(
                "device and host must differ: tensors are swapped from device to host. "
                f"Received: device={self.device!r}, host={self.host!r}"
            )
        check_int("swapout_threshold", self.swapout_threshold, 0)
        check_int("swapin_ahead", self.swapin_ahead, 1)
        check_int("swapin_groupby", self.swapin_groupby, 0)
        check_int("min_bytes", self.min_bytes, 0)
        check_int("n_tensors", self.n_tensors, 0, allow_none=True)
        check_int("batch_size", self.batch_size, 1, allow_none=True)
        window = self.swapout_window
        if (
            window != "auto"
            and window is not None
            and (isinstance(window, bool) or not isinstance(window, int) or window < 1)
        ):
            raise ValueError(
                f"swapout_window must be 'auto', an integer >= 1 or None. {_received('swapout_window', window)}"
            )
        if self.budget is not None:
            set_(self, "budget", parse_bytes(self.budget, "budget"))
        if not isinstance(self.on_budget_miss, str) or self.on_budget_miss not in ON_BUDGET_MISS:
            raise ValueError(
                "on_budget_miss must be 'raise' (a BudgetError when no plan is predicted to fit the budget) or "
                f"'best' (a warning, and the lowest plan). {_received('on_budget_miss', self.on_budget_miss)}"
            )
        set_(self, "link_bandwidth", _check_bandwidth("link_bandwidth", self.link_bandwidth))
        set_(self, "link_latency", _check_seconds("link_latency", self.link_latency))
        for name in (
            "recompute",
            "serialize",
            "swap_gradients",
            "split_sums",
            "drop_tiles",
            "order_updates",
            "manual_memory_optimizer",
            "layout_optimizer",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False. {_received(name, getattr(self, name))}")
        if self.drop_tiles and not self.split_sums:
            raise ValueError(
                "drop_tiles=True needs split_sums=True: a BatchNorm's or LayerNorm's input gradient is an AddN "
                "that reads a left-out Tile's per-channel value, and only the AddV2 chains of split_sums broadcast "
                "it. Received: drop_tiles=True, split_sums=False. Pass split_sums=True as well."
            )
        set_(self, "device_bandwidth", _check_bandwidth("device_bandwidth", self.device_bandwidth))
        for name in ("incl_scopes", "excl_scopes", "incl_types", "excl_types"):
            set_(self, name, _check_names(name, getattr(self, name)))
        _check_op_types("incl_types", self.incl_types)
        _check_op_types("excl_types", self.excl_types)

    @classmethod
    def from_options(cls, config: LMSConfig | None = None, **options: Any) -> LMSConfig:
        """Build a config from an optional base ``config`` and keyword overrides.

        Unknown keyword names raise ``TypeError`` listing the valid ones.
        """
        if config is not None and not isinstance(config, LMSConfig):
            raise TypeError(f"config must be a tflms.LMSConfig. Received: config={config!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"Unknown LMS option(s): {', '.join(unknown)}. Valid options: {', '.join(sorted(known))}.")
        base = config if config is not None else cls()
        return dataclasses.replace(base, **options) if options else base

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict of every option (tuples become lists); ``on_budget_miss`` only where it
        is not ``'raise'`` (a plan's options record it only when it changed the plan)."""
        d = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}
        if d["on_budget_miss"] == "raise":
            del d["on_budget_miss"]
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LMSConfig:
        """Inverse of :meth:`to_dict`."""
        return cls.from_options(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


def resolve_swapout_window(config: LMSConfig, device: str | None) -> LMSConfig:
    """``config`` with ``swapout_window='auto'`` made concrete for the target ``device``:
    :data:`GPU_SWAPOUT_WINDOW` on a GPU, ``None`` (no fences) elsewhere or where ``device`` is
    ``None``. Any other value is kept.

    >>> resolve_swapout_window(LMSConfig(), "/device:GPU:0").swapout_window
    2
    >>> resolve_swapout_window(LMSConfig(), "/device:CPU:1").swapout_window is None
    True
    """
    if config.swapout_window != "auto":
        return config
    gpu = device is not None and devices.parse(device).type == "GPU"
    return dataclasses.replace(config, swapout_window=GPU_SWAPOUT_WINDOW if gpu else None)


def _init_naming_unknown_options(init: Any) -> Any:
    """Wrap the dataclass ``__init__`` so an unknown keyword lists the valid options."""
    import functools

    @functools.wraps(init)
    def __init__(self: LMSConfig, *args: Any, **kwargs: Any) -> None:
        known = {f.name for f in dataclasses.fields(LMSConfig)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"Unknown LMS option(s): {', '.join(unknown)}. Valid options: {', '.join(sorted(known))}. "
                f"Received: {', '.join(f'{k}={kwargs[k]!r}' for k in unknown)}"
            )
        init(self, *args, **kwargs)

    return __init__


LMSConfig.__init__ = _init_naming_unknown_options(LMSConfig.__init__)  # type: ignore[method-assign]
