"""Access to Horovod and the rank helpers of :mod:`tflms.integrations.horovod`.

Horovod is imported lazily: :func:`loaded` (the one place that decides whether
Horovod is running in this process) never imports it, only :func:`init` does.
"""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["active", "init", "is_initialized", "is_root", "loaded", "local_rank", "local_size", "rank", "size"]

#: Environment variable that ``horovodrun`` sets for every rank it starts.
LAUNCHER_ENV = "HOROVOD_RANK"


def _import_hvd() -> Any:
    """``horovod.tensorflow``, imported on first use."""
    try:
        import horovod.tensorflow as hvd
    except ImportError as err:
        raise ImportError(
            "tflms.integrations.horovod needs Horovod with TensorFlow support, which is not importable "
            f"({err}). Build and install it with `python -m tflms.tools.build_horovod`."
        ) from err
    return hvd


def loaded() -> Any | None:
    """``horovod.tensorflow`` if it is imported and initialised, else ``None`` (imports nothing).

    The one test of "is Horovod running here" in tflms; a half-loaded Horovod counts as not initialised.
    """
    hvd = sys.modules.get("horovod.tensorflow")
    if hvd is None:
        return None
    try:
        return hvd if hvd.is_initialized() else None
    except Exception:  # noqa: BLE001 - half-loaded library: treat as not initialised
        return None


def active(what: str) -> Any | None:
    """Initialised ``horovod.tensorflow``; ``None`` in a single process without Horovod.

    Under ``horovodrun`` (:data:`LAUNCHER_ENV` set) without :func:`init`, raise
    ``RuntimeError`` naming ``what`` rather than let every rank act alone.
    """
    hvd = loaded()
    if hvd is None and LAUNCHER_ENV in os.environ:
        raise RuntimeError(
            f"tflms.integrations.horovod.{what}: this process was started by horovodrun "
            f"({LAUNCHER_ENV}={os.environ[LAUNCHER_ENV]}) but Horovod is not initialised, so every "
            "rank would act alone. Call tflms.integrations.horovod.init() first."
        )
    return hvd


#: The compute device and host of a rank whose CPU :func:`init` split (``split_cpu=True``).
CPU_DEVICE, CPU_HOST = "/device:CPU:1", "/device:CPU:0"

#: Set by ``init(split_cpu=True)`` on a rank without GPU: the device tflms swaps from by default.
_split_cpu_device: str | None = None


def init(*, split_cpu: bool = False) -> None:
    """Initialise Horovod (idempotent).

    ``split_cpu=True`` lets a job swap on a machine without GPU, to try or test it:
    where this rank sees no GPU, the CPU is split into two logical devices first,
    ``/device:CPU:1`` playing the GPU and ``/device:CPU:0`` the host, and tflms steps
    and callbacks with ``device=None`` then swap from ``/device:CPU:1`` to the default
    host ``/device:CPU:0`` (:func:`tflms.integrations.function.resolve_device`), as with ``device='/device:CPU:1'``.
    The two logical CPUs share one allocator, so this shows the numbers and the
    rewritten graphs of a swapping job, not its memory (for that see
    ``tflms.testbed``). Where the rank sees a GPU, it changes nothing: ``device=None``
    is the local-rank GPU. Call it before anything else uses TensorFlow's devices.

    Raises:
        TypeError: ``split_cpu`` is not a bool.
        RuntimeError: ``split_cpu=True`` without GPU after TensorFlow initialised its
            devices with a single CPU (too late to split it).

    Example (``horovodrun --gloo -np 2 -H localhost:2 python train.py`` on a machine without GPU)::

        import tflms, tflms.horovod as lms_hvd
        lms_hvd.init(split_cpu=True)  # first
        # swaps /device:CPU:1 -> /device:CPU:0
        lms = lms_hvd.HorovodLMSCallback(knobs=tflms.Knobs(swapout_threshold=40))
    """
    global _split_cpu_device
    if not isinstance(split_cpu, bool):
        raise TypeError(
            "split_cpu must be True (without GPU, split the CPU in two so that tflms swaps from "
            f"{CPU_DEVICE} to {CPU_HOST}) or False. Received: split_cpu={split_cpu!r}"
        )
    if split_cpu:
        _split_cpu_device = _split_cpu()
    hvd = _import_hvd()
    if not hvd.is_initialized():
        hvd.init()


def _split_cpu() -> str | None:
    """Split the CPU into two logical devices where there is no GPU: the device to swap from, or None."""
    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        return None
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    except RuntimeError:  # TensorFlow's devices exist already: fine if the CPU was split before
        names = sorted(d.name for d in tf.config.list_logical_devices("CPU"))
        if len(names) < 2:
            raise RuntimeError(
                "tflms.horovod.init(split_cpu=True) must run before TensorFlow initialises its devices "
                "(before the first tensor, model or tf.config.list_logical_devices call): it splits the CPU "
                f"into {CPU_HOST} and {CPU_DEVICE}. Call it first in the script, or split the CPU yourself and "
                f"pass device='{CPU_DEVICE}'. Received: split_cpu=True with the devices already initialised "
                f"({', '.join(names)})"
            ) from None
    return CPU_DEVICE


def split_cpu_device() -> str | None:
    """The device tflms swaps from by default on this rank after ``init(split_cpu=True)``
    without GPU (``'/device:CPU:1'``); ``None`` otherwise or while Horovod is not initialised."""
    return _split_cpu_device if loaded() is not None else None


def is_initialized() -> bool:
    """True when ``horovod.tensorflow`` is imported and initialised (never imports it)."""
    return loaded() is not None


def _query(name: str, single: int) -> int:
    hvd = active(f"{name}()")
    return single if hvd is None else int(getattr(hvd, name)())


def rank() -> int:
    """Global rank; 0 in a single process without Horovod.

    Raises ``RuntimeError`` under ``horovodrun`` before :func:`init`, instead of
    letting every rank believe it is rank 0.

    Example (in one process; under ``horovodrun`` after :func:`init`, 0 to ``size() - 1``):
        >>> import tflms.integrations.horovod as lms_hvd
        >>> lms_hvd.rank()
        0
    """
    return _query("rank", 0)


def size() -> int:
    """Number of ranks; 1 in a single process without Horovod.

    Example (in one process; under ``horovodrun -np 2``, 2):
        >>> import tflms.integrations.horovod as lms_hvd
        >>> per_rank_batch = 32
        >>> per_rank_batch * lms_hvd.size()  # the global batch
        32
    """
    return _query("size", 1)


def local_rank() -> int:
    """Rank on this machine (the GPU index tflms uses); 0 without Horovod.

    Example (in one process):
        >>> import tflms.integrations.horovod as lms_hvd
        >>> lms_hvd.local_rank()
        0
    """
    return _query("local_rank", 0)


def local_size() -> int:
    """Number of ranks on this machine; 1 without Horovod.

    Example (in one process; with 2 ranks on this machine, 2):
        >>> import tflms.integrations.horovod as lms_hvd
        >>> lms_hvd.local_size()
        1
    """
    return _query("local_size", 1)


def is_root() -> bool:
    """True on rank 0 (and in a single process): the rank that prints and saves.

    Example (in one process, the only rank is the root):
        >>> import tflms.integrations.horovod as lms_hvd
        >>> images_per_s = 25.08
        >>> if lms_hvd.is_root():
        ...     print(f"{images_per_s:.1f} images/s")
        25.1 images/s
    """
    return rank() == 0
