"""Measure the device-host link on the path swaps take: bandwidth each way, latency per transfer.

A swap is an in-graph copy between the device and the host device: TensorFlow's partitioner
turns it into a send and a receive. :func:`probe_link` times ``tf.function`` copies of that
kind, each way, for a few sizes, and fits ``seconds = latency + bytes / bandwidth`` (least
squares over the sizes; each time the median of ``repeats`` calls, less the time of the same
call without a transfer). The result is kept per device pair in this process and, with
``cache_dir`` (default ``~/.cache/tflms``, or ``$TFLMS_CACHE_DIR``), in ``link.json`` there,
keyed by the machine's name and the device pair.

Between two logical CPUs of one process a copy shares its buffer and moves nothing: the
fitted bandwidth may then be ``inf`` (a time that does not grow with the size). On the test
bed (:mod:`tflms.testing.testbed`) the copy crosses gRPC; on a GPU, PCIe or NVLink.

Example::

    >>> probe = probe_link("/device:CPU:0", "/device:CPU:1", sizes=(1 << 10, 1 << 20), repeats=3, cache_dir=None)
    >>> probe.latency >= 0 and probe.to_host > 0 and probe.to_device > 0
    True
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..config import check_int
from ..emulate.timeline import Link

__all__ = ["LinkProbe", "probe_link", "fit_link", "SIZES"]

#: Transfer sizes the probe times, bytes: 4 KiB to 64 MiB.
SIZES = (1 << 12, 1 << 20, 1 << 24, 1 << 26)

_probes: dict[tuple[str, str], LinkProbe] = {}


@dataclasses.dataclass(frozen=True)
class LinkProbe:
    """A measured link: ``to_host``/``to_device`` in bytes per second, ``latency`` in seconds per
    transfer (the mean of both directions' fits), and the raw ``samples``: per direction,
    ``[[bytes, seconds], ...]``."""

    device: str
    host: str
    to_host: float
    to_device: float
    latency: float
    samples: dict[str, list[list[float]]] = dataclasses.field(default_factory=dict)

    @property
    def link(self) -> Link:
        """The link for :mod:`tflms.emulate.timeline`."""
        return Link(self.to_host, self.to_device, self.latency)

    def knobs(self) -> dict[str, Any]:
        """``link_bandwidth`` (the slower direction, finite) and ``link_latency`` for :class:`tflms.Knobs`."""
        slower = min(self.to_host, self.to_device)
        return {"link_bandwidth": int(min(slower, 1e15)), "link_latency": float(self.latency)}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def fit_link(samples: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(bandwidth, latency)`` of ``seconds = latency + bytes / bandwidth`` fitted to
    ``(bytes, seconds)`` samples by least squares; a slope <= 0 gives ``inf`` bandwidth, and a
    negative intercept latency 0.

    >>> fit_link([(0, 1e-5), (10**9, 1e-5 + 0.04)])  # 25 GB/s, 10 us
    (25000000000.0, 1e-05)
    """
    xs = [float(b) for b, _ in samples]
    ys = [float(s) for _, s in samples]
    if len(xs) < 2 or len(set(xs)) < 2:
        raise ValueError(f"fit_link needs samples of at least two sizes. Received: samples={list(samples)!r}")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    latency = max(0.0, my - slope * mx)
    bandwidth = math.inf if slope <= 0 else 1.0 / slope
    return round(bandwidth, 3) if math.isfinite(bandwidth) else bandwidth, round(latency, 12)


def _cache_path(cache_dir: str | os.PathLike | None) -> Path | None:
    if cache_dir is None:
        return None
    return Path(cache_dir).expanduser() / "link.json"


def _default_cache_dir() -> str:
    return os.environ.get("TFLMS_CACHE_DIR", "~/.cache/tflms")


def probe_link(
    device: str,
    host: str = "/device:CPU:0",
    *,
    sizes: Sequence[int] = SIZES,
    repeats: int = 5,
    cache_dir: str | os.PathLike | None = "default",
    refresh: bool = False,
) -> LinkProbe:
    """Measure the link between ``device`` and ``host`` (module doc); cached per device pair.

    ``cache_dir``: where ``link.json`` is kept (``'default'``: ``$TFLMS_CACHE_DIR`` or
    ``~/.cache/tflms``; ``None``: this process only). ``refresh``: measure again."""
    import tensorflow as tf

    check_int("repeats", repeats, 1)
    if len(set(sizes)) < 2 or not all(isinstance(s, int) and s >= 4 for s in sizes):
        raise ValueError(f"sizes must hold at least two different byte counts >= 4. Received: sizes={tuple(sizes)!r}")
    key = (device, host)
    path = _cache_path(_default_cache_dir() if cache_dir == "default" else cache_dir)
    disk_key = f"{socket.gethostname()} {device} -> {host}"
    if not refresh:
        if key in _probes:
            return _probes[key]
        if path is not None and path.is_file():
            try:
                stored = json.loads(path.read_text()).get(disk_key)
            except (OSError, ValueError):
                stored = None
            if stored:
                _probes[key] = LinkProbe(**stored)
                return _probes[key]

    sync = tf.test.experimental.sync_devices  # a GPU's copies are asynchronous: wait for them

    def timed(fn: Any, x: Any) -> float:
        fn(x)  # traces and instantiates
        sync()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(x)
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def copy_to(target: str) -> Any:
        @tf.function
        def copy(x: Any) -> Any:
            with tf.device(target):
                return tf.identity(x)

        return copy

    samples: dict[str, list[list[float]]] = {}
    fits = {}
    for direction, source, target in (("to_host", device, host), ("to_device", host, device)):
        rows = []
        for n in sizes:
            with tf.device(source):
                x = tf.zeros([n // 4], tf.float32)
            baseline = timed(copy_to(source), x)
            moved = timed(copy_to(target), x)
            rows.append([float(n), max(0.0, moved - baseline)])
        samples[direction] = rows
        fits[direction] = fit_link([(b, s) for b, s in rows])
    probe = LinkProbe(
        device=device,
        host=host,
        to_host=fits["to_host"][0],
        to_device=fits["to_device"][0],
        latency=(fits["to_host"][1] + fits["to_device"][1]) / 2,
        samples=samples,
    )
    _probes[key] = probe
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            data = json.loads(path.read_text()) if path.is_file() else {}
            data[disk_key] = probe.to_dict()
            path.write_text(json.dumps(data, indent=1) + "\n")
        except (OSError, ValueError):
            pass  # a cache that cannot be written is no error: the probe stays in this process
    return probe
