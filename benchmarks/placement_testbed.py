"""Placement across two devices, measured on the two-device test bed.

The zoo's CNN (64 px, Adam) trained three steps in fresh measured processes
(:mod:`tflms.testing.placement_job`: the measured process is device 0, a
:class:`tflms.testing.device_worker.DeviceWorker` device 1, each with its own BFC allocator and the
same real cap, each peak read from its own allocator): the plain step without a cap (the reference
losses), the plain step under the cap, and the step placed on the two devices under the cap each.
Writes ``benchmarks/results/placement_testbed.json``.

    python benchmarks/placement_testbed.py                 # batch 32, cap 112 MiB (about 2 minutes)
    python benchmarks/placement_testbed.py --batch 48 --cap-mib 160
    python benchmarks/placement_testbed.py --uneven        # the placer against an even split

``--uneven``: a step with uneven layers (two wide full-resolution convolutions, six narrow ones;
:func:`tflms.testing.placement_job.uneven`) without a cap, plain, placed by the placer and
split evenly by layer count, each device's peak measured; writes
``benchmarks/results/placement_uneven_testbed.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from report import save_result

from tflms import testbed

ROOT = Path(__file__).resolve().parent.parent
#: The job, run as ``python -m JOB MODE BATCH CAP_MIB MODEL``.
JOB = "tflms.testing.placement_job"
RESULT = ROOT / "benchmarks" / "results" / "placement_testbed.json"
UNEVEN = ROOT / "benchmarks" / "results" / "placement_uneven_testbed.json"


def run(mode: str, batch: int, cap_mib: int, model: str = "cnn") -> dict:
    """One run of the job in a fresh measured process: its result, or how it failed."""
    env = testbed.device_environ(f"{cap_mib}MiB" if cap_mib else None)
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-m", JOB, mode, str(batch), str(cap_mib), model], capture_output=True,
                       text=True, timeout=900, env=env)  # fmt: skip
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    if lines and r.returncode == 0:
        return json.loads(lines[-1][len("RESULT ") :])
    oom = any(m in r.stderr for m in ("OOM", "ResourceExhausted", "out of memory")) or r.returncode < 0
    return {"mode": mode, "batch": batch, "cap_mib": cap_mib, "status": "oom" if oom else "error",
            "error": r.stderr.strip().splitlines()[-1:] if r.stderr.strip() else []}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--cap-mib", type=int, default=112)
    parser.add_argument("--uneven", action="store_true", help="the placer against an even split, no cap")
    args = parser.parse_args(argv)
    if args.uneven:
        return uneven(args.batch)
    runs = (("plain", 0), ("plain", args.cap_mib), ("placed", args.cap_mib))
    rows = _peaks([run(mode, args.batch, cap) for mode, cap in runs])
    reference, placed = rows[0], rows[2]
    same = placed.get("losses") == reference.get("losses") if placed["status"] == "ok" else None
    save_result(
        RESULT,
        "placement_testbed",
        rows,
        model="cnn",
        size=64,
        batch=args.batch,
        cap_mib=args.cap_mib,
        notes=[
            "device 0 is the measured process (variables, update, first stage), device 1 a DeviceWorker; each "
            "peak is the largest of the three steps, read from that device's own allocator",
            f"placed losses equal the uncapped plain step's bit for bit: {same}",
        ],
    )
    return 0


def _peaks(rows: list[dict]) -> list[dict]:
    """``rows`` with each device's largest measured peak in MiB (``peak_mib_per_device``), printed."""
    for r in rows:
        peaks = r.get("peaks") or []
        r["peak_mib_per_device"] = [round(max(p[d] for p in peaks) / 2**20, 1) for d in range(2)] if peaks else None
        cap = r["cap_mib"] or "none"
        print(f"{r['mode']:6} cap {cap}: {r['status']}, peaks {r['peak_mib_per_device']}", flush=True)
    return rows


def uneven(batch: int, repeats: int = 3) -> int:
    """The uneven step plain, placed by the placer and split evenly, no cap, each ``repeats`` times in
    fresh processes: each device's peak per step."""
    rows = _peaks([run(mode, batch, 0, "uneven") for _ in range(repeats) for mode in ("plain", "placer", "even")])
    by_mode: dict[str, list[dict]] = {}
    for r in rows:
        by_mode.setdefault(r["mode"], []).append(r)
    # Per step, the larger of the two devices' peaks: its median over every step of every run, and its largest.
    steps = {m: sorted(max(p) / 2**20 for r in rs for p in r.get("peaks") or []) for m, rs in by_mode.items()}
    median = {m: float(np.median(v)) if v else float("nan") for m, v in steps.items()}
    predicted = {m: max(by_mode[m][0].get("predicted") or [0]) / 2**20 for m in ("placer", "even")}
    plain_losses = by_mode["plain"][0].get("losses")
    same = all(r.get("losses") == plain_losses for r in rows)
    save_result(
        UNEVEN,
        "placement_uneven_testbed",
        rows,
        model="uneven",
        size=64,
        batch=batch,
        cap_mib=0,
        notes=[
            "device 0 is the measured process (variables, update, first stage), device 1 a DeviceWorker; each "
            f"row a fresh run of three steps ({repeats} runs per way), each device's peak read from its own "
            "allocator; no cap; the table's peaks are each run's largest step",
            f"largest device peak per step, median over the {len(steps['placer'])} steps of the runs: the placer's "
            f"{median['placer']:.1f} MiB, the even split's {median['even']:.1f} MiB "
            f"({100 * (1 - median['placer'] / median['even']):.1f} % lower); the largest step of any run: "
            f"{steps['placer'][-1]:.1f} and {steps['even'][-1]:.1f} MiB (device 0 holds a wide activation longer "
            "in some steps, while the other process, on the same 2 shared cores, receives it late)",
            f"predicted: {predicted['placer']:.1f} and {predicted['even']:.1f} MiB "
            f"({100 * (1 - predicted['placer'] / predicted['even']):.1f} % lower)",
            f"every run's losses equal the plain step's bit for bit: {same}",
        ],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
