"""``tflms demo`` (what ``make run`` runs): the plain step runs out of memory, tflms trains.

The device's memory is measured, each run in a fresh process (:func:`tflms.testing.measure.measure`).
Without a GPU the demo uses the real-memory test bed (:mod:`tflms.testing.testbed`): the
device is a measured process's CPU, the host a second TensorFlow process. With a GPU
the device is GPU 0 and the host the CPU, and a cap is a real limit of TensorFlow's GPU
allocator (a logical device with ``memory_limit``).

1. The plain step of ResNet50 (``--image-size``, ``--batch``) is measured without a cap.
2. A real cap is set below that peak (``--cap``, default 75 % of it): the plain step
   runs out of memory under it (its process is reported, not crashed into).
3. Under the same cap, the step autotuned by tflms (with :data:`DEMO_OPTIONS`) to a budget
   below the cap (``--budget``, default ``0.85 * cap``) trains.

Each measured peak is printed next to the simulator's prediction.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .measured import MeasuredResult

__all__ = ["run_demo", "CAP_FRACTION", "BUDGET_FRACTION", "DEMO_OPTIONS", "WARMUP"]

#: Default cap on the test bed, as a fraction of the plain step's measured peak.
CAP_FRACTION = 0.75
#: The autotuner's budget as a fraction of the cap: room for the simulator's error and for the
#: allocator's holes (a measured peak can exceed its prediction by about 10 %, and a fragmented
#: pool can fail a request with less than the cap in use).
BUDGET_FRACTION = 0.85
#: tflms options of the demo's step, besides the budget: the memory-aware schedule (ordering
#: edges; docs/passes.md, "Memory-aware schedule"). It is the default; named here so that the demo
#: prints it.
DEMO_OPTIONS = {"serialize": True}
#: Steps each run trains before the ``--steps`` it measures: a function's first call also
#: instantiates it, so its peak is not counted (:func:`tflms.testing.measure.measure_step`).
WARMUP = 1


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo with the CLI's arguments, on GPU 0 if TensorFlow sees one, else on the test
    bed; return the exit code."""
    from .testbed import TestBedError

    try:
        return _measured_demo(args, gpu=_has_gpu())
    except TestBedError as err:
        raise ValueError(str(err)) from None


def _has_gpu() -> bool:
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s >= 1 else f"{1000 * s:.0f} ms"


def _check_budget(budget: int, cap: int) -> None:
    """A budget above the cap plans for memory the measured process does not have."""
    if budget > cap:
        text = getattr(budget, "text", str(budget))
        raise ValueError(
            f"--budget must be at most the real memory cap of the device ({_mib(cap)}): a plan for more "
            f"memory than the cap runs out of memory. Received: --budget={text!r}. Pass a --budget below the cap, "
            f"or leave it out ({BUDGET_FRACTION:.0%} of the cap)."
        )


def _measured_demo(args: argparse.Namespace, gpu: bool) -> int:
    from ..config import parse_bytes
    from .measure import measure

    batch = args.batch or 32
    size = args.image_size
    steps = args.steps
    if args.cap and args.budget:  # both given: check before the first measurement
        _check_budget(args.budget, parse_bytes(args.cap, "cap") // 2**20 * 2**20)
    _print_header(size, batch, steps, gpu)
    common = {"size": size, "steps": steps, "warmup": WARMUP, "gpu": gpu}

    t0 = time.perf_counter()
    free = measure("resnet50", batch, modes=["plain"], **common)
    if not free.ok:
        raise _failed("measuring the plain step", free)
    plain = free.value["plain"]
    print(
        f"1. plain step, no cap:     measured peak {_mib(plain['peak'])}, "
        f"predicted {_mib(plain['predicted'])}  ({time.perf_counter() - t0:.0f} s)"
    )
    cap = parse_bytes(args.cap, "cap") if args.cap else int(plain["peak"] * CAP_FRACTION)
    cap = cap // 2**20 * 2**20
    if args.budget and not args.cap:  # with --cap it was checked before the first measurement
        _check_budget(args.budget, cap)
    budget = int(args.budget) if args.budget else int(cap * BUDGET_FRACTION)
    options = {**DEMO_OPTIONS, "budget": budget}
    print(
        f"   real memory cap for the next runs: {_mib(cap)}; tflms budget: {_mib(budget)} "
        f"({budget / cap:.0%} of the cap), {', '.join(f'{k}={v}' for k, v in DEMO_OPTIONS.items())}"
    )

    t0 = time.perf_counter()
    capped = measure("resnet50", batch, modes=["plain"], cap=cap, **common)
    _print_capped(capped, t0)

    t0 = time.perf_counter()
    lms = measure("resnet50", batch, modes=["lms"], cap=cap, options=options, **common)
    if not lms.ok:
        raise _failed(f"the tflms step under the {_mib(cap)} cap", lms)
    swapped = lms.value["lms"]
    _print_swapped(swapped, plain, t0)
    saved = 1 - swapped["peak"] / plain["peak"]
    print(f"\nmeasured: tflms needs {saved:.0%} less device memory than the plain step at the same batch.")
    return 0


def _print_header(size: int, batch: int, steps: int, gpu: bool) -> None:
    """The demo's first lines: the versions, where it measures, the model and the steps."""
    import tensorflow as tf

    from .. import __version__

    where = (
        "on GPU 0 (measured by TensorFlow's GPU allocator; a cap is its memory limit), the host is the CPU"
        if gpu
        else "without a GPU: real memory on the two-process test bed (this machine's CPU is the\n"
        "device, measured by TensorFlow's BFC allocator; a second TensorFlow process is the host)"
    )
    print(
        f"tflms {__version__}, TensorFlow {tf.__version__}, demo {where}.\n"
        f"ResNet50 {size}x{size}, batch {batch}, Adam; each run trains {_steps(WARMUP)} of warm-up, "
        f"then measures {_steps(steps)}.\n"
    )


def _failed(what: str, r: MeasuredResult) -> ValueError:
    return ValueError(f"{what} failed ({r.status}, exit code {r.returncode}): {r.error.strip()[-800:]}")


def _print_capped(capped: MeasuredResult, t0: float) -> None:
    """The line of the capped plain step (out of memory, with what the allocator said, or trained);
    raise for any other outcome."""
    from .measured import oom_message

    if capped.status == "oom":
        how = "process killed by a signal" if capped.returncode < 0 else "ResourceExhaustedError"
        print(f"2. plain step, capped:     OUT OF MEMORY ({how})  ({time.perf_counter() - t0:.0f} s)")
        if capped.oom and "in_use" in capped.oom:
            r = {k: f"{v / 2**20:,.1f} MiB" if isinstance(v, int) else v for k, v in capped.oom.items()}
            print(
                f"   the allocator held {r['in_use']} in use and {r['free']} free "
                f"(largest free chunk {r['largest_free']}) and could not place {r['requested']} for {r['op']}"
            )
        elif said := oom_message(capped.error):  # e.g. cuDNN's search for a conv algorithm, which logs no dump
            print(f"   TensorFlow: {said}")
    elif capped.ok:
        print(
            f"2. plain step, capped:     trained (measured peak {_mib(capped.value['plain']['peak'])}): "
            "the cap is not below the plain step's need; pass a smaller --cap"
        )
    else:
        raise _failed("the capped plain step", capped)


def _print_swapped(swapped: dict, plain: dict, t0: float) -> None:
    """The lines of the tflms step under the cap: its peaks, swaps, losses and step time."""
    warm, measured = swapped["losses"][:WARMUP], swapped["losses"][WARMUP:]
    losses = ", ".join(f"{v:.4f}" for v in measured)
    if warm:
        losses = f"{', '.join(f'{v:.4f}' for v in warm)} (warm-up), then {losses}"
    print(
        f"3. tflms step, capped:     TRAINED, measured peak {_mib(swapped['peak'])}, "
        f"predicted {_mib(swapped['predicted'])}  ({time.perf_counter() - t0:.0f} s)\n"
        f"   {swapped['n_swaps']} tensors swapped ({_mib(swapped['swapped_bytes'])} per step), "
        f"{swapped['n_orders']} ordering edges, losses {losses}, "
        f"step time {_seconds(min(swapped['step_seconds'][1:] or swapped['step_seconds']))} "
        f"(plain {_seconds(min(plain['step_seconds'][1:] or plain['step_seconds']))})"
    )
