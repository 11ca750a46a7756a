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


def init() -> None:
    """Initialise Horovod (idempotent).

    Example:
        >>> import tflms.integrations.horovod as lms_hvd  # doctest: +SKIP
        >>> lms_hvd.init(); lms_hvd.rank(), lms_hvd.size()  # doctest: +SKIP
        (0, 2)
    """
    hvd = _import_hvd()
    if not hvd.is_initialized():
        hvd.init()


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
