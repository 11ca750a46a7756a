"""Device strings: the one parser tflms uses (no TensorFlow import).

A device string names a job, replica, task, device type and index, as in
``/job:worker/replica:0/task:0/device:CPU:0``. Parts left out refer to this
process: job ``localhost``, replica 0, task 0, which is what TensorFlow's eager
runtime calls the local task. So ``/device:CPU:0`` and
``/job:localhost/replica:0/task:0/device:CPU:0`` are the same device, and
``/job:worker/replica:0/task:0/device:CPU:0`` (a CPU in another process) is not.

>>> canonical("/device:gpu:0")
'/device:GPU:0'
>>> canonical("/job:worker/task:0/device:CPU:0")
'/job:worker/replica:0/task:0/device:CPU:0'
>>> same_device("/device:CPU:0", "/job:localhost/replica:0/task:0/device:CPU:0")
True
>>> same_device("/device:CPU:0", "/job:worker/replica:0/task:0/device:CPU:0")
False
"""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = ["DeviceName", "parse", "canonical", "device_key", "same_device", "LOCAL_JOB", "KNOWN_DEVICE_TYPES"]

#: The job name of this process's own devices in TensorFlow's eager runtime.
LOCAL_JOB = "localhost"

#: Device types a ``device``/``host`` option may name.
KNOWN_DEVICE_TYPES = ("CPU", "GPU", "TPU")

_PATTERN = re.compile(
    r"(?:/job:(?P<job>[A-Za-z0-9_\-]+))?"
    r"(?:/replica:(?P<replica>\d+))?"
    r"(?:/task:(?P<task>\d+))?"
    r"(?:/?(?:device:)?(?P<type>[A-Za-z_]+):(?P<index>\d+))?"
)


class DeviceName(NamedTuple):
    """A parsed device string; ``None`` for a part the string leaves out."""

    job: str | None
    replica: int | None
    task: int | None
    type: str | None
    index: int | None

    def to_string(self) -> str:
        """The canonical string: ``/device:TYPE:N`` for a local device given without job,
        else ``/job:J/replica:R/task:T/device:TYPE:N`` (missing replica/task become 0)."""
        dev = f"/device:{self.type}:{self.index}" if self.type is not None else ""
        if self.job is None and self.replica is None and self.task is None:
            return dev
        job = self.job or LOCAL_JOB
        return f"/job:{job}/replica:{self.replica or 0}/task:{self.task or 0}{dev}"


def parse(device: str) -> DeviceName:
    """Parse a device string (type upper-cased); raise ``ValueError`` if it is not one.

    >>> parse("/job:worker/replica:0/task:1/device:CPU:0")
    DeviceName(job='worker', replica=0, task=1, type='CPU', index=0)
    """
    m = _PATTERN.fullmatch(device.strip()) if isinstance(device, str) else None
    if m is None or not device.strip():
        raise ValueError(f"not a device string: {device!r}")
    g = m.groupdict()
    as_int = lambda v: None if v is None else int(v)  # noqa: E731
    return DeviceName(
        g["job"], as_int(g["replica"]), as_int(g["task"]), g["type"] and g["type"].upper(), as_int(g["index"])
    )


def canonical(device: str) -> str:
    """The canonical form of ``device`` (see :meth:`DeviceName.to_string`)."""
    return parse(device).to_string()


def device_key(device: str | None) -> tuple[str, int, int, str, int] | None:
    """A comparable key of one device: (job, replica, task, TYPE, index), local parts filled in.

    ``None`` for an empty string (an unplaced op) or a string that names no single device.
    """
    if not device:
        return None
    try:
        d = parse(device)
    except ValueError:
        return None
    if d.type is None or d.index is None:
        return None
    return (d.job or LOCAL_JOB, d.replica or 0, d.task or 0, d.type, d.index)


def same_device(a: str | None, b: str | None) -> bool:
    """True when ``a`` and ``b`` name the same device (both must name one)."""
    ka = device_key(a)
    return ka is not None and ka == device_key(b)
