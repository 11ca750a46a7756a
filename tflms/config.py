"""Validated, frozen options of tflms: what a user sets, apart from the planner's knobs.

A user sets :class:`LMSConfig`'s few options: ``budget`` (``"auto"`` by default: the
device's own memory limit times :data:`AUTO_MARGIN`), ``device`` and ``host``, ``policy``
(which of the planner's passes may run, by name) and ``on_budget_miss``. The planner's knobs
(thresholds, link model, heuristics) live in :class:`Knobs`, for experts. Both are immutable
and hashable, so a plan records exactly the options it was made with, and a config can key
caches.

Example:
    >>> from tflms import LMSConfig
    >>> cfg = LMSConfig(budget="6GiB", device="/device:GPU:0")
    >>> cfg.budget, sorted(cfg.policy) == sorted(DEFAULT_POLICY)
    (6442450944, True)
    >>> sorted(LMSConfig(policy=("default", "recompute")).policy)
    ['recompute', 'swap_gradients']
    >>> LMSConfig(knobs=Knobs(swapout_threshold=40)).knobs.swapout_threshold
    40
    >>> LMSConfig(swapout_threshold=40)
    Traceback (most recent call last):
    ...
    TypeError: swapout_threshold=40 is a knob, not an option: write knobs=tflms.Knobs(swapout_threshold=40).
    >>> LMSConfig(policy="fast")
    Traceback (most recent call last):
    ...
    ValueError: policy names an unknown pass 'fast'. Known: 'default', 'none', ... Received: policy='fast'
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

from . import _devices as devices
from ._checks import check_bandwidth as _check_bandwidth
from ._checks import check_device as _check_device
from ._checks import check_int, parse_bytes
from ._checks import check_seconds as _check_seconds
from ._checks import received as _received
from ._device_list import check_devices
from ._devices import KNOWN_DEVICE_TYPES

__all__ = [
    "AUTO_MARGIN",
    "CALL_SETTINGS",
    "DEFAULT_POLICY",
    "Knobs",
    "LMSConfig",
    "KNOWN_DEVICE_TYPES",
    "POLICIES",
    "POLICY_NEEDS",
    "LINK_BANDWIDTH",
    "LINK_LATENCY",
    "DEVICE_BANDWIDTH",
    "DEVICE_FLOPS",
    "TRIGGER_RULES",
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
#: flight. A GPU's executor only enqueues kernels, so without fences the forward pass runs ahead of
#: the link and holds several swapped-out buffers at once, above the predicted peak; a window of 1
#: to 4 keeps the measured peak near the prediction at about the plain step's time, and 2 is the
#: fastest of those (the numbers: docs, benchmarks, "Fences on the GPU").
GPU_SWAPOUT_WINDOW = 2


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


#: The passes a ``policy`` may name (each is documented on the docs' "Passes" page):
#: ``swap_gradients`` (tensors of the backward pass are swap candidates too), ``split_sums``
#: (a gradient sum adds each term as it arrives), ``drop_tiles`` (the gradient of a mean is
#: broadcast, not tiled; needs ``split_sums``), ``order_updates`` (a variable's update waits for
#: the reads of it still held) and ``recompute`` (cheap element-wise tensors recomputed instead
#: of swapped).
POLICIES = ("drop_tiles", "order_updates", "recompute", "split_sums", "swap_gradients")
#: ``(pass, pass it needs, why)``: a policy naming the first names the second. The passes declare
#: their needs (``Pass.needs``); :mod:`tflms.plan.registry` checks at import that these are theirs.
POLICY_NEEDS = (
    ("drop_tiles", "split_sums", "a BatchNorm's or LayerNorm's input gradient is an AddN that reads a left-out "
     "Tile's per-channel value, and only the AddV2 chains of split_sums broadcast it"),
)  # fmt: skip
#: The passes of ``policy="default"``: those that run the plain step's kernels on the plain
#: step's inputs in the plain step's order, so that training stays bit-identical on any model
#: and any CPU. ``swap_gradients`` only adds candidates for swapping, and a swap is a copy: the
#: consumer reads the same bits. The others are opt-in: ``split_sums`` and ``drop_tiles``
#: change how a floating-point sum is associated or which kernel broadcasts it (what the CPU's
#: kernels and Grappler's arithmetic optimizer then make of it depends on the CPU);
#: ``order_updates`` adds control edges around the update, which Grappler's arithmetic
#: optimizer may answer with another association; ``recompute`` runs element-wise ops twice.
#: With a budget, the autotuner still swaps only what the budget needs.
DEFAULT_POLICY = frozenset({"swap_gradients"})
#: ``budget="auto"``: this fraction of the device's memory limit. A plan's measured peak can
#: exceed its prediction by up to about 10 % (benchmarks/results/testbed_capacity.json), so a plan
#: predicted at 0.9 of the limit stays under it.
AUTO_MARGIN = 0.9
#: Default ``device_flops``: the FLOP rate of the op-time estimate (:mod:`tflms.emulate.costs`), of
#: the order of a data-centre GPU's dense float32 rate (A100: 19.5 TFLOP/s without TF32; H100 SXM: 67).
DEVICE_FLOPS = 50e12
#: Values of ``triggers``: the swap-in trigger rule.
TRIGGER_RULES = ("levels", "timeline")
#: Values of ``on_budget_miss``.
BUDGET_MISS_ACTIONS = ("raise", "best")
#: Values of ``offload``: what lives on the host besides swapped tensors.
OFFLOAD_VALUES = (None, "optimizer", "weights")
#: Settings of how ``tflms.function`` and ``tflms.LMSCallback`` call a rewritten step: keyword
#: arguments of those two, not options of a plan (plans made before they moved may record them;
#: :meth:`LMSConfig.from_dict` leaves them out).
CALL_SETTINGS = ("manual_memory_optimizer", "layout_optimizer")


@dataclasses.dataclass(frozen=True)
class Knobs:
    """The planner's knobs, for experts: ``LMSConfig(knobs=Knobs(...))``.

    With a ``budget`` (the default, ``"auto"``), the autotuner chooses ``swapout_threshold``,
    ``swapin_ahead``, ``swapin_groupby`` and ``n_tensors`` itself; set them for a plan made
    without a budget (``budget=None``). Knobs are given only as a whole:
    ``tflms.function(step, knobs=tflms.Knobs(swapout_threshold=40))``; a knob's name as an
    option of its own (``LMSConfig(swapout_threshold=40)``) raises ``TypeError``.

    Attributes:
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
        link_bandwidth: bytes per second of the device-host link, each direction (an int
            or a size string read as per second: ``"25GB"``); default
            :data:`LINK_BANDWIDTH` (PCIe Gen4 x16).
        link_latency: fixed cost of one transfer in seconds; default :data:`LINK_LATENCY`.
            With ``link_bandwidth`` it gives each transfer's time on the step's timeline
            (:mod:`tflms.emulate.timeline`), whose predicted step time the autotuner minimises,
            and a plan's predicted link time (:attr:`tflms.SwapPlan.link_seconds`).
        device_bandwidth: device memory bandwidth in bytes per second (like
            ``link_bandwidth``); the recompute cost model's compute speed. Default
            :data:`DEVICE_BANDWIDTH`.
        device_flops: the device's FLOP rate for the op-time estimate (:mod:`tflms.emulate.costs`:
            convolutions and matrix products) where no measured profile gives an op's time;
            default :data:`DEVICE_FLOPS`.
        op_profile: path of a measured op profile's JSON (:class:`tflms.emulate.costs.OpProfile`,
            made by :func:`tflms.testing.profile.profile_ops`), ``'auto'`` or ``None``: each op's
            compute time on the step's timeline (:mod:`tflms.emulate.timeline`), which the
            autotuner minimises; ops without a record are estimated. ``'auto'``: the first
            rewritten call of each input signature runs under TensorFlow's profiler, its op times
            are saved (:func:`tflms.plan.profiles.auto_profile_path`) and the signature is planned
            again with them; until then, and for a step that needs no rewrite, the estimate.
        triggers: the swap-in trigger rule. ``'levels'`` (default): an op about
            ``swapin_ahead`` levels before the first consumer; ``'timeline'``: the op that ends
            last before the consumer's start on the plain step's timeline minus the transfer
            time (Grappler's rule), where the predicted peak still fits the budget; where it does
            not, only the swap-ins that rule triggers later than the level rule are moved.
        swapout_window: at most this many swap-outs in flight: the forward op that
            produces the k-th swapped tensor (in execution order) starts only after the
            swap-out of the (k - ``swapout_window``)-th has reached the host (a
            :class:`tflms.Fence` per swap). A swapped-out buffer stays on the device
            until the link has sent it, so when the forward pass runs ahead of the link,
            several wait at once and the peak exceeds the prediction. A producer that is an
            ``Add``, ``AddV2`` or ``AddN`` gets no fence (a control input there changes
            how Grappler associates the sum; :data:`tflms.plan.planner.UNFENCED_TYPES`).
            ``'auto'`` (default): :data:`GPU_SWAPOUT_WINDOW` where the device is a GPU
            (there the executor only enqueues kernels, and without fences the forward
            pass runs ahead of the link: docs, benchmarks, "Fences on the GPU"), no
            fences elsewhere (a CPU's executor waits for each op); the plan's options
            record the value used. ``None``: no fences.
        serialize: when ``True``, a memory-aware schedule: ordering edges
            (:class:`tflms.Order`) that make one branch of the backward pass wait for
            another where the simulator predicts a lower peak (:mod:`tflms.plan.passes.schedule`).
            Default ``True``: it lowers the measured peak (docs, benchmarks, "Memory-aware
            schedule"); ``False``: the swaps alone, and faster planning.

    Example:
        >>> Knobs(swapout_threshold=40).swapin_groupby
        5
        >>> Knobs(swapout_threshold=-3)
        Traceback (most recent call last):
        ...
        ValueError: swapout_threshold must be an integer >= 0. Received: swapout_threshold=-3
    """

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
    link_bandwidth: int = LINK_BANDWIDTH
    link_latency: float = LINK_LATENCY
    device_bandwidth: int = DEVICE_BANDWIDTH
    device_flops: float = DEVICE_FLOPS
    op_profile: str | None = None
    triggers: str = "levels"
    swapout_window: int | str | None = "auto"
    serialize: bool = True

    def __post_init__(self) -> None:
        set_ = object.__setattr__
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
        set_(self, "link_bandwidth", _check_bandwidth("link_bandwidth", self.link_bandwidth))
        set_(self, "link_latency", _check_seconds("link_latency", self.link_latency))
        set_(self, "device_bandwidth", _check_bandwidth("device_bandwidth", self.device_bandwidth))
        flops = self.device_flops
        if isinstance(flops, bool) or not isinstance(flops, (int, float)) or not math.isfinite(flops) or flops <= 0:
            raise ValueError(
                f"device_flops must be a positive number of FLOP/s, e.g. 50e12. {_received('device_flops', flops)}"
            )
        set_(self, "device_flops", float(flops))
        if self.op_profile is not None and (not isinstance(self.op_profile, str) or not self.op_profile):
            raise ValueError(
                "op_profile must be the path of an op profile's JSON (tflms.testing.profile.profile_ops), 'auto' "
                "(profile the first rewritten call of each input signature) or None. "
                f"{_received('op_profile', self.op_profile)}"
            )
        if self.triggers not in TRIGGER_RULES:
            raise ValueError(
                f"triggers must be one of {', '.join(map(repr, TRIGGER_RULES))}. {_received('triggers', self.triggers)}"
            )
        if not isinstance(self.serialize, bool):
            raise ValueError(f"serialize must be True or False. {_received('serialize', self.serialize)}")
        for name in ("incl_scopes", "excl_scopes", "incl_types", "excl_types"):
            set_(self, name, _check_names(name, getattr(self, name)))
        _check_op_types("incl_types", self.incl_types)
        _check_op_types("excl_types", self.excl_types)

    def replace(self, **changes: Any) -> Knobs:
        """A copy with ``changes`` (knob names): ``Knobs(min_bytes=0).replace(swapout_threshold=5)``."""
        return dataclasses.replace(self, **changes)


KNOB_NAMES = tuple(f.name for f in dataclasses.fields(Knobs))


def _check_policy(value: Any) -> frozenset[str]:
    """The set of pass names of a ``policy``: a name or a collection of names, where
    ``'default'`` stands for :data:`DEFAULT_POLICY` and ``'none'`` for no pass."""
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, Iterable) or not all(isinstance(n, str) for n in names):
        raise ValueError(
            "policy must be a pass name or a collection of them, e.g. 'default' or ('default', 'recompute'). "
            f"{_received('policy', value)}"
        )
    chosen: set[str] = set()
    for n in names:
        if n == "default":
            chosen |= DEFAULT_POLICY
        elif n in POLICIES:
            chosen.add(n)
        elif n != "none":
            known = ", ".join(repr(k) for k in ("default", "none", *POLICIES))
            raise ValueError(f"policy names an unknown pass {n!r}. Known: {known}. {_received('policy', value)}")
    for name, need, why in POLICY_NEEDS:
        if name in chosen and need not in chosen:
            raise ValueError(
                f"policy {name!r} needs {need!r}: {why}. Add {need!r} to the policy. {_received('policy', value)}"
            )
    return frozenset(chosen)


def _with_passes(policy: Any, passes: Mapping[str, Any]) -> frozenset[str]:
    """``policy`` with the passes given as booleans (the options of older versions) turned on or
    off; a pass off takes those that need it (:data:`POLICY_NEEDS`) off too unless they are given."""
    chosen = set(_check_policy(policy))
    for name, on in passes.items():
        if not isinstance(on, bool):
            raise ValueError(f"{name} must be True or False. {_received(name, on)}")
        (chosen.add if on else chosen.discard)(name)
    for name, need, _ in POLICY_NEEDS:
        if name in chosen and need not in chosen and name not in passes:
            chosen.discard(name)
    return frozenset(chosen)


def _pass_option_message(policy: Any, options: Mapping[str, Any], passes: Iterable[str]) -> str:
    """The error of pass names given as options (``split_sums=False``): the policy to write instead."""
    given = ", ".join(f"{k}={options[k]!r}" for k in passes)
    head = f"{given} is not an option: a pass runs where policy names it."
    try:
        suggested = sorted(_with_passes(policy, {k: options[k] for k in passes}))
    except ValueError:  # a value that is not a boolean, or a policy that is not valid itself
        names = ", ".join(repr(k) for k in passes)
        return f"{head} Name {names} in policy to run it, e.g. policy=('default', {names}). Received: {given}"
    off = [repr(k) for k in passes if options[k] is False]
    without = f": without {', '.join(off)}" if off else ""
    return f"{head} Write policy={tuple(suggested) if suggested else 'none'!r} instead{without}."


@dataclasses.dataclass(frozen=True)
class LMSConfig:
    """What a user sets: the memory budget, the devices, the passes by name.

    Attributes:
        budget: device memory the step must fit. ``"auto"`` (default): the device's memory
            limit (a GPU's allocator limit, a ``memory_limit`` you set included; the test
            bed's cap) times :data:`AUTO_MARGIN`; where no limit is known (a CPU device
            outside the test bed), as ``None``. A size (bytes, or a string such as ``"16GiB"``
            or ``"500MB"``): the autotuner finds the plan with the least predicted step time
            (:mod:`tflms.emulate.timeline`) whose predicted peak fits. A step whose predicted
            peak already fits is not rewritten.
            ``None``: no budget; every candidate is swapped by the knobs' rules (TFLMS's way).
        device: compute device whose memory is relieved, e.g. ``'/device:GPU:0'``. ``None``
            picks the Horovod local-rank GPU under Horovod, else the first GPU; with no GPU the
            plan is still made but the rewrite is skipped.
        host: device that holds swapped tensors. Default ``'/device:CPU:0'``.
        policy: which passes the planner may use besides swaps, by name (:data:`POLICIES`);
            ``"default"`` is :data:`DEFAULT_POLICY`, ``"none"`` swaps only. Combine names:
            ``("default", "recompute")``.
        on_budget_miss: what happens when no plan is predicted to fit the budget: ``"raise"``
            (default) raises :class:`tflms.BudgetError` with the best predicted peak;
            ``"best"`` warns and uses the plan with the lowest predicted peak.
        knobs: the planner's knobs (:class:`Knobs`), for experts.
        offload: ``None`` (default) or ``"optimizer"``: the optimizer's state (its slot variables)
            lives on ``host``, its update runs there, each gradient is sent there as the backward
            pass makes it and each weight's change comes back (:mod:`tflms.plan.passes.offload`).
            ``"weights"``: the weights (trainable variables) live on ``host`` too, and each comes
            to the device for its forward use and again for its backward use, host-gated, a few
            levels ahead (:mod:`tflms.plan.passes.offload_weights`).
        devices: ``None`` (default: one device) or two or more device strings: the step's ops are
            placed on them in stages (:mod:`tflms.plan.passes.place`), ``devices[0]`` holding the
            variables and the step's arguments; then nothing is swapped.

    A knob is set in ``knobs`` only: ``LMSConfig(knobs=Knobs(swapout_threshold=40))``; a knob's
    name given as an option (``LMSConfig(swapout_threshold=40)``) raises ``TypeError`` saying so,
    and so does a call setting of ``tflms.function`` (``layout_optimizer=True``). A pass is named
    in ``policy`` only: a pass name as a boolean option (``split_sums=False``) raises
    ``TypeError`` saying which policy to write.
    """

    budget: int | str | None = "auto"
    device: str | None = None
    host: str = "/device:CPU:0"
    policy: frozenset[str] = DEFAULT_POLICY
    on_budget_miss: str = "raise"
    knobs: Knobs = Knobs()
    offload: str | None = None
    devices: tuple[str, ...] | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> LMSConfig:
        # Only screens the keyword names: a knob, a call setting or a pass name gets a message saying
        # where it belongs instead of the dataclass's "unexpected keyword argument". __init__ is the
        # dataclass's.
        _refuse_misplaced(kwargs, kwargs.get("policy", DEFAULT_POLICY))
        return super().__new__(cls)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if not isinstance(self.offload, (str, type(None))) or self.offload not in OFFLOAD_VALUES:
            raise ValueError(f"offload must be None, 'optimizer' or 'weights'. {_received('offload', self.offload)}")
        set_(self, "device", _check_device("device", self.device, allow_none=True))
        set_(self, "host", _check_device("host", self.host, allow_none=False))
        if self.device is not None and devices.same_device(self.device, self.host):
            raise ValueError(
                "device and host must differ: tensors are swapped from device to host. "
                f"Received: device={self.device!r}, host={self.host!r}"
            )
        set_(self, "devices", check_devices(self.devices, host=self.host, device=self.device, offload=self.offload))
        if self.budget is not None and self.budget != "auto":
            set_(self, "budget", parse_bytes(self.budget, "budget"))
        set_(self, "policy", _check_policy(self.policy))
        if not isinstance(self.on_budget_miss, str) or self.on_budget_miss not in BUDGET_MISS_ACTIONS:
            raise ValueError(
                "on_budget_miss must be 'raise' (a BudgetError when no plan is predicted to fit the budget) or "
                f"'best' (a warning, and the lowest plan). {_received('on_budget_miss', self.on_budget_miss)}"
            )
        if not isinstance(self.knobs, Knobs):
            raise TypeError(f"knobs must be a tflms.Knobs. {_received('knobs', self.knobs)}")

    def replace(self, **changes: Any) -> LMSConfig:
        """A copy with ``changes``: option names, ``knobs`` among them (a knob's own name raises
        ``TypeError``; :meth:`with_knobs` changes knobs one by one).

        >>> LMSConfig().replace(budget="1GiB", knobs=Knobs(swapout_threshold=5)).knobs.swapout_threshold
        5
        """
        return LMSConfig.from_options(self, **changes)

    def with_knobs(self, **changes: Any) -> LMSConfig:
        """A copy whose knobs have ``changes`` (knob names); the other knobs are kept.

        >>> cfg = LMSConfig(knobs=Knobs(min_bytes=0)).with_knobs(swapout_threshold=5)
        >>> cfg.knobs.swapout_threshold, cfg.knobs.min_bytes
        (5, 0)
        """
        return dataclasses.replace(self, knobs=self.knobs.replace(**changes))

    @classmethod
    def from_options(cls, config: LMSConfig | None = None, **options: Any) -> LMSConfig:
        """Build a config from an optional base ``config`` and keyword overrides (option names;
        ``knobs`` replaces the base's knobs as a whole). Unknown names raise ``TypeError``, and so
        do a knob's name (write ``knobs=tflms.Knobs(name=value)``), a call setting of
        ``tflms.function`` and the pass names as booleans (options of older versions), saying which
        ``policy`` to write instead: ``recompute=True`` is ``policy=('recompute', 'swap_gradients')``
        from the default."""
        if config is not None and not isinstance(config, LMSConfig):
            raise TypeError(f"config must be a tflms.LMSConfig. Received: config={config!r}")
        base = config if config is not None else cls()
        if not options:
            return base
        _refuse_misplaced(options, options.get("policy", base.policy))
        return dataclasses.replace(base, **options)

    def to_dict(self) -> dict[str, Any]:
        """The options that make a plan, JSON-safe and flat: the user options, then the knobs."""
        data: dict[str, Any] = {
            "budget": self.budget,
            "device": self.device,
            "host": self.host,
            "policy": sorted(self.policy),
            "on_budget_miss": self.on_budget_miss,
            **({"offload": self.offload} if self.offload else {}),  # older plans' options have none
            **({"devices": list(self.devices)} if self.devices else {}),
        }
        for k, v in dataclasses.asdict(self.knobs).items():
            data[k] = list(v) if isinstance(v, tuple) else v
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LMSConfig:
        """Inverse of :meth:`to_dict`; also reads the flat options of older plans: the passes as
        booleans, without ``policy`` (no pass unless its boolean says so), and the call settings
        (:data:`CALL_SETTINGS`), which are left out."""
        options = {
            k: tuple(v) if isinstance(v, list) else v
            for k, v in data.items()
            if k not in POLICIES and k not in CALL_SETTINGS
        }
        passes = {k: v for k, v in data.items() if k in POLICIES}
        options["policy"] = _with_passes(options.get("policy", ()), passes)
        return cls.from_options(**keyword_options(options))


def _given(options: Mapping[str, Any], names: Iterable[str]) -> str:
    return ", ".join(f"{k}={options[k]!r}" for k in names)


def misplaced_options(options: Mapping[str, Any]) -> str | None:
    """The error message for knob names and call settings among keyword ``options`` (each belongs
    elsewhere: a knob in ``knobs=tflms.Knobs(...)``, a call setting in the call of
    ``tflms.function`` or ``tflms.LMSCallback``), or ``None`` where there are none.

    >>> print(misplaced_options({"budget": "1GiB", "swapout_threshold": 40}))
    swapout_threshold=40 is a knob, not an option: write knobs=tflms.Knobs(swapout_threshold=40).
    """
    knobs = [k for k in options if k in KNOB_NAMES]
    calls = [k for k in options if k in CALL_SETTINGS]
    parts = []
    if knobs:
        given = _given(options, knobs)
        what = "is a knob, not an option" if len(knobs) == 1 else "are knobs, not options"
        parts.append(f"{given} {what}: write knobs=tflms.Knobs({given}).")
    if calls:
        given = _given(options, calls)
        what = "is a setting" if len(calls) == 1 else "are settings"
        parts.append(
            f"{given} {what} of how a rewritten step is called, not an option of its plan: pass it to "
            f"tflms.function(step, {given}) or tflms.LMSCallback({given})."
        )
    return " ".join(parts) or None


def keyword_options(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments of ``tflms.function`` or ``tflms.LMSCallback`` from a flat mapping (a
    JSON-safe form, as the measuring jobs pass options between processes): option names and call
    settings are kept, knob names are gathered into ``knobs=Knobs(...)``.

    >>> kwargs = keyword_options({"budget": 1024, "min_bytes": 0, "layout_optimizer": True})
    >>> sorted(kwargs), kwargs["knobs"].min_bytes
    (['budget', 'knobs', 'layout_optimizer'], 0)
    """
    out = {k: v for k, v in flat.items() if k not in KNOB_NAMES}
    knobs = {k: tuple(v) if isinstance(v, list) else v for k, v in flat.items() if k in KNOB_NAMES}
    if knobs:
        out["knobs"] = out.get("knobs", Knobs()).replace(**knobs)
    return out


def _refuse_misplaced(options: Mapping[str, Any], policy: Any) -> None:
    """Raise ``TypeError`` for the names among keyword ``options`` that are not options: pass names
    as booleans (saying which ``policy`` to write, from ``policy``), knobs, call settings and
    unknown names (listing the options)."""
    passes = [k for k in POLICIES if k in options]
    if passes:
        raise TypeError(_pass_option_message(policy, options, passes))
    message = misplaced_options(options)
    if message is not None:
        raise TypeError(message)
    own = [f.name for f in dataclasses.fields(LMSConfig)]
    unknown = sorted(set(options) - set(own))
    if unknown:
        raise TypeError(
            f"Unknown LMS option(s): {', '.join(unknown)}. Options: {', '.join(sorted(own))}; the planner's "
            f"knobs (tflms.Knobs): {', '.join(KNOB_NAMES)}, given as knobs=tflms.Knobs(...). "
            f"Received: {_given(options, unknown)}"
        )


def resolve_swapout_window(config: LMSConfig, device: str | None) -> LMSConfig:
    """``config`` with ``swapout_window='auto'`` made concrete for the target ``device``:
    :data:`GPU_SWAPOUT_WINDOW` on a GPU, ``None`` (no fences) elsewhere or where ``device`` is
    ``None``. Any other value is kept.

    >>> resolve_swapout_window(LMSConfig(), "/device:GPU:0").knobs.swapout_window
    2
    >>> resolve_swapout_window(LMSConfig(), "/device:CPU:1").knobs.swapout_window is None
    True
    """
    if config.knobs.swapout_window != "auto":
        return config
    gpu = device is not None and devices.parse(device).type == "GPU"
    return config.with_knobs(swapout_window=GPU_SWAPOUT_WINDOW if gpu else None)


def resolve_budget(config: LMSConfig, limit: int | None, source: str) -> tuple[LMSConfig, str]:
    """``config`` with ``budget="auto"`` made concrete from the device's memory ``limit``
    (bytes, or ``None`` where none is known; ``source`` says where it was read), and the
    sentence that says which budget is used and why. Any other budget is kept.

    >>> cfg, why = resolve_budget(LMSConfig(), 1 << 30, "the test bed's cap")
    >>> cfg.budget, why
    (966367641, "budget 921.6 MiB = 966.4 MB: 0.9 x 1.0 GiB = 1.1 GB (the test bed's cap)")
    >>> resolve_budget(LMSConfig(), None, "no limit known for /device:CPU:1")[0].budget is None
    True
    """
    from ._util import format_sizes

    if config.budget != "auto":
        why = "no budget (budget=None)" if config.budget is None else f"budget {format_sizes(config.budget)} (given)"
        return config, why
    if limit is None:
        return config.replace(budget=None), f"no budget: {source}; every candidate is swapped (as budget=None)"
    budget = int(limit * AUTO_MARGIN)
    why = f"budget {format_sizes(budget)}: {AUTO_MARGIN} x {format_sizes(limit)} ({source})"
    return config.replace(budget=budget), why
