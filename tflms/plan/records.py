"""``SwapPlan``: the frozen, JSON-serialisable result of planning.

The planner and the rewriter meet only here. A plan can be printed
(:meth:`SwapPlan.summary`), saved and loaded (:meth:`SwapPlan.to_json`,
:meth:`SwapPlan.from_json`), edited by hand, compared against a golden, and
broadcast so that every Horovod rank applies the same plan.
The decisions it holds (:class:`~tflms.ir.decisions.Swap`, :class:`~tflms.ir.decisions.Recompute`,
fences, orders, sums, placement stages) are the records of :mod:`tflms.ir.decisions`.

JSON format (``format_version`` 7; version 1, without ``recomputes``, version 2,
without ``fences``, version 3, without ``orders``, version 4, without ``sums``, version 5,
without ``tiles``, and version 6, without ``placement``, are still read), a top-level object::

    {"format_version": 7, "function": "...", "options": {...LMSConfig...},
     "n_ops": 1234, "peak_bytes_before": ..., "peak_bytes_after": ...,
     "variable_bytes": ..., "reason": "",
     "swaps": [{"tensor": "conv1/Relu:0", "producer": "conv1/Relu",
                "producer_type": "Relu", "dtype": "float32", "shape": [8, 32, 32, 64],
                "bytes": 2097152, "level": 12, "distance": 57,
                "swap_ins": [{"consumers": [["gradient_tape/conv1/ReluGrad", 1]],
                              "trigger": "gradient_tape/conv2/...", "level": 69,
                              "trigger_level": 66}]}],
     "recomputes": [{"tensor": "conv2/Relu:0", "producer": "conv2/Relu",
                     "ops": ["conv2/bn/mul_1", "conv2/bn/add_1", "conv2/Relu"],
                     "bytes": 2097152, "work_bytes": 14680064, "level": 20, "distance": 50,
                     "groups": [{"consumers": [["gradient_tape/conv3/Conv2DBackpropFilter", 0]],
                                 "trigger": "gradient_tape/conv3/...", "level": 70,
                                 "trigger_level": 69}]}],
     "fences": [{"tensor": "conv1/Relu:0", "op": "conv3/Conv2D"}],
     "orders": [{"op": "gradient_tape/bn0/mul", "after": "gradient_tape/bn3/Sum"}],
     "sums": [{"op": "AddN_12", "terms": ["gradient_tape/a/mul", "gradient_tape/b/mul",
                                          "gradient_tape/c/Sum"]}],
     "tiles": ["gradient_tape/bn/moments/Tile"],
     "placement": [{"device": "/device:GPU:0", "ops": ["conv1/Conv2D", ...], "peak_bytes": ...,
                    "compute_seconds": 0.01, "received_bytes": ...}, ...]}

A placement (``devices=[...]``, :mod:`tflms.plan.passes.place`) holds one stage per device: the ops
that run there (every op of the step is in one stage; the ops on variables are listed with the
variables' device, where TensorFlow's placer puts them) and what the simulator predicts for the
device. A plan without one (``placement`` empty; every plan before version 7) runs on one device.

A swap's consumer may be a recompute's clone (``tflms_recompute/<producer>/<group>/<op>``):
the recompute reads a swapped tensor. The rewrite applies the recomputes first.

A sum (``split_sums``) is an ``AddN`` of the backward pass that the rewrite replaces by a chain
of ``AddV2`` ops over ``terms`` (in Grappler's order), which adds each term as it arrives
(:mod:`tflms.plan.passes.sums`). The rewrite applies the sums first; the other decisions name the chain's ops.

A tile (``drop_tiles``) is a ``Tile`` op of the backward pass that the rewrite leaves out: the
element-wise ops that read its value are made again under ``<op>/tflms_bcast`` and broadcast the
``Tile``'s input (:mod:`tflms.plan.passes.tiles`). The rewrite applies the tiles after the sums and before
the other decisions, which name the ops made again.

A fence (``swapout_window``) is an ordering edge: ``op``, a forward op, starts only after
``tensor``'s swap-out has reached the host. An order is an ordering edge: ``op`` starts only
after ``after`` has run; ``serialize`` adds them within the backward pass, ``order_updates``
from the ops still reading a variable to that variable's in-place update (listed first).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from .._util import format_bytes, format_sizes
from ..ir.decisions import Fence, Order, Recompute, Stage, Sum, Swap, SwapIn

if TYPE_CHECKING:
    from ..ir.graph import GraphModel

__all__ = [
    "SwapPlan",
    "FORMAT_VERSION",
    "OP_LATENCY",
    "format_bytes",
    "format_sizes",
    "link_seconds",
    "recompute_seconds",
]

FORMAT_VERSION = 7
#: Plan format versions :meth:`SwapPlan.from_dict` reads (1: before recompute existed; 2: before fences;
#: 3: before orders; 4: before sums; 5: before tiles; 6: before placement).
READ_VERSIONS = (1, 2, 3, 4, 5, 6, 7)
#: Fixed cost of one recomputed op in seconds (a kernel launch), in the recompute cost model.
OP_LATENCY = 5e-6


def recompute_seconds(recomputes: Iterable[Recompute], device_bandwidth: float) -> float:
    """Predicted compute time the recomputes add per step: per group, ``OP_LATENCY`` per op
    plus ``work_bytes / device_bandwidth`` (element-wise ops are memory-bound).

    >>> r = Recompute("b:0", "b", ("a", "b"), 10**6, 4 * 10**6, 3, 40, (SwapIn((("g", 0),), "t", 43, 42),))
    >>> round(recompute_seconds([r], device_bandwidth=1e12), 6)  # 2 x 5 us + 4 us
    1.4e-05
    """
    return sum(len(r.groups) * (len(r.ops) * OP_LATENCY + r.work_bytes / device_bandwidth) for r in recomputes)


def link_seconds(swaps: Iterable[Swap], bandwidth: float, latency: float) -> float:
    """Predicted link time of ``swaps`` per step: ``latency + bytes / bandwidth`` per transfer.

    Every swap-out and every swap-in is one transfer.

    >>> s = Swap("a:0", "a", "Relu", "float32", (1000, 250), 10**6, 3, 40, (SwapIn((("g", 0),), "t", 43, 41),) * 2)
    >>> round(link_seconds([s], bandwidth=1e9, latency=1e-5), 6)  # 3 transfers of 1 ms + 10 us
    0.00303
    """
    return sum((1 + len(s.swap_ins)) * (latency + s.bytes / bandwidth) for s in swaps)


@dataclasses.dataclass(frozen=True)
class SwapPlan:
    """Which tensors to swap, where their copies come back, and what that buys.

    ``peak_bytes_before``/``peak_bytes_after`` are the simulator's predicted device
    peaks (see :mod:`tflms.emulate.simulator`), variables included. ``reason`` explains an
    empty plan.

    A plan made in this process (:func:`tflms.make_plan`, :func:`tflms.optimize`,
    ``tflms.function``, ``LMSCallback``) also holds the :class:`~tflms.GraphModel` it
    was made from, for :meth:`plot`. That reference is not a field: it is not in the
    JSON, equality or the fingerprint; a plan loaded from JSON or copied with
    ``dataclasses.replace`` has none.
    """

    function: str
    options: Mapping[str, Any]
    swaps: tuple[Swap, ...]
    n_ops: int
    peak_bytes_before: int
    peak_bytes_after: int
    variable_bytes: int
    reason: str = ""
    format_version: int = FORMAT_VERSION
    recomputes: tuple[Recompute, ...] = ()
    fences: tuple[Fence, ...] = ()
    orders: tuple[Order, ...] = ()
    sums: tuple[Sum, ...] = ()
    tiles: tuple[str, ...] = ()
    placement: tuple[Stage, ...] = ()

    def __post_init__(self) -> None:
        # Frozen means frozen: the options are a read-only view of a private copy.
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))

    def __hash__(self) -> int:
        return hash(self.fingerprint())

    def __reduce__(self) -> tuple:
        return (SwapPlan.from_dict, (self.to_dict(),))

    # ------------------------------------------------------------- derived facts
    @property
    def swapped_bytes(self) -> int:
        """Bytes moved to the host per step (each swap-out once)."""
        return sum(s.bytes for s in self.swaps)

    @property
    def n_swap_ins(self) -> int:
        return sum(len(s.swap_ins) for s in self.swaps)

    @property
    def link_seconds(self) -> float:
        """Predicted time the swaps keep the device-host link busy per step (seconds).

        :func:`link_seconds` at the plan's ``link_bandwidth`` and ``link_latency`` options
        (their defaults for a plan saved before those options existed). While the step
        waits for a swap-in, the link is busy, in one direction or the other, with that
        swap-in, its swap-out or transfers queued before them, so this bounds the time
        the transfers add to a step, as long as they do not take processors from the
        compute (on a GPU copies run on copy engines; on the CPU test bed they compete
        for the same cores, so the bound does not apply there).
        """
        return link_seconds(self.swaps, *self._link())

    @property
    def recompute_seconds(self) -> float:
        """Predicted compute time the recomputes add per step (seconds): :func:`recompute_seconds`
        at the plan's ``device_bandwidth`` option."""
        from ..config import DEVICE_BANDWIDTH

        return recompute_seconds(self.recomputes, self.options.get("device_bandwidth", DEVICE_BANDWIDTH))

    @property
    def step_seconds(self) -> float:
        """Predicted time the plan adds to a step, at most: :attr:`link_seconds` + :attr:`recompute_seconds`."""
        return self.link_seconds + self.recompute_seconds

    @property
    def placement_seconds(self) -> float:
        """Predicted step time of the placement (seconds; 0 without one): every device's compute, the
        stages running one after another (no micro-batches), plus the bytes the devices receive at the
        plan's ``link_bandwidth``."""
        if not self.placement:
            return 0.0
        bandwidth, _ = self._link()
        return sum(st.compute_seconds + st.received_bytes / bandwidth for st in self.placement)

    @property
    def recomputed_bytes(self) -> int:
        """Bytes of the tensors recomputed instead of kept or swapped."""
        return sum(r.bytes for r in self.recomputes)

    def _link(self) -> tuple[float, float]:
        """(bandwidth, latency) of the plan's options, their defaults where absent."""
        from ..config import LINK_BANDWIDTH, LINK_LATENCY

        return self.options.get("link_bandwidth", LINK_BANDWIDTH), self.options.get("link_latency", LINK_LATENCY)

    def __len__(self) -> int:
        """Number of decisions: swapped plus recomputed tensors."""
        return len(self.swaps) + len(self.recomputes)

    # ---------------------------------------------------------------- plotting
    def with_model(self, model: GraphModel) -> SwapPlan:
        """This plan, remembering the graph model it was made from (for :meth:`plot`); returns ``self``.

        The model is not a field: not in the JSON, equality, hash or fingerprint.
        """
        object.__setattr__(self, "_model", model)
        return self

    def with_budget_text(self, text: str) -> SwapPlan:
        """This plan, holding the sentence that says which budget it was made for and where
        that budget came from (``budget="auto"``); like the model, not a field.
        Returns the plan itself."""
        object.__setattr__(self, "_budget_text", text)
        return self

    @property
    def budget_text(self) -> str:
        """Which budget the plan was made for and where it came from; ``''`` if not known."""
        return getattr(self, "_budget_text", "")

    @property
    def model(self) -> GraphModel | None:
        """The graph model the plan was made from, or ``None`` (loaded from JSON, built by hand)."""
        return getattr(self, "_model", None)

    # ------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["swaps"] = [dataclasses.asdict(s) for s in self.swaps]
        d["recomputes"] = [dataclasses.asdict(r) for r in self.recomputes]
        d["fences"] = [dataclasses.asdict(f) for f in self.fences]
        d["orders"] = [dataclasses.asdict(o) for o in self.orders]
        d["sums"] = [dataclasses.asdict(x) for x in self.sums]
        d["tiles"] = list(self.tiles)
        d["placement"] = [dataclasses.asdict(st) for st in self.placement]
        d["options"] = dict(self.options)
        return _jsonable(d)

    def to_json(self, indent: int | None = 2) -> str:
        """Deterministic JSON: same plan, same bytes."""
        return json.dumps(self.to_dict(), sort_keys=True, indent=indent)

    def fingerprint(self) -> str:
        """SHA-256 of the compact JSON; equal on every rank that planned the same."""
        return hashlib.sha256(self.to_json(indent=None).encode()).hexdigest()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SwapPlan:
        version = d.get("format_version")
        if version not in READ_VERSIONS:
            raise ValueError(
                f"Unsupported plan format_version; this tflms reads {' and '.join(map(str, READ_VERSIONS))}. "
                f"Received: format_version={version!r}"
            )
        missing = [k for k in ("swaps", "peak_bytes_before", "peak_bytes_after", "options") if k not in d]
        if missing:
            raise ValueError(f"Plan JSON lacks required keys: {', '.join(missing)}.")
        swaps = tuple(
            Swap(
                tensor=s["tensor"],
                producer=s["producer"],
                producer_type=s["producer_type"],
                dtype=s["dtype"],
                shape=None if s["shape"] is None else tuple(s["shape"]),
                bytes=s["bytes"],
                level=s["level"],
                distance=s["distance"],
                swap_ins=tuple(_swap_in(si) for si in s["swap_ins"]),
            )
            for s in d["swaps"]
        )
        recomputes = tuple(
            Recompute(
                tensor=r["tensor"],
                producer=r["producer"],
                ops=tuple(r["ops"]),
                bytes=r["bytes"],
                work_bytes=r["work_bytes"],
                level=r["level"],
                distance=r["distance"],
                groups=tuple(_swap_in(g) for g in r["groups"]),
            )
            for r in d.get("recomputes", ())
        )
        return cls(
            function=d.get("function", ""),
            options=dict(d["options"]),
            swaps=swaps,
            n_ops=d.get("n_ops", 0),
            peak_bytes_before=d["peak_bytes_before"],
            peak_bytes_after=d["peak_bytes_after"],
            variable_bytes=d.get("variable_bytes", 0),
            reason=d.get("reason", ""),
            recomputes=recomputes,
            fences=tuple(Fence(tensor=f["tensor"], op=f["op"]) for f in d.get("fences", ())),
            orders=tuple(Order(op=o["op"], after=o["after"]) for o in d.get("orders", ())),
            sums=tuple(Sum(op=x["op"], terms=tuple(x["terms"])) for x in d.get("sums", ())),
            tiles=tuple(d.get("tiles", ())),
            placement=tuple(
                Stage(st["device"], tuple(st["ops"]), st["peak_bytes"], st["compute_seconds"], st["received_bytes"])
                for st in d.get("placement", ())
            ),
        )

    @classmethod
    def from_json(cls, text: str) -> SwapPlan:
        return cls.from_dict(json.loads(text))

    # ---------------------------------------------------------------- printing
    def summary(self, max_rows: int | None = 50) -> str:
        """A table of the swaps (and recomputes) plus the predicted peaks and time."""
        lines = [*self._summary_head(), *self._summary_passes(), *self._summary_placement()]
        if self.budget_text:
            lines.append(f"budget: {self.budget_text}")
        if self.reason:
            lines.append(f"note: {self.reason}")
        if self.swaps or self.recomputes:
            lines += self._summary_table(max_rows)
        return "\n".join(lines)

    def _summary_head(self) -> list[str]:
        """The summary's first lines: what is swapped and recomputed, the peaks, the link and recompute times."""
        before, after = self.peak_bytes_before, self.peak_bytes_after
        saved = (1 - after / before) * 100 if before else 0.0
        recomputed = (
            f", {len(self.recomputes)} recomputed ({format_bytes(self.recomputed_bytes)})" if self.recomputes else ""
        )
        lines = [
            f"tflms plan for {self.function or '<function>'}: {len(self.swaps)} tensors swapped "
            f"({format_bytes(self.swapped_bytes)} out, {self.n_swap_ins} swap-ins){recomputed}, {self.n_ops} ops",
            f"predicted device peak (simulator): {format_bytes(before)} -> {format_bytes(after)} "
            f"({abs(saved):.1f}% {'less' if saved >= 0 else 'more'}; variables {format_bytes(self.variable_bytes)})",
        ]
        if self.swaps:
            bandwidth, latency = self._link()
            lines.append(
                f"predicted link time per step: {self.link_seconds * 1e3:.2f} ms at {bandwidth / 1e9:g} GB/s and "
                f"{latency * 1e6:g} us per transfer (at most what the transfers add to a step, when they do "
                "not compete with compute)"
            )
        if self.recomputes:
            from ..config import DEVICE_BANDWIDTH

            bandwidth = self.options.get("device_bandwidth", DEVICE_BANDWIDTH)
            lines.append(
                f"predicted recompute time per step: {self.recompute_seconds * 1e3:.2f} ms at {bandwidth / 1e9:g} GB/s "
                f"of device memory and {OP_LATENCY * 1e6:g} us per op"
            )
        return lines

    def _summary_passes(self) -> list[str]:
        """A line for each of the fences, ordering edges, split sums and left-out tiles the plan has."""
        lines = []
        if self.fences:
            window = self.options.get("swapout_window")
            lines.append(
                f"swap-out fences: {len(self.fences)} (a forward op waits until the swap-out {window} swaps "
                "before it has reached the host)"
            )
        if self.orders:
            lines.append(
                f"memory-aware schedule: {len(self.orders)} ordering edge{'s' * (len(self.orders) != 1)} "
                "(an op waits for another: a backward op for another branch's, so that two branches do not "
                "hold their buffers at once, or a variable's update for the ops still reading the variable, so "
                "that it is not copied)"
            )
        if self.sums:
            terms = sum(len(x.terms) for x in self.sums)
            lines.append(
                f"sums added as their terms arrive: {len(self.sums)} AddN ops ({terms} terms) split into AddV2 chains"
            )
        if self.tiles:
            lines.append(
                f"tiles left out: {len(self.tiles)} Tile/BroadcastTo ops of the backward pass, their values broadcast "
                "by the ops that read them"
            )
        return lines

    def _summary_placement(self) -> list[str]:
        """The placement's lines: one a device, then the predicted step time (none without a placement)."""
        if not self.placement:
            return []
        lines = [
            f"placement on {len(self.placement)} devices (predicted per device: peak, compute, received per step):"
        ]
        for st in self.placement:
            lines.append(
                f"  {st.device}: {len(st.ops)} ops, peak {format_bytes(st.peak_bytes)}, "
                f"{st.compute_seconds * 1e3:.2f} ms, receives {format_bytes(st.received_bytes)}"
            )
        bandwidth, _ = self._link()
        seconds = self.placement_seconds
        lines.append(
            f"  predicted step time {seconds * 1e3:.2f} ms: the stages one after another (no micro-batches), "
            f"transfers at {bandwidth / 1e9:g} GB/s"
        )
        return lines

    def _summary_table(self, max_rows: int | None) -> list[str]:
        """The table of the swaps and recomputes, a row a swap-in, at most ``max_rows`` decisions."""
        rows = [("tensor", "how", "bytes", "distance", "consumers", "trigger")]
        decisions = [("swap", s.tensor, s.bytes, s.level, s.swap_ins) for s in self.swaps]
        decisions += [(f"recompute {len(r.ops)} ops", r.tensor, r.bytes, r.level, r.groups) for r in self.recomputes]
        shown = decisions if max_rows is None else decisions[:max_rows]
        for how, tensor, nbytes, level, groups in shown:
            for k, si in enumerate(groups):
                rows.append(
                    (
                        tensor if k == 0 else "  ...",
                        how if k == 0 else "",
                        format_bytes(nbytes) if k == 0 else "",
                        str(si.level - level),
                        ", ".join(f"{c}:{i}" for c, i in si.consumers),
                        si.trigger or "-",
                    )
                )
        widths = [min(max(len(r[i]) for r in rows), 60) for i in range(len(rows[0]))]
        lines = ["  ".join(_clip(c, w).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        if len(shown) < len(decisions):
            lines.append(f"... {len(decisions) - len(shown)} more rows")
        return lines

    def __str__(self) -> str:
        return self.summary()


def _swap_in(si: Mapping[str, Any]) -> SwapIn:
    return SwapIn(
        consumers=tuple((c[0], c[1]) for c in si["consumers"]),
        trigger=si["trigger"],
        level=si["level"],
        trigger_level=si["trigger_level"],
    )


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else "..." + text[-(width - 3) :]


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x
