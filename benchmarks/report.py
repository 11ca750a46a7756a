"""Markdown tables of the benchmark results in benchmarks/results/*.json.

The documentation's benchmarks page (``docs/benchmarks.md``) and the README's headline
table are rendered by this script from the JSON; ``tests/test_docs.py`` checks that the
committed page and the README's table are what the JSON gives today.

Usage::

    python benchmarks/report.py                        # print every table
    python benchmarks/report.py capacity               # one of the names in TABLES
    python benchmarks/report.py --page docs/benchmarks.md   # write the benchmarks page
    python benchmarks/report.py --headline             # print the README's headline table
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from tflms.testing.measure import FENCE_WINDOW
from tflms.testing.zoo import MODELS

RESULTS = Path(__file__).resolve().parent / "results"


def policy_of(**passes: bool) -> tuple[str, ...] | str:
    """The ``policy`` of tflms that runs the passes given as ``True`` (``"none"`` when none is).

    >>> policy_of(swap_gradients=True, split_sums=False), policy_of(split_sums=False)
    (('swap_gradients',), 'none')
    """
    return tuple(name for name, on in passes.items() if on) or "none"


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


def run_script(script: Path, args: list[str], timeout: float) -> tuple[dict | None, str]:
    """Run ``python script *args`` in a fresh process: (the last JSON object it printed on a line
    of its own, or None; the tail of its stderr, or why it gave nothing)."""
    import subprocess
    import sys

    try:
        r = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line), ""
    return None, r.stderr[-3000:]


def _header(data: dict) -> str:
    return f"{data['date']}, {data['machine']}, TensorFlow {data['tensorflow']}, tflms {data['tflms']}"


def _newest(rows: list[dict]) -> list[dict]:
    """The rows of ``rows`` run last: those with the label of the latest ``date``. The earlier runs
    stay in the JSON (each labelled, with its commit and the machine's load in its notes)."""
    latest = max(rows, key=lambda r: r["date"])["label"]
    return [r for r in rows if r["label"] == latest]


def pass_speed(data: dict) -> str:
    """``pass_speed.py``: the block stacks' rows, then the newest run of the Keras applications, of
    the capacity search and of the policies (each row with its date)."""
    # Rows without "serialize" were planned with serialize=False, then the default.
    ordered = {r.get("serialize", False) for r in data["rows"]}
    schedule = (
        "; planned with `serialize=True` (the memory-aware schedule)"
        if ordered == {True}
        else ("; planned with `serialize=False` (no memory-aware schedule)" if ordered == {False} else "")
    )
    notes = data.get("notes") or {}
    rows_note = f"; {notes['rows']}" if isinstance(notes, dict) and notes.get("rows") else ""
    lines = [
        f"_{_header(data)}; seconds, best of the runs; transformer-block Adam steps{schedule}{rows_note}_",
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
    if data.get("keras"):
        lines += [
            "",
            "Keras applications, default options (seconds, min / median of the runs; the trace is TensorFlow's):",
            "",
            "| date | model | batch | ops | swaps | trace | graph model | plan |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in _newest(data["keras"]):
            s = r["seconds"]
            cells = " | ".join(f"{s[k]['min']:.2f} / {s[k]['median']:.2f}" for k in ("trace", "model", "plan"))
            lines.append(f"| {r['date']} | {r['name']} | {r['batch']} | {r['ops']:,} | {r['swaps']} | {cells} |")
    if data.get("capacity"):
        lines += [
            "",
            "The capacity search of `tflms plan NAME --batch B --budget SIZE --max-batch` (seconds, min / median):",
            "",
            "| date | model | budget | largest batch plain / with tflms (predicted) | trace | search |",
            "|---|---|---|---|---:|---:|",
        ]
        for r in _newest(data["capacity"]):
            s = r["seconds"]
            lines.append(
                f"| {r['date']} | {r['name']} | {r['budget']} | {r['without_lms']} / {r['with_lms']} "
                f"| {s['trace']['min']:.1f} / {s['trace']['median']:.1f} | {s['search']['min']:.0f} / "
                f"{s['search']['median']:.0f} |"
            )
    if data.get("policies"):
        lines += ["", _pass_speed_policies(_newest(data["policies"]))]
    if any(data.get(k) for k in ("keras", "capacity", "policies")):
        lines += [
            "",
            "The Keras, capacity and policy tables show their newest run; `benchmarks/results/pass_speed.json` "
            "keeps the earlier ones, with notes on the code each timed and the machine's load.",
        ]
    return "\n".join(lines)


def _load_average(load: dict) -> str:
    """The 1-minute load average at a run's start and end (``-`` where not recorded)."""
    return " -> ".join(f"{load[k][0]:.1f}" if k in load else "-" for k in ("start", "end"))


def _pass_speed_policies(rows: list[dict]) -> str:
    """``pass_speed.py --policies``: one step planned under each policy (module doc there)."""
    first = rows[0]
    lines = [
        f"The {first['name']} stack of {first['blocks']} blocks (width {first['dim']}, sequence {first['seq']}, "
        f"batch {first['batch']}) planned under each policy, as `tflms.optimize` does (seconds, min / median of "
        "the runs; plan CPU: the process's CPU seconds; rewrite: only where the plan changes the step; load "
        "average: 1 minute, at the start and the end of the run):",
        "",
        "| date | policy | ops | swaps | sums split | tiles dropped | predicted peak before -> after "
        "| graph model | plan | plan CPU | rewrite | total | runs | load average |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        s = r["seconds"]
        cells = " | ".join(
            f"{s[k]['min']:.2f} / {s[k]['median']:.2f}" for k in ("model", "plan", "plan_cpu", "rewrite", "total")
        )
        lines.append(
            f"| {r['date']} | `{r['policy']}` | {r['ops']:,} | {r['swaps']} | {r['sums']} "
            f"| {r['tiles']} | {r['peak_bytes_before'] / 2**20:,.1f} -> {r['peak_bytes_after'] / 2**20:,.1f} MiB "
            f"| {cells} "
            f"| {len(s['total']['runs'])} | {_load_average(r.get('load_average') or {})} |"
        )
    return "\n".join(lines)


def _plan_options(row: dict) -> str:
    """The plan options a capacity row was run with, as its label says them (rows without
    ``serialize`` predate the option; ``swap_gradients``, ``split_sums``, ``drop_tiles`` and
    ``order_updates`` are named only when on)."""
    swapped = ", `swap_gradients=True`" if row.get("swap_gradients") else ""
    split = ", `split_sums=True`" if row.get("split_sums") else ""
    tiles = ", `drop_tiles=True`" if row.get("drop_tiles") else ""
    ordered = ", `order_updates=True`" if row.get("order_updates") else ""
    return f", `serialize={bool(row.get('serialize'))}`{swapped}{split}{tiles}{ordered}"


def capacity(data: dict) -> str:
    precision = data["rel_tol"]
    other = any(r.get("rel_tol", precision) != precision for r in data["rows"])
    lines = [
        f"_{_header(data)}; **simulator predictions**, search precision {precision:.0%}"
        + (" (a row searched at another says so)" if other else "")
        + "; planned: the day of the row's run, with the simulator of that day_",
        "",
        "| model | budget | largest | without LMS | with LMS | ratio | no plan past (one op's working set) | planned |",
        "|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in data["rows"]:
        base = r["without_lms"]
        ratio = f"x{r['with_lms'] / base:.2f}" if base else "-"  # two decimals: x9.98 is not x10
        bound = r.get("bound")
        if bound is None:
            bound_text = "-"
        else:
            bound_text = f"{bound} (x{bound / base:.1f})" if base else str(bound)
        model = r["model"] + _plan_options(r)
        planned = r.get("planned", "-")  # the simulator of that day
        if r.get("rel_tol", precision) != precision:
            planned += f", precision {r['rel_tol']:.1%}"
        lines.append(
            f"| {model} | {r['budget']} | {r['measure']} | {base} | {r['with_lms']} | {ratio} | {bound_text} "
            f"| {planned} |"
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


def _options_note(options: dict | None) -> str:
    return f" ({', '.join(f'{k}={v}' for k, v in sorted(options.items()))})" if options else ""


def testbed_time(data: dict) -> str:
    """Predicted against measured step time on the test bed (``benchmarks/testbed_time.py``)."""
    lines = [
        f"_{_header(data)}; median of {data['steps']} steps; tflms planned under a budget of "
        f"{data['fraction']:.0%} of the plain step's predicted peak, with the plain step's profile and the "
        "probed link_",
        "",
        "| model | batch | mode | swaps | link (to host / to device) | measured ms | predicted ms, one stream | "
        "of it, waiting for swap-ins | predicted / measured | predicted ms, a stream per inter-op thread | "
        "predicted / measured |",
        "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        link = r["link"]
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['mode']}{_options_note(r.get('options'))} | {r['swaps']} | "
            f"{link['to_host'] / 1e9:.2f} / {link['to_device'] / 1e9:.2f} GB/s, {link['latency'] * 1e3:.2f} ms "
            f"| {r['measured_ms']:,.1f} | {r['predicted_ms']:,.1f} | {r['predicted_stall_ms']:,.1f} "
            f"| {r['predicted_ms'] / r['measured_ms']:.2f} | {r['predicted_threads_ms']:,.1f} "
            f"({r['inter_op_threads']}) | {r['predicted_threads_ms'] / r['measured_ms']:.2f} |"
        )
    return "\n".join(lines)


def testbed_defaults(data: dict) -> str:
    """ResNet50 on the test bed with no option but device and host (``benchmarks/testbed_defaults.py``)."""
    lines = [
        f"_{_header(data)}; {data['options']}; one warm-up step, then the measured steps_",
        "",
        "| case | cap | batch | API | way | options | status | steady peak | predicted | swaps | median step "
        "| budget |",
        "|---|---:|---:|---|---|---|---|---:|---:|---:|---:|---|",
    ]
    for r in data["runs"]:
        options = ", ".join(f"`{k}={tuple(v) if isinstance(v, list) else v!r}`" for k, v in r["options"].items())
        peak = "-" if r["steady_peak_mib"] is None else f"{r['steady_peak_mib']:,.1f} MiB"
        predicted = "-" if r["predicted_mib"] is None else f"{r['predicted_mib']:,.1f} MiB"
        swaps = "-" if r["n_swaps"] is None else str(r["n_swaps"])
        step = "-" if r["median_step_seconds"] is None else f"{r['median_step_seconds']:.2f} s"
        lines.append(
            f"| {r['case']} | {r['cap_mib']} MiB | {r['batch']} | {r['api']} | {r['way']} | {options or '-'} "
            f"| {r['status']} | {peak} | {predicted} | {swaps} | {step} | {r['budget_text'] or '-'} |"
        )
    return "\n".join(lines + (["", data["notes"]] if data.get("notes") else []))


def _mib_number(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def _mib(n: float) -> str:
    return f"{_mib_number(n)} MiB"


def _range(values: list[float], fmt: str = "{:,.0f}", unit: str = "") -> str:
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return f"{lo}{unit}" if lo == hi else f"{lo}-{hi}{unit}"


def _step(row: dict) -> str:
    manual = ", memory optimizer `MANUAL`" if row.get("memory_optimizer") == "manual" else ""
    # A tflms step planned without the memory-aware schedule says so: rows without "serialize"
    # were measured when it was off by default (before 2026-11-25).
    unordered = row["mode"] not in ("plain", "lms_serialized") and not row.get("serialize", False)
    return (
        {
            "plain": "plain",
            "lms": "tflms",
            "lms_device_gated": "tflms, swap-ins on the device",
            "lms_recompute": "tflms, recompute",
            "lms_fenced": f"tflms, fenced (`swapout_window={FENCE_WINDOW}`)",
            "lms_serialized": "tflms, serialized (`serialize=True`)",
            "lms_unordered": "tflms",
            "lms_split_sums": "tflms, `split_sums=True`",
            "lms_ordered_updates": "tflms",
        }[row["mode"]]
        + (", `serialize=False`" if unordered else "")
        + (", `order_updates=True`" if row.get("order_updates") else "")
        + manual
    )


def _auto(row: dict) -> str:
    """Marks a row measured as tflms calls its steps, in a table with rows measured otherwise."""
    return ", *tflms at `MANUAL`*" if row.get("memory_optimizer") == "auto" else ""


def _model(row: dict) -> str:
    """The model's name, with its input size when it is not the test bed's default."""
    size = row.get("size")
    return row["model"] if size in (None, MODELS[row["model"]][1]) else f"{row['model']} {size}²"


def _memory_optimizer_note(rows: list[dict]) -> str:
    """What Grappler's memory-optimizer level the measured steps ran at (``measure_step``'s
    ``memory_optimizer``; rows without it were measured before tflms called its steps at ``MANUAL``)."""
    levels = {r.get("memory_optimizer", "default") for r in rows}
    if levels == {"auto"}:
        return (
            "; tflms steps called at Grappler's memory-optimizer level `MANUAL`, as tflms calls them, "
            "plain steps at TensorFlow's default"
        )
    if levels == {"default"}:
        return (
            "; every step at TensorFlow's default memory-optimizer level (measured before tflms called "
            "its steps at `MANUAL`)"
        )
    if "auto" in levels:
        return (
            "; rows marked *tflms at `MANUAL`* called the tflms steps at Grappler's memory-optimizer level "
            "`MANUAL`, as tflms calls them, and plain steps at TensorFlow's default; the other rows ran "
            + ("at `MANUAL` where marked, else " if "manual" in levels else "")
            + "at TensorFlow's default"
        )
    return "; steps marked `MANUAL` at that memory-optimizer level, the others at TensorFlow's default"


def _measured_header(data: dict) -> str:
    where = "the two-process test bed" if data.get("device", "test bed") == "test bed" else data["device"]
    return (
        f"_{_header(data)}; **measured** on {where} ({len(data['rows'][0]['runs'])} fresh "
        f"processes per model and batch; steady-state peak: the largest per-step peak of {data['steps']} steps "
        f"after {data['warmup']} warm-up step){_memory_optimizer_note(data['rows'])}"
    )


def _within_10_percent(peaks: list[int]) -> str:
    """The figures within ±10 % of every one of ``peaks`` (bytes): from the largest / 1.1 to the
    smallest x 1.1, in whole MiB rounded inwards (one decimal where no whole MiB is in it), or
    "none"."""
    low, high = max(peaks) / 1.1 / 2**20, min(peaks) * 1.1 / 2**20
    if low > high:
        return "none"
    if math.ceil(low) <= math.floor(high):
        return _range([math.ceil(low), math.floor(high)], unit=" MiB")
    return _range([math.ceil(low * 10) / 10, math.floor(high * 10) / 10], "{:.1f}", " MiB")


def simulator_accuracy(data: dict) -> str:
    # Runs since 2026-11-26 also keep every step's peak: then the table has their range, their
    # median and the figures within ±10 % of all of them (_within_10_percent) too.
    steps = all("step_peaks" in r for r in data["rows"] if r["runs"])
    extra = " every step (all runs) | median step | median / predicted | within ±10 % of every step |" if steps else ""
    lines = [
        _measured_header(data)
        + (
            ", every step's peak after the warm-up, all runs together (range and median), and the range of "
            "figures that would be within ±10 % of every one of those steps"
            if steps
            else ""
        )
        + " vs **predicted** by the simulator_",
        "",
        "| model | batch | step | measured steady peak (runs) | first step | predicted peak | measured / predicted |"
        + extra,
        "|---|---:|---|---:|---:|---:|---:|" + ("---:|---:|---:|---:|" if steps else ""),
    ]
    for r in data["rows"]:
        if not r["runs"]:
            lines.append(
                f"| {_model(r)} | {r['batch']} | {_step(r)} | (failed) | | | |" + (" | | | |" if steps else "")
            )
            continue
        mib = [p / 2**20 for p in r["runs"]]
        ratios = [p / r["predicted"] for p in r["runs"]]
        line = (
            f"| {_model(r)} | {r['batch']} | {_step(r)} | {_range(mib, unit=' MiB')} "
            f"| {_mib(max(r['first_peaks']))} | {_mib(r['predicted'])} | {_range(ratios, '{:.2f}')} |"
        )
        if steps:
            every = [p for run in r["step_peaks"] for p in run]
            median = statistics.median(every)
            within = _within_10_percent(every)
            line += (
                f" {_range([p / 2**20 for p in every], unit=' MiB')} | {_mib(median)} | {median / r['predicted']:.2f} "
                f"| {within} |"
            )
        lines.append(line)
    return "\n".join(lines)


def testbed_memory(data: dict) -> str:
    """tflms / plain per run, from the simulator-accuracy JSON (both steps ran in each process)."""
    lines = [
        _measured_header(data) + "; both steps from the same weights in each process_",
        "",
        "| model | batch | step | plain steady peak | its steady peak | / plain (per run) |",
        "|---|---:|---|---:|---:|---:|",
    ]
    plain = {(r["model"], r["batch"]): r for r in data["rows"] if r["mode"] == "plain"}
    for r in data["rows"]:
        base = plain.get((r["model"], r["batch"]))
        if r["mode"] == "plain" or base is None or not r["runs"] or len(base["runs"]) != len(r["runs"]):
            continue
        ratios = [p / b for p, b in zip(r["runs"], base["runs"])]
        lines.append(
            f"| {r['model']} | {r['batch']} | {_step(r)} | {_range([p / 2**20 for p in base['runs']], unit=' MiB')} "
            f"| {_range([p / 2**20 for p in r['runs']], unit=' MiB')} | {_range(ratios, '{:.2f}')} |"
        )
    return "\n".join(lines)


def _peaks(row: dict) -> str:
    return _range([p / 2**20 for p in row["runs"]], unit=" MiB")


def recompute(data: dict) -> str:
    """Swaps only against recompute, from a simulator_accuracy run with ``:recompute`` cases."""
    lines = [
        _measured_header(data) + "; the three steps from the same weights in each process, vs **predicted**; "
        "link and recompute times are the plans' predictions_",
        "",
        "| model | batch | plain | swaps only | with recompute | predicted (swaps only; recompute) "
        "| swapped out per step | recomputed | predicted link time | predicted recompute time "
        "| measured step time (plain; swaps only; recompute) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by = {(r["model"], r["batch"], r["mode"]): r for r in data["rows"]}
    for (model, batch, mode), rec in by.items():
        if mode != "lms_recompute":
            continue
        plain, lms = by[model, batch, "plain"], by[model, batch, "lms"]
        if not (plain["runs"] and lms["runs"] and rec["runs"]):
            lines.append(f"| {model} | {batch} | (failed) | | | | | | | | |")
            continue
        lines.append(
            f"| {model} | {batch} | {_peaks(plain)} | {_peaks(lms)} | {_peaks(rec)} "
            f"| {_mib(lms['predicted'])}; {_mib(rec['predicted'])} "
            f"| {_mib(lms['swapped_bytes'])} -> {_mib(rec['swapped_bytes'])} "
            f"| {rec['n_recomputes']} tensors, {_mib(rec['recomputed_bytes'])} "
            f"| {lms['link_seconds'] * 1e3:.1f} -> {rec['link_seconds'] * 1e3:.1f} ms "
            f"| {rec['recompute_seconds'] * 1e3:.2f} ms "
            f"| {'; '.join(_range(r['step_seconds'], '{:.2f}', ' s') for r in (plain, lms, rec))} |"
        )
    return "\n".join(lines)


def testbed_capacity(data: dict) -> str:
    lines = [
        f"_{_header(data)}; **measured** on the two-process test bed under a real cap, tflms autotuned to "
        f"budget = fraction x cap; search precision {data['rel_tol']:.0%}; measured on: the row's date, and the "
        "measured process's priority below the host worker's (`testbed.DEVICE_NICE`; 0: equal); predicted "
        "columns: the simulator (`tflms.max_batch_size`, the step traced per batch as the measured process traces it) "
        f"for a budget of the cap; predicted bound: the largest batch whose `Simulator.floor` (variables and one "
        f"op's working set) fits the cap, past which no plan fits{_memory_optimizer_note(data['rows'])}_",
        "",
        "| model | size | cap | budget | largest batch, plain | largest batch, tflms | ratio | predicted plain "
        "| predicted tflms | predicted bound | measured on |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in data["rows"]:
        ratio = f"x{r['lms'] / r['plain']:.1f}" if r["plain"] else "-"
        fraction = r.get("fraction", data.get("fraction"))
        window = r.get("swapout_window")
        model = f"{r['model']}, fenced (`swapout_window={window}`)" if window else r["model"]
        model += _plan_options(r)
        lines.append(
            f"| {model} | {r['size']} | {_mib(r['cap'])} | {fraction:g} x cap | {r['plain']} | {r['lms']} "
            f"| {ratio} | {r['predicted_plain']} | {r['predicted_lms']} | {r.get('predicted_bound', '-')} "
            f"| {r['date']}, nice {r['device_nice']}{_auto(r)} |"
        )
    return "\n".join(lines)


def _chunks_requested(d: dict | None) -> str:
    """``'<chunks> / <requested>'`` MiB of a peak record (``in_use`` or ``peak``), '' when absent."""
    if not d:
        return ""
    return f"{_mib_number(d['in_use'] if 'in_use' in d else d['peak'])} / {_mib_number(d['requested'])}"


#: The phases ``tflms.testing.measure.anatomy_step`` sorts buffers into, in table order.
PHASES = ("forward", "backward", "update", "swap", "other")


def peak_anatomy(data: dict) -> str:
    phases = PHASES
    mib = _mib_number
    lines = [
        f"_{_header(data)}; **measured** on the two-process test bed (one fresh process per row: an "
        "unprofiled step's peak, then a profiled step's allocator events and kernel start times), vs **predicted** "
        "(the simulator, in its own order and in the order the profiled step started the ops); MiB; peaks include "
        "the variables, as allocator chunks / requested bytes; allocator replay: the simulator's allocator "
        "emulation on the profiled step's own allocations (chunks); phase columns: measured allocator chunks / "
        f"predicted requested bytes at each side's peak, variables left out{_memory_optimizer_note(data['rows'])}_",
        "",
        "| model | batch | step | unprofiled peak | profiled peak | allocator replay | predicted peak "
        "| predicted, recorded order | peak in | " + " | ".join(phases) + " |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|" + "---:|" * len(phases),
    ]
    for r in data["rows"]:
        prof, pred = r["profiled"], r["predicted"]
        rec = r.get("recorded_order")
        replay = mib(r["replayed"]["peak"]) if "replayed" in r else ""
        cells = " | ".join(f"{mib(prof['by_phase'].get(p, 0))} / {mib(pred['by_phase'].get(p, 0))}" for p in phases)
        lines.append(
            f"| {r['model']} | {r['batch']} | {_step(r)} | {mib(r['measured_peak'])} "
            f"| {_chunks_requested(prof)} | {replay} | {_chunks_requested(pred)} "
            f"| {_chunks_requested(rec)} | {prof['op_phase']} / {pred['op_phase']} | {cells} |"
        )
    return "\n".join(lines)


def _peak_cells(r: dict) -> str:
    """A gpu.py run's measured peak, predicted peak and their ratio, as table cells."""
    return (
        f"{_mib(r['measured_peak_bytes'])} | {_mib(r['predicted_peak_bytes'])} "
        f"| {r['measured_peak_bytes'] / r['predicted_peak_bytes']:.2f}"
    )


def _link_bytes(r: dict) -> str:
    """A gpu.py run's bytes over the link per step, as a table cell ("-" without swaps)."""
    return f"{r['link_bytes_per_step'] / 1e9:.1f} GB" if r["link_bytes_per_step"] else "-"


def _link_cells(r: dict) -> str:
    """A gpu.py run's bytes over the link per step and the rate that makes over the step, as table cells."""
    rate = f"{r['link_GBps_over_step']:.0f} GB/s" if r["link_bytes_per_step"] else "-"
    return f"{_link_bytes(r)} | {rate}"


def gpu(data: dict) -> str:
    """benchmarks/gpu.py's JSON: the largest batch under the cap, then each timed or uncapped step."""
    cap, mb = data["cap_bytes"], 2**20

    def tried(mode: str) -> str:
        runs = sorted((r for r in data["search"] if r["mode"] == mode), key=lambda r: r["batch"])
        return ", ".join(
            f"{r['batch']}"
            if r["ok"]
            else f"~~{r['batch']}~~" + (f" ({_failure(r)})" if r.get("start_failed") or r.get("timed_out") else "")
            for r in runs
        )

    name = data["gpu"].get("device_name", "GPU")
    lines = [
        f"{data['date']}, {name}, TensorFlow {data['tensorflow']}; {data['model']} {data['image_size']}², Adam, "
        f"measured (`get_memory_info` peak of the steady steps):",
        "",
        f"| under a real {cap / mb:,.0f} MiB cap | largest batch that trains | batches tried (~~out of memory~~) |",
        "|---|---:|---|",
        f"| plain | {data['max_batch_plain']} | {tried('plain')} |",
        f"| tflms, `budget` = {data['budget_fraction']:g} × cap | {data['max_batch_budget']} | {tried('budget')} |",
        "",
        "| step | batch | cap | measured peak | predicted | measured / predicted | step time | images/s "
        "| over the link per step | link rate over the step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    step = {"plain": "plain", "tflms": "tflms, default options", "budget": "tflms, `budget`"}
    for r in data["timed"] + data.get("uncapped", []):
        label = step.get(r["mode"]) or f"tflms, fenced (`swapout_window={r.get('swapout_window')}`)"
        lines.append(
            f"| {label} | {r['batch']} | {r.get('cap_bytes', cap) / mb:,.0f} MiB | {_peak_cells(r)} "
            f"| {r['step_ms']:.0f} ms "
            f"| {r['images_per_s']:.0f} | {_link_cells(r)} |"
        )
    bw, ref = data["bandwidth"], data.get("bandwidth_reference", {})
    lines += [
        "",
        f"Copies of 256 MiB: TensorFlow eager, pageable host memory, {bw['host_to_device_GBps']:g} GB/s to the "
        f"device and {bw['device_to_host_GBps']:g} GB/s back"
        + (
            f"; PyTorch on the same machine, pinned host memory, {ref['pinned_host_to_device_GBps']:g} and "
            f"{ref['pinned_device_to_host_GBps']:g} GB/s."
            if ref
            else "."
        ),
    ]
    return "\n".join(lines)


def _variant_label(r: dict) -> str:
    """A gpu.py run's variant in words (``tflms/w2`` -> ``tflms, `swapout_window=2```)."""
    mode, *mods = r["variant"].split("/")
    if mode == "plain":
        return "plain"
    words = ["tflms, `budget`" if mode == "budget" else "tflms"]
    for m in mods:
        if m == "w0":
            words.append("no fences")
        elif m.startswith("w"):
            words.append(f"`swapout_window={m[1:]}`")
        elif m.startswith("p"):
            words.append(f"`kernel_tracker_max_pending={m[1:]}`")
        elif m in _OPTION_FLAGS:
            words.append(f"`{_OPTION_FLAGS[m]}`")
    return ", ".join(words)


def _gpu_option_flags() -> dict[str, str]:
    """gpu.py's one-letter modifiers (``gpu.OPTION_FLAGS``): gpu.py is a script beside this one, not
    a module on the path, and imports nothing heavy at its top."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tflms_gpu_benchmark", Path(__file__).with_name("gpu.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.OPTION_FLAGS


#: gpu.py's one-letter modifiers: an option that is off by default, turned on.
_OPTION_FLAGS = _gpu_option_flags()


def gpu_fences(data: dict) -> str:
    """benchmarks/gpu.py's runs of 2026-11-26 (fences vs the executor running ahead of the link)."""
    first, second = data["runs"]
    mb = 2**20

    lines = [
        f"{data['date']}, {data['gpu'].get('device_name', 'GPU')}, TensorFlow {data['tensorflow']}; "
        f"{data['model']} {data['image_size']}², Adam; **measured** (`get_memory_info` peak of the steady steps) vs "
        "**predicted** (simulator)",
        "",
        f"Side by side ({len(first['compare'])} processes on the GPU, each under a "
        f"{first['compare_cap_bytes'] / mb:,.0f} MiB cap), batch {first['compare'][0]['batch']}; the step times "
        "are of processes sharing the GPU and its link:",
        "",
        "| step | fences | measured peak | predicted | measured / predicted | step time, shared |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in first["compare"]:
        lines.append(f"| {_variant_label(r)} | {r['fences']} | {_peak_cells(r)} | {r['step_ms']:.0f} ms |")
    lines += [
        "",
        f"Alone on the GPU, each under a {first['timed'][0]['cap_bytes'] / mb:,.0f} MiB cap (two runs, one after the "
        "other):",
        "",
        "| step | batch | measured peak | predicted | measured / predicted | step time | images/s "
        "| over the link per step | link rate over the step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in first["timed"] + second["timed"]:
        lines.append(
            f"| {_variant_label(r)} | {r['batch']} | {_peak_cells(r)} | {r['step_ms']:.0f} ms "
            f"| {r['images_per_s']:.0f} | {_link_cells(r)} |"
        )
    lines += [
        "",
        f"Under a real {first['cap_bytes'] / mb:,.0f} MiB cap, side by side (~~failed~~):",
        "",
        "| step | budget | batch | measured peak | predicted | measured / predicted | measured / budget |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run in (first, second):
        for r in sorted(run["search"], key=lambda r: (r["mode"] != "plain", r["batch"])):
            budget = f"{run['budget_bytes'] / mb:,.0f} MiB" if r["mode"] == "budget" else "-"
            if not r["ok"]:
                why = "out of memory" if r.get("oom") else _failure(r)
                lines.append(f"| {_variant_label(r)} | {budget} | ~~{r['batch']}~~ | {why} | | | |")
                continue
            of_budget = f"{r['measured_peak_bytes'] / run['budget_bytes']:.2f}" if r["mode"] == "budget" else "-"
            lines.append(f"| {_variant_label(r)} | {budget} | {r['batch']} | {_peak_cells(r)} | {of_budget} |")
    return "\n".join(lines)


def gpu_runs(data: dict) -> str:
    """Several benchmarks/gpu.py runs of one model (``{"runs": [...]}``): the largest batch under the
    cap over all their searches, the steps that ran alone, then every search attempt."""
    runs, mb = data["runs"], 2**20
    first = runs[0]
    search = [r for run in runs for r in run["search"]]

    # One row per variant searched: plain, budget, then the other budget variants as they first appear.
    variants = sorted(dict.fromkeys(r["variant"] for r in search), key=lambda v: (v != "plain", v != "budget"))
    order = {v: i for i, v in enumerate(variants)}

    def tried(variant: str) -> str:
        cells = []
        for r in sorted((r for r in search if r["variant"] == variant), key=lambda r: r["batch"]):
            note = "" if r["ok"] or r.get("oom") else f" ({_failure(r).removesuffix(' (planner)')})"
            cells.append(f"{r['batch']}" if r["ok"] else f"~~{r['batch']}~~{note}")
        return ", ".join(cells)

    def largest(variant: str) -> int:
        return max((r["batch"] for r in search if r["variant"] == variant and r["ok"]), default=0)

    def row_label(variant: str) -> str:
        if variant == "plain":
            return "plain"
        rest = _variant_label({"variant": variant}).removeprefix("tflms, `budget`")
        return f"tflms, `budget` = {first['budget_fraction']:g} × cap{rest}"

    alone = [r for run in runs for r in run.get("timed", []) if r["ok"]]
    alone += [r for run in runs if len(run.get("compare", [])) == 1 for r in run["compare"] if r["ok"]]
    alone.sort(key=lambda r: (r["batch"], r["mode"] != "plain", r.get("fences", 0)))
    lines = [
        f"{data['date']}, {data['gpu'].get('device_name', 'GPU')}, TensorFlow {data['tensorflow']}; "
        f"{data['model']} {data['image_size']}², Adam; **measured** (`get_memory_info` peak of the steady steps) vs "
        "**predicted** (simulator)",
        "",
        f"| under a real {first['cap_bytes'] / mb:,.0f} MiB cap | largest batch that trains "
        "| batches tried (~~failed~~: out of memory unless said) |",
        "|---|---:|---|",
        *(f"| {row_label(v)} | {largest(v)} | {tried(v)} |" for v in variants),
    ]
    if alone:
        lines += [
            "",
            f"Alone on the GPU, each under the {first['cap_bytes'] / mb:,.0f} MiB cap:",
            "",
            "| step | batch | fences | measured peak | predicted | measured / predicted | step time | images/s "
            "| over the link per step | link rate over the step |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
    for r in alone:
        lines.append(
            f"| {_variant_label(r)} | {r['batch']} | {r.get('fences', 0)} | {_peak_cells(r)} | {r['step_ms']:.0f} ms "
            f"| {r['images_per_s']:.0f} | {_link_cells(r)} |"
        )
    lines += [
        "",
        "The search attempts that trained, side by side (step times of processes sharing the GPU and its link):",
        "",
        "| step | batch | fences | measured peak | predicted | measured / predicted | measured / budget "
        "| step time, shared | over the link per step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted((r for r in search if r["ok"]), key=lambda r: (order[r["variant"]], r["batch"])):
        of_budget = f"{r['measured_peak_bytes'] / r['budget_bytes']:.2f}" if r["mode"] == "budget" else "-"
        lines.append(
            f"| {_variant_label(r)} | {r['batch']} | {r.get('fences', 0)} | {_peak_cells(r)} | {of_budget} "
            f"| {r['step_ms']:.0f} ms | {_link_bytes(r)} |"
        )
    return "\n".join(lines)


def gpu_layout(data: dict) -> str:
    """Probes of 2026-11-27 with Grappler's layout optimizer on and off (``{"calls": [...]}``, each a
    set of gpu.py attempts side by side under the same cap)."""
    mb = 2**20

    def where(r: dict) -> str:
        if r["ok"]:
            return "trained"
        if not r.get("oom"):
            return _failure(r)
        node = r.get("failed_at")
        return f"out of memory at `{node.replace('resnet50_1/', '')}`" if node else "out of memory"

    lines = [
        f"{data['date']}, {data['gpu'].get('device_name', 'GPU')}, TensorFlow {data['tensorflow']}; "
        f"{data['model']} {data['image_size']}², Adam, each attempt under a real {data['cap_bytes'] / mb:,.0f} MiB "
        f"cap, budget {data['budget_fraction']:g} × cap; **measured** (`get_memory_info`: peak of the steady steps, "
        "and of the two warm-up steps) vs **predicted** (simulator)",
        "",
        "| call | layout optimizer | cuDNN autotune | step | batch | result | measured peak | warm-up peak "
        "| predicted | measured / predicted |",
        "|---:|---|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for call in data["calls"]:
        head = f"| {call['call']} | {call['layout_optimizer']} | {'on' if call['cudnn_autotune'] else 'off'}"
        for r in call["attempts"]:
            predicted = r.get("predicted_peak_bytes") or r.get("planned", {}).get("predicted_peak_bytes")
            if r["ok"]:
                ratio = r["measured_peak_bytes"] / r["predicted_peak_bytes"]
                cells = (
                    f"{_mib(r['measured_peak_bytes'])} | {_mib(r['warmup_peak_bytes'])} "
                    f"| {_mib(r['predicted_peak_bytes'])} | {ratio:.2f}"
                )
            else:
                cells = f"- | - | {_mib(predicted) if predicted else '-'} | -"
            batch = str(r["batch"]) if r["ok"] else f"~~{r['batch']}~~"
            lines.append(f"{head} | {_variant_label(r)} | {batch} | {where(r)} | {cells} |")
    return "\n".join(lines)


def _failure(r: dict) -> str:
    """Why a gpu.py attempt failed, in a few words."""
    text = " ".join(r.get("error", []))
    if r.get("timed_out"):
        return "timed out"
    if r.get("start_failed"):
        return "never ran on the GPU (see its error)"
    if "BudgetError" in text:
        return "no plan fits the budget (planner)"
    return (
        "error at `" + text.split("{{node ")[1].split("}}")[0].rsplit("/", 1)[-1] + "` (not labelled out of memory)"
        if "{{node " in text
        else "error"
    )


def offload_capacity(data: dict) -> str:
    """The GPT family under one cap, plain and ``offload="optimizer"`` (``benchmarks/offload_capacity.py``)."""
    lines = [
        f"_{data['model']}, batch {data['batch']}, sequence {data['seq']}, cap {data['cap']}; the peak is the "
        "largest measured step after the warm-up_",
        "",
        "| depth | parameters | way | cap | status | peak | predicted | step |",
        "|---:|---:|---|---|---|---:|---:|---:|",
    ]
    for r in data["rows"]:
        way = "plain" if r["offload"] is None else f"`offload={r['offload']!r}`"
        cap = "none" if r["cap_bytes"] is None else _mib(r["cap_bytes"])
        params = f"{r['weight_bytes'] / 4 / 1e6:,.1f} M" if "weight_bytes" in r else "-"
        peak = _mib(r["peak"]) if r.get("peak") else "-"
        predicted = _mib(r["predicted"]) if r.get("predicted") else "-"
        step = f"{r['step_seconds'] * 1000:,.0f} ms" if r.get("step_seconds") else "-"
        lines.append(f"| {r['depth']} | {params} | {way} | {cap} | {r['status']} | {peak} | {predicted} | {step} |")
    lines += ["", *(f"- {note}" for note in data.get("notes", []))]
    return "\n".join(lines)


def placement_capacity(data: dict) -> str:
    """Largest side or batch per device count (``benchmarks/placement_capacity.py``), all predicted."""
    lines = [
        "| model | budget per device | measure | devices | way | largest | x plain |",
        "|---|---|---|---:|---|---:|---:|",
    ]
    for r in data["rows"]:
        plain = r.get("plain_there")
        ratio = r.get("ratio_to_plain") or (r["largest"] / plain if plain else None)
        way = r["way"] + (f" (planned {r['planned']})" if r.get("planned") else "")
        lines.append(
            f"| {r['model']} | {r['budget']} | {r['measure']} | {r['devices']} | {way} | {r['largest']:,} "
            f"| {'-' if ratio is None else f'{ratio:.2f}'} |"
        )
    notes = data.get("notes")
    return "\n".join(lines + (["", notes] if isinstance(notes, str) else []))


#: The rows of the two-device test bed's tables, by the job's mode.
PLACEMENT_WAYS = {
    "plain": "plain, one device",
    "placed": "placed on 2 devices",
    "placer": "placed on 2 devices by the placer",
    "even": "split evenly by layer count on 2 devices",
}


def placement_testbed(data: dict) -> str:
    """The two-device test bed: plain uncapped, plain capped, placed capped (``benchmarks/placement_testbed.py``)."""
    lines = [
        f"_{'the zoo' + chr(39) + 's ' if data['model'] == 'cnn' else 'the '}{data['model']} step, {data['size']} px, "
        f"batch {data['batch']}, Adam; peaks: the largest of the "
        "steps, each device's from its own allocator_",
        "",
        "| step | cap per device | status | device 0 | device 1 | predicted |",
        "|---|---|---|---:|---:|---|",
    ]
    for r in data["rows"]:
        peaks = r.get("peak_mib_per_device") or []
        cells = [f"{p:,.1f} MiB" if p else "-" for p in peaks] or ["-", "-"]
        predicted = ", ".join(_mib(p) for p in r["predicted"]) if r.get("predicted") else "-"
        cap = f"{r['cap_mib']} MiB" if r["cap_mib"] else "none"
        way = PLACEMENT_WAYS.get(r["mode"], r["mode"])
        lines.append(f"| {way} | {cap} | {r['status']} | {cells[0]} | {cells[1]} | {predicted} |")
    lines += ["", *(f"- {note}" for note in data.get("notes", []))]
    return "\n".join(lines)


def horovod_overlap(data: dict) -> str:
    """Per rank and allreduce group: when its gradients were ready and its averaged gradients first read."""
    lines = [
        f"_{data['model']}; {data['ranks']} ranks, allreduce groups of at most {data['group_mib']:g} MiB_",
        "",
        "| rank | backward pass | group (gradients) | ready | averaged gradients first read |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        for k, g in enumerate(r["groups"]):
            backward = f"{r['backward_ms']:.0f} ms" if k == 0 else ""
            read = "-" if g["averaged_read_ms"] is None else f"{g['averaged_read_ms']:.0f} ms"
            lines.append(f"| {r['rank'] if k == 0 else ''} | {backward} | {k + 1} ({g['gradients']}) | "
                         f"{g['ready_ms']:.0f} ms | {read} |")  # fmt: skip
    lines += ["", *(f"- {note}" for note in data.get("notes", []))]
    return "\n".join(lines)


def ecosystem_testbed(data: dict) -> str:
    """A library's model trained under a real cap, plain and with ``LMSCallback`` (:mod:`tflms.testing.jobs`)."""
    lines = [
        f"_{data['model']}, batch {data['batch']}; each way one fresh measured process; peaks per step, the "
        "steady peak the largest after the first step_",
        "",
        "| way | cap | status | peak per step | steady peak | predicted | predicted plain | measured / predicted "
        "| swaps | budget | replans | losses |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for r in data["rows"]:
        oom = r.get("oom")
        status = r["status"]
        if oom:
            status += (
                f" (`{oom['op'].removeprefix('StatefulPartitionedCall/')}` asked "
                f"{oom['requested'] / 2**20:,.1f} MiB with "
                f"{oom['in_use'] / 2**20:,.1f} MiB in use, largest free block {oom['largest_free'] / 2**20:,.1f} MiB)"
            )
        peaks = ", ".join(f"{p:,.1f}" for p in r["peaks_mib"]) + " MiB" if r.get("peaks_mib") else "-"
        steady = f"{r['steady_peak_mib']:,.1f} MiB" if r.get("steady_peak_mib") is not None else "-"
        predicted = f"{r['predicted_mib']:,.1f} MiB" if r.get("predicted_mib") is not None else "-"
        plain = f"{r['predicted_plain_mib']:,.1f} MiB" if r.get("predicted_plain_mib") is not None else "-"
        ratio = f"{r['measured_over_predicted']:.2f}" if r.get("measured_over_predicted") is not None else "-"
        swaps = f"{r['n_swaps']} ({r['swapped_mib']:,.1f} MiB)" if r.get("n_swaps") is not None else "-"
        replans = "; ".join(
            f"{p['old_budget'] / 2**20:,.1f} -> {p['budget'] / 2**20:,.1f} MiB ({p['why']})"
            for p in r.get("replans") or []
        )
        losses = ", ".join(f"{x:.4f}" for x in r.get("losses") or []) or "-"
        lines.append(
            f"| {r['way']} | {r['cap_mib']} MiB | {status} | {peaks} | {steady} | {predicted} | {plain} | {ratio} "
            f"| {swaps} | {r.get('budget_text') or '-'} | {replans or '-'} | {losses} |"
        )
    lines += ["", *(f"- {note}" for note in data.get("notes", []))]
    return "\n".join(lines)


#: :mod:`tflms.testing.jobs`'s jobs of the recovery table: the model, and its batch by default.
RECOVERY_JOBS = {"resnet_steps": ("ResNet50 96²", 48), "twoinput_fit": ("two-input model 128²", 32)}
#: The steps of those jobs, by ``mode`` (``resnet_steps``) or ``lms`` (``twoinput_fit``).
RECOVERY_STEPS = {
    "plain": "plain `tf.function`",
    "function": "`tflms.function`",
    "plain_fit": "plain `model.fit`",
    "fit": "`model.fit` + `LMSCallback`",
    False: "plain `model.fit`",
    True: "`model.fit` + `LMSCallback`",
}


def _mib_field(d: dict, key: str) -> float | str:
    """``d[key]`` in MiB, from ``key`` (bytes) or ``key_mib``; a string (``'plain'``, ``'auto'``) as it is."""
    if f"{key}_mib" in d:
        return d[f"{key}_mib"]
    return d[key] if isinstance(d[key], str) else d[key] / 2**20


def _recovery_row(r: dict, uncapped: dict) -> str:
    kwargs, v = r["kwargs"], r.get("value") or {}
    model, default_batch = RECOVERY_JOBS.get(r["job"], (r["job"], None))
    batch = kwargs.get("batch", default_batch)
    step = RECOVERY_STEPS[kwargs["mode"] if "mode" in kwargs else kwargs.get("lms")]
    if kwargs.get("budget"):
        step += f", `budget={kwargs['budget']!r}`"
    failed = []
    for p in v.get("replans") or []:
        budget = _mib_field(p, "old_budget")
        budget = f"{budget:,.1f} MiB" if isinstance(budget, float) else budget
        failed.append(f"budget {budget}: {_mib_field(p, 'failed_peak'):,.1f} MiB")
    if (v.get("replans") or [{}])[-1].get("budget") == "plain":
        failed.append("the plain step")
    plan = v.get("plan") or (v.get("plans") or [None])[-1]
    if v.get("error"):
        result = "out of memory in every way tried"
    elif r["status"] != "ok":
        result = f"{r['status']}: {r['error']}"
    elif r.get("error"):  # the job returned, but the step did not train
        result = f"did not train: {r['error']}"
    else:
        result = "trained" if v else "trained (figures not kept)"
    ran = "-"
    if plan and v.get("losses"):
        predicted = plan["predicted_mib"] if "predicted_mib" in plan else plan["predicted"] / 2**20
        ran = f"{plan['n_swaps']} swaps, {predicted:,.1f} MiB predicted"
        if plan.get("reason"):
            ran += f" ({plan['reason']})"
    reference = uncapped.get((r["job"], batch, "model.fit" in step))
    if r["cap"] is None:
        against = "reference"
    elif v.get("state") and v["state"] == v.get("initial"):
        against = "variables and optimizer state restored to their initial values"
    elif reference is None or not v.get("losses"):
        against = "-"
    else:
        kinds = (("losses", "losses"), ("weights", "weights"), ("optimizer state", "state"))
        same = [what for what, key in kinds if key in v and key in reference and v[key] == reference[key]]
        differ = [what for what, key in kinds if key in v and key in reference and v[key] != reference[key]]
        parts = ([", ".join(same) + " identical"] if same else []) + ([", ".join(differ) + " differ"] if differ else [])
        against = "; ".join(parts) or "-"
    peaks = ", ".join(f"{p:,.1f}" for p in v["peaks_mib"]) + " MiB" if v.get("peaks_mib") else "-"
    return (
        f"| {model} | {batch} | {step} | {r['cap'] or 'none'} | {r.get('run') or '-'} | {result} | {peaks} "
        f"| {'; '.join(failed) or '-'} | {ran} | {against} |"
    )


def recovery_testbed(data: dict) -> str:
    """Recovery from an out-of-memory step, and oneDNN's kernels against TensorFlow's own
    (``benchmarks/recovery_testbed.py``)."""
    kernels = [r for r in data["rows"] if r["part"] == "onednn"]
    lines = [
        f"_{data['source']}; {data['warmup']} warm-up step, then {data['steps']} measured; `{data['command']}`_",
        "",
        "oneDNN's kernels against TensorFlow's own, no cap (each row a fresh measured process):",
        "",
        "| model | batch | step | kernels | status | peak per step (warm-up first) | steady peak | predicted "
        "| measured / predicted | median step | process |",
        "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in kernels:
        step = "plain" if r["mode"] == "plain" else f"tflms ({r['n_swaps']} swaps)"
        lines.append(
            f"| {r['model']} {r['size']}² | {r['batch']} | {step} "
            f"| {'oneDNN' if r['onednn'] else 'TensorFlow (Eigen)'} | {r['status']} "
            f"| {', '.join(f'{p:,.1f}' for p in r['peaks_mib'])} MiB | {r['peak_mib']:,.1f} MiB "
            f"| {r['predicted_mib']:,.1f} MiB | {r['peak'] / r['predicted']:.2f} | {r['step_seconds']:.2f} s "
            f"| {r['process_seconds']:.0f} s |"
        )
    recovery = [r for r in data["rows"] if r["part"] == "recovery"]
    # The uncapped runs of each job and batch: what a recovered run should end with.
    uncapped = {}
    for r in recovery:
        if r["cap"] is None and r.get("value"):
            kwargs = r["kwargs"]
            batch = kwargs.get("batch", RECOVERY_JOBS.get(r["job"], (None, None))[1])
            fit = "model.fit" in RECOVERY_STEPS[kwargs["mode"] if "mode" in kwargs else kwargs.get("lms")]
            uncapped.setdefault((r["job"], batch, fit), r["value"])
    lines += [
        "",
        "Recovery under a real cap (each row one fresh process; plans that ran out of memory: the budget "
        "planned for and the plan's predicted peak):",
        "",
        "| model | batch | step | cap | run | result | peak per step | plans that ran out of memory "
        "| plan that trained | against the uncapped plain run |",
        "|---|---:|---|---|---|---|---:|---|---|---|",
        *(_recovery_row(r, uncapped) for r in recovery),
    ]
    return "\n".join(lines + (["", data["notes"]] if data.get("notes") else []))


def margin_testbed(data: dict) -> str:
    """The learned margin of ``budget="auto"`` per model (``benchmarks/margin_testbed.py``)."""
    lines = [
        f"_{data['source']}; cap {data['cap_fraction']} x the plain step's predicted peak; {data['steps']} steps; "
        f"`{data['command']}`_",
        "",
        "| model | batch | cap | plain predicted | first budget | plan predicted | swaps | peak per step "
        "| measured / predicted | re-plans | result |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---|---|",
    ]
    for r in data["rows"]:
        plans, peaks = r.get("plans") or [], r.get("peaks") or []
        first = plans[0] if plans else None
        replans = "; ".join(
            f"{'learned' if x['failed_peak'] is None else 'out of memory'}: "
            f"{_mib(x['old_budget']) if x['old_budget'] else 'none'} -> "
            f"{x['budget'] if isinstance(x['budget'], str) else _mib(x['budget'])}"
            for x in r.get("replans") or []
        )
        result = "trained" if r["status"] == "ok" else f"{r['status']}: every way tried ran out of memory"
        lines.append(
            f"| {r['model']} | {r['batch']} | {_mib(r['cap']) if r.get('cap') else '-'} "
            f"| {_mib(r['predicted_plain']) if r.get('predicted_plain') else '-'} "
            f"| {_mib(first['budget']) if first else '-'} | {_mib(first['predicted']) if first else '-'} "
            f"| {first['swaps'] if first else '-'} | {', '.join(f'{p / 2**20:,.1f}' for p in peaks) or '-'} "
            f"| {max(peaks) / first['predicted']:.2f} | {replans or '-'} | {result} |"
            if first and peaks
            else f"| {r['model']} | {r['batch']} | {_mib(r['cap']) if r.get('cap') else '-'} "
            f"| {_mib(r['predicted_plain']) if r.get('predicted_plain') else '-'} | - | - | - | - | - | - | {result} |"
        )
    return "\n".join(lines + (["", data["notes"]] if data.get("notes") else []))


def scratch_testbed(data: dict) -> str:
    """Measured / predicted peaks without and with the ops' measured scratch (``benchmarks/scratch_testbed.py``)."""
    lines = [
        f"_{data['source']}; {data['steps']} steps each; `{data['command']}`_",
        "",
        "| model | batch | step | predicted | with scratch | measured peaks | measured / predicted | with scratch |",
        "|---|---:|---|---:|---:|---|---:|---:|",
    ]
    for r in data["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['model']} | {r['batch']} | - | - | - | {r['status']} | - | - |")
            continue
        plain = max(r["measured_peaks"])
        lines.append(
            f"| {r['model']} | {r['batch']} | plain | {_mib(r['predicted'])} | {_mib(r['predicted_with_scratch'])} "
            f"| {', '.join(f'{p / 2**20:,.0f}' for p in r['measured_peaks'])} "
            f"| {plain / r['predicted']:.2f} | {plain / r['predicted_with_scratch']:.2f} |"
        )
        a, b = r["plan"], r["plan_with_scratch"]
        lines.append(
            f"| | | plan for {_mib(r['budget'])} | {_mib(a['predicted'])} ({a['swaps']} swaps) "
            f"| {_mib(b['predicted'])} ({b['swaps']} swaps) "
            f"| {', '.join(f'{p / 2**20:,.0f}' for p in a['measured_peaks'])}; with scratch "
            f"{', '.join(f'{p / 2**20:,.0f}' for p in b['measured_peaks'])} "
            f"| {a['measured_over_predicted']:.2f} | {b['measured_over_predicted']:.2f} |"
        )
    return "\n".join(lines + (["", data["notes"]] if data.get("notes") else []))


TABLES: dict[str, Callable[[dict], str]] = {
    "pass_speed": pass_speed,
    "capacity": capacity,
    "cpu_overhead": cpu_overhead,
    "testbed_time": testbed_time,
    "testbed_defaults": testbed_defaults,
    "ecosystem_testbed": ecosystem_testbed,
    "recovery_testbed": recovery_testbed,
    "margin_testbed": margin_testbed,
    "scratch_testbed": scratch_testbed,
    "simulator_accuracy": simulator_accuracy,
    "testbed_memory": testbed_memory,
    "testbed_capacity": testbed_capacity,
    "recompute": recompute,
    "fences": simulator_accuracy,
    "fences_testbed": simulator_accuracy,
    "serialize": simulator_accuracy,
    "serialize96": simulator_accuracy,
    "default_schedule": simulator_accuracy,
    "memory_optimizer": simulator_accuracy,
    "update_orders": simulator_accuracy,
    "peak_anatomy": peak_anatomy,
    "offload_capacity": offload_capacity,
    "placement_capacity": placement_capacity,
    "placement_testbed": placement_testbed,
    "placement_uneven_testbed": placement_testbed,
    "horovod_overlap": horovod_overlap,
    "gpu": gpu,
    "gpu_fences": gpu_fences,
    "gpu_densenet121": gpu_runs,
    "gpu_options": gpu_runs,
    "gpu_layout": gpu_layout,
    "simulator_accuracy_gpu": simulator_accuracy,
}


#: Tables rendered from another table's JSON.
SOURCES = {"testbed_memory": "simulator_accuracy"}


def table(name: str, results: Path = RESULTS) -> str | None:
    """The markdown table of ``results/<name>.json``, or None if it was not run."""
    path = results / f"{SOURCES.get(name, name)}.json"
    return TABLES[name](json.loads(path.read_text())) if path.exists() else None


def provenance(name: str, data: dict) -> str:
    """One line naming where a table's figures come from: its JSON file, machine, date and the
    TensorFlow and tflms versions the JSON records ("not recorded" where it records none)."""
    gpu = data.get("gpu") if isinstance(data.get("gpu"), dict) else {}
    machine = data.get("machine") or gpu.get("device_name") or data.get("device") or "not recorded"
    if isinstance(data.get("device"), str) and data.get("machine") and data["device"] != "test bed":
        machine = f"{machine}; device: {data['device']}"
    tflms = data.get("tflms") or (f"commit {data['tflms_commit']}" if data.get("tflms_commit") else "not recorded")
    source = SOURCES.get(name, name)
    return (
        f"Source: `benchmarks/results/{source}.json` · machine: {machine} · date: {data.get('date', 'not recorded')}"
        f" · TensorFlow {data.get('tensorflow', 'not recorded')} · tflms {tflms}"
    )


#: The benchmarks page, in order: (table name, section title, what the table shows and how it was run).
SECTIONS: list[tuple[str, str, str]] = [
    (
        "testbed_memory",
        "Peak memory, plain against rewritten (test bed)",
        "The steady-state peak of the rewritten step against the plain step's, both from the same weights "
        "in each fresh measured process (`benchmarks/simulator_accuracy.py`). **Measured (test bed).** "
        "ResNet50's weights and two Adam slots are about 270 MiB of every ResNet50 figure.",
    ),
    (
        "simulator_accuracy",
        "Simulator accuracy (test bed)",
        "Each step's measured peak against the simulator's prediction (`benchmarks/simulator_accuracy.py`). "
        "**Measured (test bed)** against **predicted**.",
    ),
    (
        "testbed_capacity",
        "Largest batch under a real cap (test bed)",
        "The largest batch whose step trains under a real memory cap of the test bed's device, plain and "
        "autotuned to a budget below the cap (`benchmarks/testbed_capacity.py`). **Measured (test bed)**; the "
        "predicted columns are the simulator's.",
    ),
    (
        "capacity",
        "Largest batch within 16 GiB and 80 GiB (predicted)",
        "The largest batch (3D U-Net: cubic input side at batch 1) whose **predicted** peak fits the budget, "
        "without LMS and with the autotuned plan (`benchmarks/capacity.py`). No GPU was used: these are "
        "simulator figures.",
    ),
    (
        "gpu",
        "ResNet50 224² under a 4 GiB cap (H200)",
        "`benchmarks/gpu.py`: the largest batch that trains under a real 4 GiB cap of TensorFlow's GPU "
        "allocator, plain and autotuned. **Measured (H200)** against **predicted**.",
    ),
    (
        "gpu_densenet121",
        "DenseNet121 224² under a 4 GiB cap (H200)",
        "`benchmarks/gpu.py` on DenseNet121. **Measured (H200)** against **predicted**.",
    ),
    (
        "gpu_options",
        "ResNet50 224² with the experimental passes (H200)",
        "`benchmarks/gpu.py` with `swap_gradients`, `split_sums` and `order_updates` (the `/g/s/o` "
        "variants). **Measured (H200)** against **predicted**.",
    ),
    (
        "gpu_fences",
        "Fences on the GPU (H200)",
        "The same plans without fences and with `swapout_window` 1, 2, 4 and 8. Without fences the forward "
        "pass runs ahead of the link. **Measured (H200)** against **predicted**.",
    ),
    (
        "gpu_layout",
        "Grappler's layout optimizer on and off (H200)",
        "Attempts under a real 4 GiB cap with the layout optimizer on and off, and cuDNN's autotuning on "
        "and off. **Measured (H200)** against **predicted**.",
    ),
    (
        "simulator_accuracy_gpu",
        "Simulator accuracy on the GPU (H200)",
        "The test models' steps on one H200. **Measured (H200)** against **predicted**.",
    ),
    (
        "serialize",
        "Memory-aware schedule, ResNet50 224² (test bed)",
        "`serialize=False` against `serialize=True`. **Measured (test bed)** against **predicted**.",
    ),
    (
        "serialize96",
        "Memory-aware schedule, ResNet50 96² (test bed)",
        "`serialize=False` against `serialize=True`. **Measured (test bed)** against **predicted**.",
    ),
    (
        "default_schedule",
        "Default schedule (test bed)",
        "The rewritten steps with the default options of their day. **Measured (test bed)** against **predicted**.",
    ),
    (
        "update_orders",
        "Variable updates wait for their reads (test bed)",
        "`order_updates=False` against `order_updates=True`. **Measured (test bed)** against **predicted**.",
    ),
    (
        "recompute",
        "Recompute (test bed)",
        "Swaps only against `recompute=True`. **Measured (test bed)**; link and recompute times are the "
        "plans' predictions.",
    ),
    (
        "fences",
        "Fences (test bed)",
        "The default plan against the same plan with `swapout_window=4`. **Measured (test bed)** against "
        "**predicted**.",
    ),
    (
        "fences_testbed",
        "Fences on the CNN and ResNet50 (test bed)",
        "The default plan against the same plan with `swapout_window=4`. **Measured (test bed)** against "
        "**predicted**.",
    ),
    (
        "memory_optimizer",
        "Grappler's memory optimizer at its default level and at `MANUAL` (test bed)",
        "The same steps called at TensorFlow's default memory-optimizer level and at `MANUAL` (see "
        "`tflms.manual_memory_optimizer`). **Measured (test bed)** against **predicted**.",
    ),
    (
        "peak_anatomy",
        "What the peak holds (test bed)",
        "One profiled step per row: the allocator chunks live at the measured peak, grouped by the phase of "
        "the op behind them, next to the simulator's live buffers at its predicted peak "
        "(`benchmarks/peak_anatomy.py`). **Measured (test bed)** against **predicted**.",
    ),
    (
        "testbed_defaults",
        "No option but device and host (test bed)",
        "ResNet50 96² (Adam) trained with `model.fit` and `LMSCallback`, and with `tflms.function`, "
        "given only the test bed's device and host: `budget='auto'` is the cap times 0.9, the default "
        "policy's passes (`benchmarks/testbed_defaults.py`); each way of each case in a fresh measured "
        "process. **Measured (test bed)**; the predicted peak is the simulator's. The plain step's "
        "largest batch under 600 MiB is 16 ([largest batch](#largest-batch-under-a-real-cap-test-bed)). Step "
        "times share the 2 CPU cores with the host process.",
    ),
    (
        "ecosystem_testbed",
        "A KerasHub model under a real cap (test bed)",
        "KerasHub's GPT-2 (`GPT2CausalLM`, 4 layers, random weights) trained with `model.fit` under a real 220 MiB "
        "cap, plain and with `LMSCallback` given only the test bed's device and host "
        "(`tflms.testing.jobs:keras_hub_gpt2_fit`). **Measured (test bed)** against **predicted**.",
    ),
    (
        "recovery_testbed",
        "Recovery from an out-of-memory step, and oneDNN's kernels (test bed)",
        "ResNet50 96² and the two-input model trained under a real cap with plans that run out of memory: "
        "`tflms.function` and `LMSCallback` plan again and retry the same batch, and are compared with the "
        "uncapped plain run; and the test bed's steps on oneDNN's kernels against TensorFlow's own "
        "(`benchmarks/recovery_testbed.py`). **Measured (test bed)** against **predicted**; step times share the "
        "2 CPU cores with the host process and other jobs.",
    ),
    (
        "margin_testbed",
        'The learned margin of budget="auto" (test bed)',
        "Models of the zoo under a real cap of 0.7 x their plain step's predicted peak, `tflms.function` with no "
        "other option: the budget the first plan was made for (0.9 x the cap), its prediction, each step's "
        "measured peak, and the re-plans of the closed loop (a learned margin aims the measured peak at 0.95 x "
        "the cap and re-plans only where that moves the budget by more than 5 %) (`benchmarks/margin_testbed.py`). "
        "**Measured (test bed)** against **predicted**.",
    ),
    (
        "scratch_testbed",
        "Kernel scratch in the prediction (test bed)",
        "The plain step and a plan for 0.6 x its predicted peak, each predicted without and with an op profile "
        "(`Knobs(op_profile=path)`), whose per-op temporary buffers (a convolution gradient's column buffer, "
        "`MaxPoolGrad`'s) the simulator then counts while the op runs (`benchmarks/scratch_testbed.py`). "
        "**Measured (test bed)** against **predicted**; the machine was loaded by other jobs.",
    ),
    (
        "offload_capacity",
        "Deeper models with the optimizer on the host (test bed)",
        'A GPT-style decoder of growing depth under one real cap, plain, with `offload="optimizer"` '
        '(Adam\'s slots and update on the host) and with `offload="weights"` (the weights there too; '
        "`benchmarks/offload_capacity.py`), each row a fresh measured process, and the deepest offloaded models "
        "once more without a cap: their losses are the reference. "
        "**Measured (test bed)** against **predicted**; step times share the 2 CPU cores with the host "
        "process.",
    ),
    (
        "horovod_overlap",
        "Gradient exchange and the backward pass, with the optimizer on the host (Horovod, CPU)",
        'Two Horovod ranks (Gloo) on this machine, each training with `offload="optimizer"`: the '
        "gradients' allreduce and Adam's update on the host, the gradients in groups "
        "(`benchmarks/horovod_overlap.py`, run under `horovodrun`). Per group, when the backward pass had "
        "produced its gradients and when the update first read their averages, from one profiled step. "
        "**Measured (one process per rank, CPU)**.",
    ),
    (
        "placement_testbed",
        "Placement on the two-device test bed",
        "A step that runs out of memory under one real cap, trained across two devices under the same cap "
        "each (`benchmarks/placement_testbed.py`): the measured process is device 0 (the variables, the "
        "update and the first stage), a second capped process device 1, each with its own BFC allocator; "
        "each row a fresh run of three steps. **Measured (test bed)** against **predicted**.",
    ),
    (
        "placement_uneven_testbed",
        "The placer against an even split (two-device test bed)",
        "A step with uneven layers (two wide full-resolution convolutions, then six narrow ones after a 4x "
        "pooling) without a cap: plain on one device, placed by the placer (the largest device peak is its "
        "objective), and split evenly by layer count, on the same two-device test bed "
        "(`benchmarks/placement_testbed.py --uneven`). **Measured (test bed)** against **predicted**.",
    ),
    (
        "placement_capacity",
        "Placement across devices (predicted)",
        "The largest 3D U-Net side and the largest batch of ResNet152 and of the zoo's transformer under 16 GiB "
        "per device, on one device and placed on 2 and 4 by tflms's placer (`benchmarks/placement_capacity.py`), "
        "next to swapping alone on one device. **Predicted** (the simulator per device); the placed rows have no "
        "swaps, except the one that says so, whose swaps the rewrite does not apply yet.",
    ),
    (
        "testbed_time",
        "Step time, predicted against measured (test bed)",
        "The timeline's predicted step time (`tflms.emulate.timeline`: the plain step's per-op profile, "
        "measured once, and the link probed between the test bed's two processes) against the measured "
        "step, plain and with tflms (`benchmarks/testbed_time.py`). **Measured (test bed)** against "
        "**predicted**. No criterion: the test bed's link is gRPC between two processes on the same 2 CPU "
        "cores that compute the step, where the timeline gives transfers copy engines of their own, as a "
        "GPU has, and times on a shared machine vary.",
    ),
    (
        "cpu_overhead",
        "Step time on one process (CPU)",
        "Plain and rewritten steps alternating on one process's two logical CPUs "
        "(`benchmarks/cpu_overhead.py`). **Measured (CPU)**; times on a shared 2-core machine.",
    ),
    (
        "pass_speed",
        "Speed of the pass",
        "Graph model, plan and rewrite of growing training steps (stacks of transformer encoder blocks; "
        "`benchmarks/pass_speed.py`), Keras applications, the capacity search, and one 51,779-op attention "
        "stack planned per policy. **Measured (one process, 2 CPUs)**, seconds; the machine was shared, so "
        "runs spread: min and median kept. Tracing the step (TensorFlow's work, the same with or without "
        "tflms) is not timed, except where a column says so.",
    ),
]


def page(results: Path = RESULTS) -> str:
    """The documentation's benchmarks page: every table of ``SECTIONS`` whose JSON exists, each
    with its source, machine, date and versions."""
    missing = sorted(set(TABLES) - {name for name, _, _ in SECTIONS})
    if missing:
        raise ValueError(f"tables with no section on the benchmarks page: {missing}")
    lines = [
        "# Benchmarks",
        "",
        "<!-- Generated by `python benchmarks/report.py --page docs/benchmarks.md` from "
        "benchmarks/results/*.json; do not edit by hand. -->",
        "",
        "Every figure here is read from a JSON file in `benchmarks/results/`, written by the benchmark "
        "script named in its section. Labels: **measured (test bed)** is real device memory on the "
        "two-process test bed ([The test bed](test-bed.md)); **measured (H200)** is TensorFlow's GPU "
        "allocator on one NVIDIA H200; **predicted** is the simulator ([How it works](how-it-works.md)). "
        "Each table was made with the options of its date: a row that names an option ran with it.",
        "",
    ]
    for name, title, text in SECTIONS:
        path = results / f"{SOURCES.get(name, name)}.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        lines += [f"## {title}", "", provenance(name, data), "", text, "", TABLES[name](data), ""]
    return "\n".join(lines).rstrip() + "\n"


def _load(name: str, results: Path) -> dict:
    return json.loads((results / f"{name}.json").read_text())


def headline(results: Path = RESULTS) -> str:
    """The README's table of headline results, read from the benchmark JSON."""
    gpu, dense = _load("gpu", results), _load("gpu_densenet121", results)
    dense_plain = max(r["batch"] for run in dense["runs"] for r in run["search"] if r["ok"] and r["mode"] == "plain")
    dense_lms = max(r["batch"] for run in dense["runs"] for r in run["search"] if r["ok"] and r["mode"] == "budget")
    testbed = _load("testbed_capacity", results)
    default_row = next(
        r
        for r in reversed(testbed["rows"])
        if r["model"] == "resnet50" and r.get("serialize") and not any(r.get(k) for k in _EXPERIMENTAL)
    )
    defaults = _load("testbed_defaults", results)
    # The largest batch under 600 MiB that trained through both APIs (fit and tflms.function).
    trained = {
        (r["batch"], r["api"])
        for r in defaults["runs"]
        if r["way"] == "lms" and r["status"] == "ok" and r["cap_mib"] == 600 and not r["options"]
    }
    by_api = {api: max((b for b, a in trained if a == api), default=None) for api in ("function", "fit")}
    tried_fit = sorted({r["batch"] for r in defaults["runs"] if r["api"] == "fit" and r["cap_mib"] == 600})
    zero_config = by_api["function"]
    fit_cell = str(by_api["fit"]) if by_api["fit"] else f"none of {', '.join(map(str, tried_fit))}"
    accuracy = _load("simulator_accuracy", results)
    plain48, lms48 = (
        next(r for r in accuracy["rows"] if r["model"] == "resnet50" and r["batch"] == 48 and r["mode"] == mode)
        for mode in ("plain", "lms")
    )
    capacity_rows = _load("capacity", results)["rows"]
    default_capacity = next(
        r
        for r in capacity_rows
        if r["model"] == "resnet50"
        and r["budget"] == "16GiB"
        and r.get("serialize")
        and not any(r.get(k) for k in _EXPERIMENTAL)
    )
    bert = next(r for r in capacity_rows if r["model"] == "bert_base" and r["budget"] == "16GiB")
    ratios = [a / b for a, b in zip(lms48["runs"], plain48["runs"])]
    gib = 2**30
    rows = [
        _batch_row(
            f"ResNet50 {gpu['image_size']}², Adam, real {gpu['cap_bytes'] / gib:g} GiB cap: largest batch",
            (gpu["max_batch_plain"], gpu["max_batch_budget"]),
            "measured (H200)",
            gpu["date"],
            "gpu",
        ),
        _batch_row(
            f"DenseNet121 {dense['image_size']}², Adam, real 4 GiB cap: largest batch",
            (dense_plain, dense_lms),
            "measured (H200)",
            dense["date"],
            "gpu_densenet121",
        ),
        (
            f"ResNet50 {default_row['size']}², Adam, real {_mib(default_row['cap'])} cap, tflms with no option: "
            "largest batch tried that trains with `tflms.function` (with `LMSCallback`)",
            str(default_row["plain"]),
            f"{zero_config} ({fit_cell})",
            f"x{zero_config / default_row['plain']:.1f}",
            "measured (test bed)",
            defaults["date"],
            "testbed_defaults",
        ),
        (
            "ResNet50 96², Adam, batch 48: steady-state peak",
            _peaks(plain48),
            _peaks(lms48),
            _range(ratios, "{:.2f}"),
            "measured (test bed)",
            accuracy["date"],
            "simulator_accuracy",
        ),
        _capacity_row("ResNet50 224², Adam, 16 GiB budget: largest batch", default_capacity),
        _capacity_row("BERT-base, Adam, 16 GiB budget: largest batch", bert),
    ]
    lines = [
        "| result | plain | tflms | ratio | label | date | source |",
        "|---|---:|---:|---:|---|---|---|",
    ]
    for what, plain, lms, ratio, label, date, source in rows:
        lines.append(f"| {what} | {plain} | {lms} | {ratio} | {label} | {date} | `benchmarks/results/{source}.json` |")
    return "\n".join(lines)


def _batch_row(
    what: str, batches: tuple[int, int], label: str, date: str, source: str, digits: int = 1
) -> tuple[str, ...]:
    """A headline row of the largest batches ``(plain, tflms)`` and their ratio (to ``digits`` decimals)."""
    plain, lms = batches
    return (what, str(plain), str(lms), f"x{lms / plain:.{digits}f}", label, date, source)


def _capacity_row(what: str, row: dict) -> tuple[str, ...]:
    """A headline row of a capacity result (``benchmarks/results/capacity.json``): predicted batches."""
    return _batch_row(what, (row["without_lms"], row["with_lms"]), "predicted", row["planned"], "capacity", digits=2)


#: Options off by default: a row that names one of them ran an experimental pass.
_EXPERIMENTAL = ("swap_gradients", "split_sums", "drop_tiles", "order_updates", "recompute", "swapout_window")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--page"]:
        if len(argv) != 2:
            print("usage: report.py --page PATH", file=sys.stderr)
            return 2
        Path(argv[1]).write_text(page())
        print(f"wrote {argv[1]}")
        return 0
    if argv == ["--headline"]:
        print(headline())
        return 0
    names = argv or list(TABLES)
    for name in names:
        if name not in TABLES:
            print(f"unknown table {name!r}; choose from {', '.join(TABLES)}", file=sys.stderr)
            return 2
        print(f"### {name}\n\n{table(name) or '(not run)'}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
