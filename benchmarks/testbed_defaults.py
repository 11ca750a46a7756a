"""tflms with no option but its device and host, measured on the two-process test bed.

What the zero-config default (``budget="auto"``: the test bed's cap x 0.9, the default policy)
does with ResNet50 96² (Adam), through ``model.fit`` with ``LMSCallback`` and through
``tflms.function``:

* ``fits``: under a 1 GiB cap at batch 16, which the plain step fits: the plan should swap
  nothing and the step take the plain step's time;
* ``grows``: under a 1 GiB cap at batch 96, where the plain step runs out of memory;
* ``capacity``: under a 600 MiB cap, the batches 48 and 72 (the plain step's largest is 16), and
  72 with the opt-in ``order_updates``.

Each way of each case runs in a fresh measured process (:func:`tflms.testbed.measure_model`):
one warm-up step, then ``--steps`` measured ones. Writes ``benchmarks/results/testbed_defaults.json``.

    python benchmarks/testbed_defaults.py                 # every case (about 15 minutes on 2 CPUs)
    python benchmarks/testbed_defaults.py --cases fits    # one case
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
from pathlib import Path
from typing import Any

import tflms
from tflms.testbed import measure_model

RESULTS = Path(__file__).resolve().parent / "results" / "testbed_defaults.json"
MiB = 2**20

#: case -> (cap, batch, the ways to run, APIs, tflms options besides device and host)
CASES: dict[str, tuple[str, int, tuple[str, ...], tuple[str, ...], dict[str, Any]]] = {
    "fits": ("1GiB", 16, ("plain", "lms"), ("fit", "function"), {}),
    "grows": ("1GiB", 96, ("plain", "lms"), ("fit",), {}),
    "capacity48": ("600MiB", 48, ("lms",), ("fit", "function"), {}),
    "capacity72": ("600MiB", 72, ("lms",), ("fit", "function"), {}),
    "capacity72_order_updates": ("600MiB", 72, ("lms",), ("function",), {"policy": ("default", "order_updates")}),
}
FACTORIES = {"fit": "tflms.testing.zoo:fit_data", "function": "tflms.testing.zoo:train_step"}


def run_case(case: str, steps: int, size: int) -> list[dict[str, Any]]:
    cap, batch, ways, apis, options = CASES[case]
    rows = []
    for api in apis:
        m = measure_model(
            FACTORIES[api],
            {"name": "resnet50", "batch": batch, "size": size},
            steps=steps,
            cap=cap,
            ways=ways,
            options=options,
            batch_size=batch if api == "fit" else None,
            timeout=3600,
        )
        print(m.summary(), flush=True)
        for way in ways:
            run = m[way]
            measured = run.seconds[run.warmup :]
            rows.append(
                {
                    "case": case,
                    "model": "resnet50",
                    "size": size,
                    "cap_mib": tflms.config.parse_bytes(cap) // MiB,
                    "batch": batch,
                    "api": api,
                    "options": {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()},
                    "way": way,
                    "status": run.status,
                    "peaks_mib": [round(p / MiB, 1) for p in run.peaks],
                    "steady_peak_mib": None if run.peak is None else round(run.peak / MiB, 1),
                    "step_seconds": [round(s, 3) for s in run.seconds],
                    "median_step_seconds": round(statistics.median(measured), 3) if measured else None,
                    "n_swaps": run.n_swaps,
                    "predicted_mib": None if run.predicted is None else round(run.predicted / MiB, 1),
                    "predicted_plain_mib": None if run.predicted_plain is None else round(run.predicted_plain / MiB, 1),
                    "budget_text": run.budget_text,
                    "losses": run.losses,
                    "error": "" if run.ok else (run.result.raised or {}).get("message", "")[:300],
                }
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=sorted(CASES))
    parser.add_argument("--steps", type=int, default=2, help="measured steps after one warm-up (default 2)")
    parser.add_argument("--size", type=int, default=96, help="image side (default 96)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    import tensorflow as tf

    rows: list[dict[str, Any]] = []
    if args.out.exists():  # keep the cases not run again
        rows = [r for r in json.loads(args.out.read_text())["runs"] if r["case"] not in args.cases]
    for case in args.cases:
        rows += run_case(case, args.steps, args.size)
    data = {
        "benchmark": "testbed_defaults",
        "where": "measured: two-process test bed (CPU device, BFC allocator with a real cap; host process, gRPC)",
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} CPUs",
        "tensorflow": tf.__version__,
        "tflms": tflms.__version__,
        "options": "none but device and host (budget='auto', the default policy)",
        "runs": sorted(rows, key=lambda r: (list(CASES).index(r["case"]), r["api"], r["way"])),
        "notes": (
            "Each (case, API, way) is one fresh measured process: one warm-up step, then the measured steps; "
            "steady_peak_mib is the largest measured step after the warm-up. Step times share the 2 CPU cores "
            "with the host process and with whatever else ran on the machine."
        ),
    }
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
