"""Placement across two devices, measured on the two-device test bed.

The zoo's CNN (64 px, Adam) trained three steps in fresh measured processes
(``tests/placement_testbed_job.py``: the measured process is device 0, a
:class:`tflms.testing.device_worker.DeviceWorker` device 1, each with its own BFC allocator and the
same real cap, each peak read from its own allocator): the plain step without a cap (the reference
losses), the plain step under the cap, and the step placed on the two devices under the cap each.
Writes ``benchmarks/results/placement_testbed.json``.

    python benchmarks/placement_testbed.py                 # batch 32, cap 112 MiB (about 2 minutes)
    python benchmarks/placement_testbed.py --batch 48 --cap-mib 160
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from report import save_result

from tflms import testbed

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "placement_testbed_job.py"
RESULT = ROOT / "benchmarks" / "results" / "placement_testbed.json"


def run(mode: str, batch: int, cap_mib: int) -> dict:
    """One run of the job in a fresh measured process: its result, or how it failed."""
    env = testbed.device_environ(f"{cap_mib}MiB" if cap_mib else None)
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, str(JOB), mode, str(batch), str(cap_mib)], capture_output=True, text=True,
                       timeout=900, env=env)  # fmt: skip
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
    args = parser.parse_args(argv)
    runs = (("plain", 0), ("plain", args.cap_mib), ("placed", args.cap_mib))
    rows = [run(mode, args.batch, cap) for mode, cap in runs]
    for r in rows:
        peaks = r.get("peaks") or []
        r["peak_mib_per_device"] = [round(max(p[d] for p in peaks) / 2**20, 1) for d in range(2)] if peaks else None
        cap = r["cap_mib"] or "none"
        print(f"{r['mode']:6} cap {cap}: {r['status']}, peaks {r['peak_mib_per_device']}", flush=True)
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


if __name__ == "__main__":
    raise SystemExit(main())
