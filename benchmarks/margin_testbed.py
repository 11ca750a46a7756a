"""The learned margin of ``budget="auto"`` on the test bed, for several models (issue 63).

For each model of :mod:`tflms.testing.zoo` below: one measured process, uncapped, gives the plain
step's predicted peak; then a fresh measured process under a real cap of :data:`CAP_FRACTION` of
that prediction runs ``tflms.function(step, device, host)`` with no other option for
:data:`STEPS` steps. Per model: the cap, the budget the first plan was made for (the margin's
starting point), each plan's prediction, every re-plan (a learned margin, or an out-of-memory
error) with its budgets, each step's measured peak and the losses.

Writes benchmarks/results/margin_testbed.json. No criterion here: the recovery tests assert.

Usage::

    python benchmarks/margin_testbed.py
    python benchmarks/margin_testbed.py --models cnn,gpt
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from report import save_result

from tflms.testing.measured import run_measured

RESULTS = Path(__file__).resolve().parent / "results"
HERE = str(Path(__file__).resolve().parent)
MIB = 2**20
#: The real cap, as a fraction of the plain step's predicted peak: the plain step cannot fit.
CAP_FRACTION = 0.7
#: Steps per model (the margin is learned after the first two calls of a plan).
STEPS = 6
#: model -> (batch, size): each plain step predicted at a few hundred MiB.
MODELS = {"cnn": (64, 64), "resnet50": (32, 96), "transformer": (16, 256), "gpt": (8, 256)}


def predicted_plain(model: str, batch: int, size: int) -> int:
    """The plain step's predicted peak (bytes), in a measured process (its host connected)."""
    import tflms
    from tflms import testbed
    from tflms.testing.zoo import build

    _, x, y, step = build(model, batch, size)
    return int(tflms.function(step, device=testbed.DEVICE, host=testbed.HOST).get_plan(x, y).peak_bytes_before)


def learn(model: str, batch: int, size: int, steps: int) -> dict[str, Any]:
    """``steps`` steps of ``tflms.function`` with no option: plans, re-plans, peaks and losses."""
    import tensorflow as tf

    import tflms
    from tflms import testbed
    from tflms.integrations.devices import device_memory_limit
    from tflms.testing.zoo import build

    _, x, y, step = build(model, batch, size)
    lms = tflms.function(step, device=testbed.DEVICE, host=testbed.HOST)
    plans, peaks, losses = [], [], []
    with tf.device(testbed.DEVICE):
        for _ in range(steps):
            testbed.reset_peak()
            losses.append(float(lms(x, y)))
            peaks.append(int(testbed.memory()["peak"]))
            plan = lms.get_plan(x, y)
            row = {"budget": plan.options.get("budget"), "predicted": plan.peak_bytes_after, "swaps": len(plan.swaps)}
            if not plans or plans[-1] != row:
                plans.append(row)
    return {
        "limit": device_memory_limit(testbed.DEVICE)[0],
        "plans": plans,
        "replans": lms.replans,
        "peaks": peaks,
        "losses": losses,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--out", type=Path, default=RESULTS / "margin_testbed.json")
    args = parser.parse_args(argv)
    rows = []
    for model in args.models.split(","):
        batch, size = MODELS[model]
        kwargs = {"model": model, "batch": batch, "size": size}
        probe = run_measured("margin_testbed:predicted_plain", kwargs, timeout=1800, pythonpath=[HERE])
        row: dict[str, Any] = {"model": model, "batch": batch, "size": size, "status": probe.status}
        if probe.ok:
            cap = int(CAP_FRACTION * probe.value) // MIB
            learn_kwargs = {**kwargs, "steps": args.steps}
            r = run_measured("margin_testbed:learn", learn_kwargs, cap=f"{cap}MiB", timeout=1800, pythonpath=[HERE])
            row.update(predicted_plain=probe.value, cap=cap * MIB, status=r.status, process_seconds=round(r.seconds, 1))
            if r.ok:
                row.update(r.value)
            else:
                row["error"] = r.error[-1500:]
        print(json.dumps({k: row.get(k) for k in ("model", "status", "cap", "plans", "peaks")}), flush=True)
        rows.append(row)
    save_result(
        args.out,
        "margin_testbed",
        rows,
        source="tflms test bed (BFC allocator on the CPU as the device, claimed in one region; a second TF "
        "process as the host; TensorFlow's own CPU kernels)",
        steps=args.steps,
        cap_fraction=CAP_FRACTION,
        command=" ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
    )


if __name__ == "__main__":
    main()
