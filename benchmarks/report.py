"""Markdown tables of the benchmark results in benchmarks/results/*.json.

The README's result tables are pasted from this script's output, and
``tests/test_readme.py`` checks that they still match the JSON.

Usage::

    python benchmarks/report.py            # print every table
    python benchmarks/report.py capacity   # one of the names in TABLES
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def save_result(path: Path, benchmark: str, rows: list[dict], **fields: object) -> None:
    """Write a benchmark's JSON with the common header (date, machine, versions) and say so."""
    import os
    import platform
    import time

    import tensorflow as tf

    import tflms

    result = {
        "benchmark": benchmark,
        **fields,
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} CPUs",
        "tensorflow": tf.__version__,
        "tflms": tflms.__version__,
        "rows": rows,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


def _header(data: dict) -> str:
    return f"{data['date']}, {data['machine']}, TensorFlow {data['tensorflow']}, tflms {data['tflms']}"


def pass_speed(data: dict) -> str:
    lines = [
        f"_{_header(data)}; seconds, best of the runs; transformer-block Adam steps_",
        "",
        "| ops | swaps | graph model | plan | rewrite (in place) | **total** | + graph copy (`optimize(cf)`) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        s = r["seconds"]
        lines.append(
            f"| {r['ops']:,} | {r['swaps']} | {s['model']:.2f} | {s['plan']:.2f} | {s['rewrite']:.2f} "
            f"| **{s['total']:.2f}** | {s['copy']:.2f} |"
        )
    return "\n".join(lines)


def capacity(data: dict) -> str:
    lines = [
        f"_{_header(data)}; **simulator predictions**, search precision {data['rel_tol']:.0%}_",
        "",
        "| model | budget | largest | without LMS | with LMS | ratio |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for r in data["rows"]:
        ratio = f"x{r['ratio']:.1f}" if r["ratio"] else "-"
        lines.append(
            f"| {r['model']} | {r['budget']} | {r['measure']} | {r['without_lms']} | {r['with_lms']} | {ratio} |"
        )
    return "\n".join(lines)


def cpu_overhead(data: dict) -> str:
    lines = [
        f"_{_header(data)}; median of {data['runs']}x{data['steps']} steps each, plain and LMS alternating_",
        "",
        "| model | batch | swaps | swapped per step | plain ms | LMS ms | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        mib = r["swapped_bytes"] / 2**20
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['swaps']} | {mib:.1f} MiB | {r['plain_ms_median']:.1f} "
            f"| {r['lms_ms_median']:.1f} | {r['ratio']:.2f} |"
        )
    return "\n".join(lines)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def simulator_accuracy(data: dict) -> str:
    lines = [
        f"_{_header(data)}; **measured** on the two-process test bed vs **predicted** by the simulator_",
        "",
        "| model | batch | step | measured peak | per step (min-max) | predicted peak | measured / predicted |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        step = "tflms" if r.get("lms") else "plain"
        if r.get("status", "ok") != "ok" or "measured" not in r:
            lines.append(f"| {r['model']} | {r['batch']} | {step} | (run failed: {r.get('status')}) | | | |")
            continue
        peaks = r.get("peaks") or [r["measured"]]
        per_step = f"{min(peaks) / 2**20:,.0f}-{_mib(max(peaks))}"
        lines.append(
            f"| {r['model']} | {r['batch']} | {step} | {_mib(r['measured'])} | {per_step} "
            f"| {_mib(r['predicted'])} | {r['measured'] / r['predicted']:.2f} |"
        )
    return "\n".join(lines)


def testbed_capacity(data: dict) -> str:
    lines = [
        f"_{_header(data)}; **measured** on the two-process test bed under a real cap, tflms autotuned to "
        f"budget = fraction x cap; search precision {data['rel_tol']:.0%}; predicted columns: the simulator "
        "(`tflms.max_batch_size`) for the same cap_",
        "",
        "| model | size | cap | budget | largest batch, plain | largest batch, tflms | ratio | predicted plain "
        "| predicted tflms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        ratio = f"x{r['ratio']:.1f}" if r["ratio"] else "-"
        fraction = r.get("fraction", data.get("fraction"))
        lines.append(
            f"| {r['model']} | {r['size']} | {_mib(r['cap'])} | {fraction:g} x cap | {r['plain']} | {r['lms']} "
            f"| {ratio} | {r['predicted_plain']} "
            f"| {r['predicted_lms']} |"
        )
    return "\n".join(lines)


TABLES: dict[str, Callable[[dict], str]] = {
    "pass_speed": pass_speed,
    "capacity": capacity,
    "cpu_overhead": cpu_overhead,
    "simulator_accuracy": simulator_accuracy,
    "testbed_capacity": testbed_capacity,
}


def table(name: str, results: Path = RESULTS) -> str | None:
    """The markdown table of ``results/<name>.json``, or None if it was not run."""
    path = results / f"{name}.json"
    return TABLES[name](json.loads(path.read_text())) if path.exists() else None


def main(argv: list[str]) -> int:
    names = argv or list(TABLES)
    for name in names:
        if name not in TABLES:
            print(f"unknown table {name!r}; choose from {', '.join(TABLES)}", file=sys.stderr)
            return 2
        print(f"### {name}\n\n{table(name) or '(not run)'}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
