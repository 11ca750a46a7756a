"""Which device tflms relieves, and what it reports of its memory.

* :func:`resolve_device`: the compute device of a config (an explicit one, the Horovod
  local-rank GPU, the first GPU, a Horovod rank's split CPU);
* :func:`device_memory` and :func:`device_memory_limit`: measured memory and the memory limit,
  where the device reports them (a GPU; the test bed's capped CPU allocator);
* :func:`check_host`: the host device exists.
"""

from __future__ import annotations

import os

import tensorflow as tf

from .. import _tf_internal as tfi
from .._devices import device_key
from ..config import LMSConfig

__all__ = ["check_host", "device_memory", "device_memory_limit", "no_device_message", "resolve_device"]


def resolve_device(config: LMSConfig) -> str | None:
    """The compute device LMS targets: ``config.device``, else the Horovod
    local-rank GPU when Horovod is initialised and several GPUs are visible, else
    the first GPU, else, on a Horovod rank whose CPU ``tflms.horovod.init(split_cpu=True)``
    split, ``'/device:CPU:1'``, else ``None``.

    An explicit device that does not exist raises ``ValueError``.
    """
    if config.device is not None:
        logical = tf.config.list_logical_devices()
        if device_key(config.device) not in {device_key(d.name) for d in logical}:
            raise ValueError(_missing_device_message("device", config.device, logical))
        return config.device
    gpus = tf.config.list_logical_devices("GPU")
    if not gpus:
        return _horovod_split_cpu_device()
    index = 0
    hvd_rank = _horovod_local_rank()
    if hvd_rank is not None and hvd_rank < len(gpus) and len(gpus) > 1:
        index = hvd_rank
    return f"/device:GPU:{index}"


def device_memory(device: str) -> dict[str, int] | None:
    """``tf.config.experimental.get_memory_info(device)``, or ``None`` where the device
    does not report memory: a CPU reports it only when its allocator is BFC
    (``TF_CPU_ALLOCATOR_USE_BFC=true`` set before TensorFlow started); otherwise TensorFlow
    answers zeros, which are not a measurement."""
    from .._devices import parse

    if parse(device).type == "CPU" and os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").lower() != "true":
        return None
    try:
        return dict(tf.config.experimental.get_memory_info(device))
    except (ValueError, tf.errors.InvalidArgumentError, tf.errors.UnimplementedError):
        return None


def device_memory_limit(device: str) -> tuple[int | None, str]:
    """The memory limit of ``device`` in bytes, and where it was read, for ``budget="auto"``.

    A GPU: its allocator's limit (a ``memory_limit`` you gave a logical GPU included). A CPU
    of this process whose allocator is BFC with a cap (``TF_CPU_ALLOCATOR_USE_BFC=true`` and
    ``TF_CPU_BFC_MEM_LIMIT_IN_MB``, as in the test bed's device process): that cap. Any other
    CPU: ``None`` (TensorFlow reports a nominal 256 MiB for it, which limits nothing).

    >>> device_memory_limit("/device:CPU:1")[0] is None  # no capped allocator in this process
    True
    """
    from .._devices import LOCAL_JOB, parse

    spec = parse(device)
    local = spec.job in (None, LOCAL_JOB)
    if spec.type == "CPU":
        cap = os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB", "")
        bfc = os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").lower() == "true"
        if local and bfc and cap.isdigit():
            return int(cap) << 20, f"the CPU allocator's cap, TF_CPU_BFC_MEM_LIMIT_IN_MB={cap}"
        return None, f"no memory limit is known for {device}"
    limit = tfi.allocator_limit(spec.type, spec.index or 0) if local else None
    if limit is None:
        return None, f"TensorFlow reports no memory limit for {device}"
    return limit, f"{device}'s allocator limit"


def check_host(config: LMSConfig) -> None:
    """Raise ``ValueError`` when ``config.host`` names no device TensorFlow knows."""
    logical = tf.config.list_logical_devices()
    if device_key(config.host) not in {device_key(d.name) for d in logical}:
        raise ValueError(_missing_device_message("host", config.host, logical))


def _missing_device_message(name: str, value: str, logical: list) -> str:
    names = ", ".join(sorted(d.name for d in logical))
    remote = not value.startswith(("/device:", "/job:localhost/"))
    if remote:
        hint = (
            "A device of another process appears only after connecting to it, e.g. "
            "tf.config.experimental_connect_to_cluster(cluster_spec, make_master_device_default=False) "
            "or tflms.testing.testbed.connect(worker)."
        )
    elif not tf.config.list_logical_devices("GPU"):
        hint = (
            "This machine has no GPU. To test on CPU, split the CPU into two logical devices before "
            "TensorFlow starts: tf.config.set_logical_device_configuration(tf.config.list_physical_devices"
            "('CPU')[0], [tf.config.LogicalDeviceConfiguration()] * 2), then pass device='/device:CPU:1'; "
            "to measure real memory use tflms.testing.testbed (see the README)."
        )
    else:
        hint = "Pass one of those, or device=None for the first GPU."
    return f"{name} {value!r} does not exist here (devices: {names}). {hint} Received: {name}={value!r}"


def _horovod_local_rank() -> int | None:
    from .horovod.runtime import loaded  # imports nothing of Horovod itself

    hvd = loaded()
    return None if hvd is None else int(hvd.local_rank())


def _horovod_split_cpu_device() -> str | None:
    from .horovod.runtime import split_cpu_device  # imports nothing of Horovod itself

    return split_cpu_device()


def no_device_message() -> str:
    """The warning of a step that runs unrewritten for want of a device."""
    from .horovod.runtime import loaded

    hint = (
        " Under Horovod, tflms.horovod.init(split_cpu=True), called first, does that on every rank."
        if loaded() is not None
        else ""
    )
    return (
        "tflms: no GPU found and no `device` given, so the step runs without swapping "
        "(the plan was still made: see get_plan). Run on a GPU machine, or pass device= "
        "e.g. '/device:CPU:1' after splitting the CPU into two logical devices for testing." + hint
    )
