"""Checks of option values, each raising ``ValueError`` that names the option and the value received
(:mod:`tflms.config` uses them, and re-exports :func:`parse_bytes` and :func:`check_int`)."""

from __future__ import annotations

import math
from typing import Any

from . import _devices as devices
from ._devices import KNOWN_DEVICE_TYPES

__all__ = ["parse_bytes", "check_int"]


def received(name: str, value: Any) -> str:
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
        raise ValueError(f"{name} must be a size. {hint} {received(name, value)}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{name} must be positive. {hint} {received(name, value)}")
        return value
    if isinstance(value, str):
        import re

        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
            if n > 0:
                return n
    raise ValueError(f"{name} is not a valid size. {hint} {received(name, value)}")


def check_int(name: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an int >= ``minimum`` (or allowed None)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        none = " or None" if allow_none else ""
        raise ValueError(f"{name} must be an integer >= {minimum}{none}. {received(name, value)}")


def check_bandwidth(name: str, value: Any) -> int:
    """Bytes per second from a positive number or a size string (``"25GB"``, ``"25GB/s"``)."""
    if isinstance(value, float) and math.isfinite(value) and value >= 1:
        return int(value)
    per_second = isinstance(value, str) and value.rstrip().lower().endswith("/s")
    try:
        return parse_bytes(value.rstrip()[:-2] if per_second else value, name)
    except ValueError:
        raise ValueError(
            f"{name} must be bytes per second: a positive number (25e9) or a size string ('25GB/s'). "
            f"{received(name, value)}"
        ) from None


def check_seconds(name: str, value: Any) -> float:
    """``value`` as a float number of seconds >= 0, or ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a number of seconds >= 0, e.g. 10e-6. {received(name, value)}")
    return float(value)


def check_device(name: str, value: Any, allow_none: bool) -> str | None:
    """Return the canonical form of a device string (:func:`tflms._devices.canonical`), or raise.

    Job, replica and task are kept: ``/job:worker/replica:0/task:0/device:CPU:0`` names a
    CPU in another process and is never taken for this process's ``/device:CPU:0``.
    """
    if value is None and allow_none:
        return None
    hint = "Use a string such as '/device:GPU:0', '/device:CPU:1' or '/job:worker/replica:0/task:0/device:CPU:0'."
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a device string. {hint} {received(name, value)}")
    try:
        spec = devices.parse(value)
    except ValueError:
        raise ValueError(f"{name} is not a device string. {hint} {received(name, value)}") from None
    if spec.type is None or spec.type not in KNOWN_DEVICE_TYPES:
        raise ValueError(
            f"{name} names an unknown device type {spec.type!r}; known types are "
            f"{', '.join(KNOWN_DEVICE_TYPES)}. {hint} {received(name, value)}"
        )
    if spec.index is None:
        raise ValueError(f"{name} must name one device, with an index. {hint} {received(name, value)}")
    return spec.to_string()
