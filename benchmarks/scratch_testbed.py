"""The ops' temporary buffers (kernel scratch) in the prediction, on the test bed.

For each model below, one measured process under a cap above its steps (:data:`CAP`, claimed in
one region): the plain step runs :data:`STEPS` times on the device and its measured peak is read
after each; an op profile of the same step (:func:`tflms.testing.profile.profile_ops`) records
each op's largest temporary buffer; the plain step's predicted peak is read from
``tflms.function`` with no profile and with that profile (``Knobs(op_profile=path)``: the
simulator then counts each op's scratch while it runs). Then a plan for :data:`PLAN_FRACTION` of
the plain prediction, made without and with the profile, runs :data:`STEPS` steps each. Per
model: measured / predicted for each, and the largest scratch per op type.

Writes benchmarks/results/scratch_testbed.json.

Usage::

    python benchmarks/scratch_testbed.py
    python benchmarks/scratch_testbed.py --models resnet50
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
#: Measured steps per model (the largest peak is kept; the first step's includes its warm-up).
STEPS = 3
#: The budget of the swapped plans, as a fraction of the plain step's prediction.
PLAN_FRACTION = 0.6
#: The measured process's real cap: above every step here, claimed in one region as a GPU's.
CAP = "2GiB"
#: model -> (batch, size).
MODELS = {"resnet50": (48, 96), "cnn": (64, 64), "transformer": (16, 256), "gpt": (8, 256)}


def measure(model: str, batch: int, size: int, steps: int) -> dict[str, Any]:
    """Measured and predicted plain peaks of one model, without and with its measured scratch."""
    import tempfile

    import tensorflow as tf

    import tflms
    from tflms import testbed
    from tflms.testing.profile import profile_ops
    from tflms.testing.zoo import build

    _, x, y, train_step = build(model, batch, size)
    step = tf.function(train_step)
    peaks = []
    with tf.device(testbed.DEVICE):
        for _ in range(steps):
            testbed.reset_peak()
            step(x, y)
            peaks.append(int(testbed.memory()["peak"]))
        profile = profile_ops(step, (x, y), steps=1, warmup=0)
    path = profile.save(Path(tempfile.mkdtemp()) / "profile.json")

    def predicted(**options: Any) -> int:
        lms = tflms.function(train_step, device=testbed.DEVICE, host=testbed.HOST, budget=None, **options)
        return int(lms.get_plan(x, y).peak_bytes_before)

    def planned(budget: int, **options: Any) -> dict[str, Any]:
        """A plan for ``budget``: its prediction and the measured peaks of ``steps`` steps."""
        lms = tflms.function(
            train_step, device=testbed.DEVICE, host=testbed.HOST, budget=budget, on_budget_miss="best", **options
        )
        plan, peaks = lms.get_plan(x, y), []
        with tf.device(testbed.DEVICE):
            for _ in range(steps):
                testbed.reset_peak()
                lms(x, y)
                peaks.append(int(testbed.memory()["peak"]))
        top = max(peaks)
        return {
            "predicted": plan.peak_bytes_after,
            "swaps": len(plan.swaps),
            "measured_peaks": peaks,
            "measured_over_predicted": round(top / plan.peak_bytes_after, 3),
        }

    by_type: dict[str, int] = {}
    for op, nbytes in profile.scratch.items():
        kind = profile.ops[op][0]
        by_type[kind] = max(by_type.get(kind, 0), nbytes)
    plain = predicted()
    budget = int(PLAN_FRACTION * plain)
    return {
        "measured_peaks": peaks,
        "predicted": plain,
        "predicted_with_scratch": predicted(knobs=tflms.Knobs(op_profile=str(path))),
        "budget": budget,
        "plan": planned(budget),
        "plan_with_scratch": planned(budget, knobs=tflms.Knobs(op_profile=str(path))),
        "ops_with_scratch": len(profile.scratch),
        "largest_scratch_by_type": dict(sorted(by_type.items(), key=lambda kv: -kv[1])),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--out", type=Path, default=RESULTS / "scratch_testbed.json")
    args = parser.parse_args(argv)
    rows = []
    for model in args.models.split(","):
        batch, size = MODELS[model]
        kwargs = {"model": model, "batch": batch, "size": size, "steps": args.steps}
        r = run_measured("scratch_testbed:measure", kwargs, cap=CAP, timeout=1800, pythonpath=[HERE])
        row: dict[str, Any] = {"model": model, "batch": batch, "size": size, "status": r.status}
        if r.ok:
            row.update(r.value)
            top = max(r.value["measured_peaks"])
            row["measured_over_predicted"] = round(top / r.value["predicted"], 3)
            row["measured_over_predicted_with_scratch"] = round(top / r.value["predicted_with_scratch"], 3)
        else:
            row["error"] = r.error[-1500:]
        print(json.dumps({k: v for k, v in row.items() if k != "largest_scratch_by_type"}), flush=True)
        rows.append(row)
    save_result(
        args.out,
        "scratch_testbed",
        rows,
        source="tflms test bed (BFC allocator on the CPU as the device, claimed in one region; a second TF "
        "process as the host; TensorFlow's own CPU kernels); a 2 GiB cap, above every step",
        steps=args.steps,
        command=" ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
    )


if __name__ == "__main__":
    main()
