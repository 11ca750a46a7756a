"""``SwapPlan``: the frozen, JSON-serialisable result of planning.

The planner and the rewriter meet only here. A plan can be printed
(:meth:`SwapPlan.summary`), saved and loaded (:meth:`SwapPlan.to_json`,
:meth:`SwapPlan.from_json`), edited by hand, compared against a golden, and
broadcast so that every Horovod rank applies the same plan.

JSON format (``format_version`` 1), a top-level object::

    {"format_version": 1, "function": "...", "options": {...LMSConfig...},
     "n_ops": 1234, "peak_bytes_before": ..., "peak_bytes_after": ...,
     "variable_bytes": ..., "reason": "",
     "swaps": [{"tensor": "conv1/Relu:0", "producer": "conv1/Relu",
                "producer_type": "Relu", "dtype": "float32", "shape": [8, 32, 32, 64],
                "bytes": 2097152, "level": 12, "distance": 57,
                "swap_ins": [{"consumers": [["gradient_tape/conv1/ReluGrad", 1]],
                              "trigger": "gradient_tape/conv2/...", "level": 69,
                              "trigger_level": 66}]}]}
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from ._util import format_bytes, format_sizes

if TYPE_CHECKING:
    from pathlib import Path

    from .graph import GraphModel

__all__ = ["SwapIn", "Swap", "SwapPlan", "FORMAT_VERSION", "format_bytes", "format_sizes", "link_seconds"]

FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class SwapIn:
    """One swap-in: the consumers it feeds and the op that triggers it.

    ``consumers`` are ``(op_name, input_index)`` pairs; ``level`` is the level of the
    first consumer; ``trigger`` is ``None`` when no suitable op exists (then the
    swap-in may run as soon as the swap-out has finished).
    """

    consumers: tuple[tuple[str, int], ...]
    trigger: str | None
    level: int
    trigger_level: int | None


@dataclasses.dataclass(frozen=True)
class Swap:
    """One swapped tensor: a swap-out to the host and one or more swap-ins."""

    tensor: str
    producer: str
    producer_type: str
    dtype: str
    shape: tuple[int | None, ...] | None
    bytes: int
    level: int
    distance: int
    swap_ins: tuple[SwapIn, ...]


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
    peaks (see :mod:`tflms.simulator`), variables included. ``reason`` explains an
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

    def _link(self) -> tuple[float, float]:
        """(bandwidth, latency) of the plan's options, their defaults where absent."""
        from .config import LINK_BANDWIDTH, LINK_LATENCY

        return self.options.get("link_bandwidth", LINK_BANDWIDTH), self.options.get("link_latency", LINK_LATENCY)

    def __len__(self) -> int:
        return len(self.swaps)

    # ---------------------------------------------------------------- plotting
    def with_model(self, model: GraphModel) -> SwapPlan:
        """This plan, remembering the graph model it was made from (for :meth:`plot`); returns ``self``.

        The model is not a field: not in the JSON, equality, hash or fingerprint.
        """
        object.__setattr__(self, "_model", model)
        return self

    @property
    def model(self) -> GraphModel | None:
        """The graph model the plan was made from, or ``None`` (loaded from JSON, built by hand)."""
        return getattr(self, "_model", None)

    def plot(self, path: str | Path, model: GraphModel | None = None, **kwargs: Any) -> Path:
        """Save the predicted memory timeline, before and after this plan, as a PNG.

        ``model`` defaults to the graph model the plan was made from; a plan loaded
        from JSON has none, so pass ``model=tflms.GraphModel.from_func_graph(cf.graph)``
        of the (not rewritten) traced step. ``kwargs`` go to :func:`tflms.plot_memory`.

        Example:
            >>> import tempfile, tensorflow as tf, tflms
            >>> from tflms.measure import build
            >>> model, x, y, train_step = build("cnn", batch=8, size=32)
            >>> cf = tf.function(train_step).get_concrete_function(x, y)
            >>> graph = tflms.GraphModel.from_func_graph(cf.graph)
            >>> plan = tflms.make_plan(graph, tflms.LMSConfig(swapout_threshold=20))
            >>> plan.plot(tempfile.mkdtemp() + "/memory.png").name
            'memory.png'
        """
        from .plot import plot_memory

        model = model if model is not None else self.model
        if model is None:
            raise ValueError(
                "This plan holds no graph model (it was loaded from JSON, built by hand, or made "
                "by tflms.optimize for an already rewritten function), so it "
                "cannot be simulated for plotting. Pass the traced step's graph model, e.g. "
                "plan.plot(path, model=tflms.GraphModel.from_func_graph(cf.graph, "
                f"batch_size={self.options.get('batch_size')!r})) where cf is the step's "
                "ConcreteFunction before tflms rewrote it. Received: model=None"
            )
        return plot_memory(model, self, path, **kwargs)

    # ------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["swaps"] = [dataclasses.asdict(s) for s in self.swaps]
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
        if version != FORMAT_VERSION:
            raise ValueError(
                f"Unsupported plan format_version; this tflms reads {FORMAT_VERSION}. "
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
                swap_ins=tuple(
                    SwapIn(
                        consumers=tuple((c[0], c[1]) for c in si["consumers"]),
                        trigger=si["trigger"],
                        level=si["level"],
                        trigger_level=si["trigger_level"],
                    )
                    for si in s["swap_ins"]
                ),
            )
            for s in d["swaps"]
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
            format_version=version,
        )

    @classmethod
    def from_json(cls, text: str) -> SwapPlan:
        return cls.from_dict(json.loads(text))

    # ---------------------------------------------------------------- printing
    def summary(self, max_rows: int | None = 50) -> str:
        """A table of the swaps plus the predicted peaks."""
        before, after = self.peak_bytes_before, self.peak_bytes_after
        saved = (1 - after / before) * 100 if before else 0.0
        lines = [
            f"tflms plan for {self.function or '<function>'}: {len(self.swaps)} tensors swapped "
            f"({format_bytes(self.swapped_bytes)} out, {self.n_swap_ins} swap-ins), {self.n_ops} ops",
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
        if self.reason:
            lines.append(f"note: {self.reason}")
        if not self.swaps:
            return "\n".join(lines)
        rows = [("tensor", "bytes", "distance", "consumers", "trigger")]
        shown = self.swaps if max_rows is None else self.swaps[:max_rows]
        for s in shown:
            for k, si in enumerate(s.swap_ins):
                rows.append(
                    (
                        s.tensor if k == 0 else "  ...",
                        format_bytes(s.bytes) if k == 0 else "",
                        str(si.level - s.level),
                        ", ".join(f"{c}:{i}" for c, i in si.consumers),
                        si.trigger or "-",
                    )
                )
        widths = [min(max(len(r[i]) for r in rows), 60) for i in range(5)]
        for r in rows:
            lines.append("  ".join(_clip(c, w).ljust(w) for c, w in zip(r, widths)).rstrip())
        if len(shown) < len(self.swaps):
            lines.append(f"... {len(self.swaps) - len(shown)} more swaps")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else "..." + text[-(width - 3) :]


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x
