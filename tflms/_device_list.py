"""The ``devices=[...]`` option: the devices a placed step runs on, checked (no TensorFlow import).

>>> check_devices(["/device:GPU:0", "/gpu:1"], host="/device:CPU:0")
('/device:GPU:0', '/device:GPU:1')
>>> check_devices(["/device:GPU:0"], host="/device:CPU:0")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
ValueError: devices must list two or more devices ... Received: devices=['/device:GPU:0']
"""

from __future__ import annotations

from typing import Any

from ._devices import KNOWN_DEVICE_TYPES, canonical, device_key, parse

__all__ = ["check_devices"]

_HINT = "e.g. devices=['/device:GPU:0', '/device:GPU:1'] or job/task strings of a cluster"


def check_devices(
    value: Any, *, host: str, device: str | None = None, offload: str | None = None
) -> tuple[str, ...] | None:
    """The canonical device strings of ``devices`` (a list or tuple of two or more distinct device
    strings, none of them ``host``), or ``None`` for ``None``; raise ``ValueError`` naming the value
    received otherwise, and when combined with ``device`` (``devices[0]`` is the step's device) or
    ``offload`` (not combined with a placement)."""
    if value is None:
        return None
    received = f"Received: devices={value!r}"
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"devices must be a list of device strings, {_HINT}. {received}")
    if len(value) < 2:
        raise ValueError(
            "devices must list two or more devices to place the step on (one device: leave devices=None and "
            f"pass device=). {received}"
        )
    out = []
    for i, d in enumerate(value):
        try:
            spec = parse(d) if isinstance(d, str) else None
        except ValueError:
            spec = None
        if spec is None or spec.type not in KNOWN_DEVICE_TYPES or spec.index is None:
            raise ValueError(
                f"devices[{i}] is not a device string with a type ({', '.join(KNOWN_DEVICE_TYPES)}) and an index, "
                f"{_HINT}. {received}"
            )
        out.append(canonical(d))
    keys = [device_key(d) for d in out]
    dup = next((d for i, d in enumerate(out) if keys[i] in keys[:i]), None)
    if dup is not None:
        raise ValueError(f"devices must be distinct: {dup!r} is listed twice. {received}")
    if device_key(host) in keys:
        raise ValueError(
            f"devices must not list the host {host!r}: the host holds what no device does. Pass another host= or "
            f"other devices. {received}, host={host!r}"
        )
    if device is not None:
        raise ValueError(
            "device and devices cannot both be given: a placed step runs on devices, devices[0] holding the "
            f"variables and the step's arguments. Pass one of them. {received}, device={device!r}"
        )
    if offload is not None:
        raise ValueError(
            "offload cannot be combined with devices yet: a placed step keeps the optimizer beside the variables "
            f"on devices[0]. Pass offload=None or devices=None. {received}, offload={offload!r}"
        )
    return tuple(out)
