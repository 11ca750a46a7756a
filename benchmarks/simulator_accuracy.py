"""Simulator accuracy: measured device peak vs the simulator's prediction, on the test bed.

Each case trains a few Adam steps of a model of :data:`tflms.measure.MODELS` in a
fresh measured process (:func:`tflms.measure.measure`: TensorFlow's BFC allocator
on the CPU is the device, a second TensorFlow process is the host), plain and
with the default LMS plan, and compares the largest measured per-step peak with
the simulator's peak of the step that ran. The ratio is measured / predicted.

Usage::

    python benchmarks/simulator_accuracy.py                    # every case
    python benchmarks/simulator_accuracy.py --cases cnn:32 resnet50:48
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from report import save_result

from tflms.measure import measure

DEFAULT_CASES = ("cnn:32", "resnet50:32", "resnet50:48", "transformer:16")


def run_case(model: str, batch: int, steps: int) -> list[dict]:
    """Plain and LMS steps of one model, measured in one process (same weights)."""
    r = measure(model, batch, modes=("plain", "lms"), steps=steps)
    if not r.ok:
        return [{"model": model, "batch": batch, "lms": None, "status": r.status, "error": r.error[-500:]}]
    rows = []
    for mode in ("plain", "lms"):
        v = r.value[mode]
        row = {
            "model": model,
            "batch": batch,
            "size": r.value["size"],
            "lms": mode == "lms",
            "measured": v["peak"],
            "peaks": v["peaks"],
            "predicted": v["predicted"],
            "ratio": round(v["peak"] / v["predicted"], 3),
        }
        if mode == "lms":
            row.update(n_swaps=v["n_swaps"], swapped_bytes=v["swapped_bytes"])
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), help="model:batch pairs")
    parser.add_argument("--steps", type=int, default=3)
    default_json = Path(__file__).resolve().parent / "results/simulator_accuracy.json"
    parser.add_argument("--json", type=Path, default=default_json)
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    rows = []
    print(f"{'model':12} {'batch':>5} {'lms':>4} {'measured MB':>12} {'predicted MB':>13} {'ratio':>6}")
    for case in args.cases:
        model, batch = case.split(":")
        for row in run_case(model, int(batch), args.steps):
            rows.append(row)
            lms = "?" if row["lms"] is None else "yes" if row["lms"] else "no"
            if "ratio" in row:
                print(
                    f"{model:12} {batch:>5} {lms:>4} {row['measured'] / 1e6:12.1f} "
                    f"{row['predicted'] / 1e6:13.1f} {row['ratio']:6.3f}",
                    flush=True,
                )
            else:
                print(f"{model:12} {batch:>5} {lms:>4} {row['status']}: {row['error'][-200:]}", flush=True)
    save_result(
        args.json, "simulator_accuracy", rows,
        source="tflms test bed (BFC allocator on the CPU as the device, a second TF process as the host)",
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
