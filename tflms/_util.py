"""Small helpers with no dependencies inside tflms: sizes as text, pausing the GC."""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["format_bytes", "format_sizes", "lazy_exports", "paused_gc"]


def format_bytes(n: float) -> str:
    """Human-readable binary size: ``format_bytes(3 * 2**20) == '3.0 MiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_sizes(n: int, exact: bool = False) -> str:
    """A byte count in binary and decimal units: ``format_sizes(16 * 10**9) == '14.9 GiB = 16.0 GB'``.

    Size strings keep both systems ("16GB" is 16 * 10**9 bytes, "16GiB" and "16G" are
    16 * 2**30), so messages show both; ``exact`` appends the byte count.
    """
    text = format_bytes(n)
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            text = f"{text} = {n / scale:.1f} {unit}"
            break
    return f"{text} = {n:,} bytes" if exact and n >= 1024 else text


@contextlib.contextmanager
def paused_gc() -> Any:
    """Pause Python's cyclic garbage collector for a pass.

    The pass allocates many small objects while TensorFlow's graph holds hundreds
    of thousands more; collections triggered mid-pass cost two thirds of its time.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def lazy_exports(
    package: str, exports: Mapping[str, str], namespace: dict[str, Any], submodules: bool = False
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package`` whose names in ``exports`` (name ->
    submodule) are imported on first use and then cached in ``namespace`` (its globals).
    With ``submodules``, any other public name that is a submodule is imported too."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            if submodules and not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}"):
                return importlib.import_module(f".{name}", package)
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
