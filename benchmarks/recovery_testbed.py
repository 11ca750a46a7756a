"""The test bed's kernels, and recovery from an out-of-memory step under a real cap (issue 63).

1. ``onednn``: ResNet50 96² Adam on the two-process test bed (:mod:`tflms.testing.testbed`), the
   plain step at batch 16 and the default tflms plan at batch 48, no cap, one fresh measured process
   each, with oneDNN's CPU kernels (``TF_ENABLE_ONEDNN_OPTS=1``) and with TensorFlow's own (Eigen's,
   ``0``: the test bed's default since issue 63, because oneDNN's conv backprop aborts the process
   when the allocator fails it, where Eigen's kernels raise ``ResourceExhaustedError`` as a GPU
   does). Per run: the steady-state measured peak, the per-step peaks, the median step time after
   the warm-up, the prediction and the losses.
2. ``recovery``: the jobs of tests/testing/test_recovery_testbed.py (functions of
   :mod:`tflms.testing.jobs`), each in a fresh measured process: ResNet50 96² batch 48 planned for
   900 MiB under a 600 MiB cap through ``tflms.function`` and through ``LMSCallback``, each against
   an uncapped plain run of the same three steps; the two-input model under its plain step's
   measured peak x 1.02; ``fit`` + ``LMSCallback`` and no option at batch 72 under 600 MiB, next to
   ``tflms.function`` with the same (default) options.

Writes benchmarks/results/recovery_testbed.json. No criterion here: the tests assert.

Usage::

    python benchmarks/recovery_testbed.py                 # both parts
    python benchmarks/recovery_testbed.py --parts onednn
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from report import save_result

from tflms.testing.measured import run_measured

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 2**20
#: Lines of a measured process's output that say how it died, if it did.
_DEATH_MARKS = ("Check failed", "Must be non NULL", "Aborted", "Segmentation", "Fatal Python", "core dumped")


def _onednn_rows(steps: int) -> list[dict[str, Any]]:
    rows = []
    for mode, batch in (("plain", 16), ("lms", 48)):
        for onednn in (True, False):
            kwargs = {"model": "resnet50", "batch": batch, "modes": [mode], "steps": steps}
            r = run_measured("tflms.testing.measure:measure_step", kwargs, onednn=onednn, timeout=1800)
            row: dict[str, Any] = {
                "part": "onednn",
                "model": "resnet50",
                "size": 96,
                "batch": batch,
                "mode": mode,
                "onednn": onednn,
                "status": r.status,
                "process_seconds": round(r.seconds, 1),
            }
            if r.ok:
                v = r.value[mode]
                row.update(
                    peak=v["peak"],
                    peaks=v["peaks"],
                    step_seconds=statistics.median(v["step_seconds"][1:]),
                    predicted=v["predicted"],
                    losses=v["losses"],
                    n_swaps=v.get("n_swaps"),
                )
            else:
                row["error"] = r.error[-1500:]
            print(json.dumps({k: row.get(k) for k in ("mode", "batch", "onednn", "status", "peak", "step_seconds")}))
            print(f"  peak {row.get('peak', 0) / MIB:.1f} MiB", flush=True)
            rows.append(row)
    return rows


def _job(target: str, kwargs: dict[str, Any], cap: str | None) -> dict[str, Any]:
    r = run_measured(f"tflms.testing.jobs:{target}", kwargs, cap=cap, timeout=1800)
    row: dict[str, Any] = {
        "part": "recovery",
        "job": target,
        "kwargs": kwargs,
        "cap": cap,
        "status": r.status,
        "returncode": r.returncode,
        "process_seconds": round(r.seconds, 1),
    }
    if r.ok:
        row["value"] = r.value
    else:
        died = [line for line in r.error.splitlines() if any(m in line for m in _DEATH_MARKS)]
        row.update(error=r.error[-1500:], raised=r.raised, oom=r.oom, died=died[-5:])
    print(json.dumps({k: row[k] for k in ("job", "kwargs", "cap", "status", "process_seconds")}), flush=True)
    return row


def _recovery_rows() -> list[dict[str, Any]]:
    rows = [
        _job("resnet_steps", {"batch": 48, "mode": "plain"}, None),
        _job("resnet_steps", {"batch": 48, "mode": "function", "budget": "900MiB"}, "600MiB"),
        _job("resnet_steps", {"batch": 48, "mode": "plain_fit"}, None),
        _job("resnet_steps", {"batch": 48, "mode": "fit", "budget": "900MiB"}, "600MiB"),
    ]
    plain = _job("twoinput_fit", {"lms": False}, None)
    rows.append(plain)
    if plain["status"] == "ok":
        cap = f"{int(1.02 * plain['value']['peak'] / MIB)}MiB"
        rows.append(_job("twoinput_fit", {"lms": True}, cap))
    rows += [
        _job("resnet_steps", {"batch": 72, "mode": "fit"}, "600MiB"),
        _job("resnet_steps", {"batch": 72, "mode": "function"}, "600MiB"),
    ]
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="onednn,recovery", help="comma-separated: onednn, recovery")
    parser.add_argument("--steps", type=int, default=3, help="measured steps after one warm-up (onednn part)")
    parser.add_argument("--out", type=Path, default=RESULTS / "recovery_testbed.json")
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    rows: list[dict[str, Any]] = []
    if "onednn" in parts:
        rows += _onednn_rows(args.steps)
    if "recovery" in parts:
        rows += _recovery_rows()
    save_result(
        args.out,
        "recovery_testbed",
        rows,
        source="tflms test bed (BFC allocator on the CPU as the device, a second TF process as the host); "
        "kernels as each row's onednn says (recovery rows: the test bed's default, TF_ENABLE_ONEDNN_OPTS=0)",
        steps=args.steps,
        warmup=1,
        command=" ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
    )


if __name__ == "__main__":
    main()
