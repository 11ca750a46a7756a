"""Real memory on the test bed, and the simulator's accuracy: measured vs predicted peaks.

Each case trains a few Adam steps of a model of :data:`tflms.testing.zoo.MODELS` in a
fresh measured process (:func:`tflms.testing.measure.measure`: TensorFlow's BFC allocator
on the CPU is the device, a second TensorFlow process is the host), plain and
with the default LMS plan (and, for ``MODEL:BATCH:gated`` cases, the same plan with
its swap-ins on the device: tflms 0.1's rewrite, the negative control; for ``:fenced``,
the same swaps with ``swapout_window=tflms.testing.measure.FENCE_WINDOW``; for ``:serialized``, the
same swaps with ``serialize=True``; for ``:unordered``, with ``serialize=False``; for
``:ordered``, with ``order_updates=True``), from the same weights, and repeats that in
``--runs`` fresh processes. The tflms steps run first in each process and the plain step last
(since 2026-11-25; before, the plain step ran first and the tflms steps inherited its
allocator's layout). The plain step is called as
TensorFlow calls it and the tflms steps as ``tflms.function`` calls them (Grappler's memory
optimizer at ``MANUAL``); ``:manual`` calls every step of the case within
``tflms.manual_memory_optimizer()``, ``:default`` every step at TensorFlow's default level.
Per run it records the steady-state peak (the largest per-step peak after one warm-up step), every
step's peak after the warm-up (since 2026-11-26: the table's median step) and the first step's
peak; the simulator's prediction is the same in every run.

Usage::

    python benchmarks/simulator_accuracy.py                    # every case, 3 runs each
    python benchmarks/simulator_accuracy.py --cases cnn:32 resnet50:16:gated --runs 2
    # recompute (issue 8): the README's recompute table
    python benchmarks/simulator_accuracy.py --cases cnn:32:recompute transformer:8:recompute \
        resnet50:16:recompute --runs 2 --json benchmarks/results/recompute.json
    # fences: the README's fences table
    python benchmarks/simulator_accuracy.py --cases transformer:16:fenced encoder:32:fenced --runs 3 \
        --steps 8 --json benchmarks/results/fences.json
    # the default options (serialize=True) against the swaps alone: the README's default-schedule table
    python benchmarks/simulator_accuracy.py --cases resnet50:32:unordered resnet50:48:unordered --runs 3 \
        --json benchmarks/results/default_schedule.json
    # the memory-aware schedule: the README's serialize table (MODEL@SIZE: another input size)
    python benchmarks/simulator_accuracy.py --cases resnet50@224:32:serialized --runs 3 \
        --json benchmarks/results/serialize.json
    # order_updates=True for every tflms step (--order-updates): the README's table of the test models with it
    python benchmarks/simulator_accuracy.py --cases cnn:32 transformer:8 transformer:16 resnet50:16 \
        resnet50:32 resnet50:48 --runs 3 --steps 8 --order-updates --json benchmarks/results/update_orders.json
    # Grappler's memory optimizer at MANUAL (no AddN accumulation rewrite): the README's table
    python benchmarks/simulator_accuracy.py --cases resnet50@224:32:default resnet50@224:32:manual \
        resnet50:32:default resnet50:32:manual --runs 2 --json benchmarks/results/memory_optimizer.json
    # on a GPU: the same cases on GPU 0 (measure(..., gpu=True)), to simulator_accuracy_gpu.json
    python benchmarks/simulator_accuracy.py --gpu --runs 3 --steps 8

With ``--gpu`` each measured process is GPU 0 (TensorFlow's GPU allocator, its memory
growing as needed) with its own CPU as the host, instead of the test bed.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from report import save_result

from tflms.config import LMSConfig
from tflms.testing.measure import measure

DEFAULT_CASES = ("cnn:32", "transformer:8", "transformer:16", "resnet50:16:gated", "resnet50:32", "resnet50:48")
#: What an LMS step's row records of its plan.
PLAN_FIELDS = (
    "n_swaps", "swapped_bytes", "n_recomputes", "recomputed_bytes", "n_orders", "n_sums", "link_seconds",
    "recompute_seconds",
)  # fmt: skip
#: Case flags and the :func:`tflms.testing.measure.measure_step` mode each adds.
FLAG_MODES = {"gated": "lms_device_gated", "recompute": "lms_recompute", "fenced": "lms_fenced",
              "serialized": "lms_serialized", "unordered": "lms_unordered", "sums": "lms_split_sums",
              "ordered": "lms_ordered_updates"}  # fmt: skip
#: Case flags that set :func:`tflms.testing.measure.measure_step`'s ``memory_optimizer`` for every step.
LEVELS = ("manual", "default")


def run_case(
    model: str,
    batch: int,
    modes: list[str],
    runs: int,
    steps: int,
    size: int | None = None,
    memory_optimizer: str = "auto",
    gpu: bool = False,
    options: dict | None = None,
) -> list[dict]:
    """One row per mode: the steady and first-step peaks of every run, and the prediction
    (measured on GPU 0 with ``gpu=True``, else on the test bed); ``options``: of every tflms step's plan."""
    first = {"model": model, "batch": batch, "memory_optimizer": memory_optimizer}
    rows = {m: {**first, "mode": m, "runs": [], "first_peaks": []} for m in modes}
    for m in modes:  # what the plans are made with, also for a row whose every run failed
        if m != "plain":
            rows[m]["serialize"] = {"lms_serialized": True, "lms_unordered": False}.get(m, LMSConfig().knobs.serialize)
            rows[m]["order_updates"] = m == "lms_ordered_updates" or "order_updates" in (options or {}).get(
                "policy", ()
            )
    for _ in range(runs):
        r = measure(
            model, batch, size=size, modes=modes, steps=steps, memory_optimizer=memory_optimizer, gpu=gpu,
            options=options,
        )  # fmt: skip
        if not r.ok:
            for row in rows.values():
                row.setdefault("errors", []).append(f"{r.status}: {r.error[-300:]}")
            continue
        for m in modes:
            v, row = r.value[m], rows[m]
            row["size"] = r.value["size"]
            row["runs"].append(v["peak"])
            row["first_peaks"].append(v["first_peak"])
            row.setdefault("step_peaks", []).append(v["peaks"][1:])  # after the warm-up step
            row["step_seconds"] = row.get("step_seconds", []) + [min(v["step_seconds"][1:])]
            row["losses"] = v["losses"]
            row["predicted"] = v["predicted"]
            if m != "plain":
                row.update(
                    {k: v[k] for k in PLAN_FIELDS},
                    serialize=v["options"]["serialize"],
                    order_updates=v["options"].get("order_updates", False),
                )
    return list(rows.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases",
        nargs="+",
        default=list(DEFAULT_CASES),
        help="MODEL[@SIZE]:BATCH[:gated][:recompute][:fenced][:serialized][:unordered][:sums][:ordered]"
        "[:manual|:default] (SIZE: input size other than the model's default; gated: also the "
        "swap-ins-on-the-device control; recompute: also the plan with recompute=True; fenced: also the plan with "
        "swapout_window; serialized: also with serialize=True; unordered: also with serialize=False; sums: also "
        "with split_sums=True; ordered: also with order_updates=True; manual: every step within "
        "tflms.manual_memory_optimizer(); default: every step at TensorFlow's default memory-optimizer level; "
        "neither: plain steps at the default, tflms steps at MANUAL as tflms calls them)",
    )
    parser.add_argument(
        "--order-updates",
        action="store_true",
        help="every tflms step planned with order_updates=True (off by default in tflms); the rows say so",
    )
    parser.add_argument("--runs", type=int, default=3, help="fresh measured processes per case")
    parser.add_argument("--steps", type=int, default=4, help="measured steps per run, after one warm-up step")
    parser.add_argument(
        "--gpu", action="store_true", help="measure on GPU 0 instead of the test bed (default JSON: *_gpu.json)"
    )
    parser.add_argument("--json", type=Path, help="default: results/simulator_accuracy.json (--gpu: _gpu.json)")
    args = parser.parse_args(argv)
    results = Path(__file__).resolve().parent / "results"
    args.json = args.json or results / ("simulator_accuracy_gpu.json" if args.gpu else "simulator_accuracy.json")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    device = "test bed"
    if args.gpu:
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
        if not gpus:
            parser.error("--gpu: TensorFlow sees no GPU on this machine (leave --gpu out for the test bed)")
        device = f"GPU 0 ({tf.config.experimental.get_device_details(gpus[0]).get('device_name', 'unknown')})"
    rows = []
    print(f"{'model':12} {'batch':>5} {'step':>6} {'steady MiB (per run)':>28} {'predicted MiB':>14}")
    for case in args.cases:
        model, batch, *flags = case.split(":")
        model, _, size = model.partition("@")
        unknown = sorted(set(flags) - set(FLAG_MODES) - set(LEVELS))
        if unknown:
            known = ", ".join([*FLAG_MODES, *LEVELS])
            parser.error(f"unknown case flag(s) {', '.join(unknown)} in {case!r}: use {known}")
        if set(LEVELS) <= set(flags):
            parser.error(f"a case takes :manual or :default, not both. Received: {case!r}")
        # The rewritten steps first, the plain one last: a step measured after another in the same
        # process inherits its allocator's chunks, and the plain step's larger peak leaves a
        # layout a tflms step in its own process never sees (2026-11-25: ResNet50 96² batch 16's
        # tflms step 394-440 MiB after the plain step, 358-364 MiB before it; predicted 352-359).
        modes = ["lms"] + [FLAG_MODES[f] for f in FLAG_MODES if f in flags] + ["plain"]
        memory_optimizer = next((f for f in flags if f in LEVELS), "auto")
        size_or_none = int(size) if size else None
        case_rows = run_case(
            model, int(batch), modes, args.runs, args.steps, size_or_none, memory_optimizer, args.gpu,
            {"policy": ("default", "order_updates")} if args.order_updates else None,
        )  # fmt: skip
        for row in sorted(case_rows, key=lambda r: r["mode"] != "plain"):  # the plain row first in tables
            rows.append(row)
            runs = " ".join(f"{p / 2**20:.0f}" for p in row["runs"]) or "failed"
            predicted = f"{row['predicted'] / 2**20:14.0f}" if "predicted" in row else ""
            print(f"{model:12} {batch:>5} {row['mode'][:6]:>6} {runs:>28} {predicted}", flush=True)
    source = (
        f"{device}: TensorFlow's GPU allocator, the host its CPU"
        if args.gpu
        else "tflms test bed (BFC allocator on the CPU as the device, a second TF process as the host), "
        "oneDNN kernels (TF_ENABLE_ONEDNN_OPTS=1)"
    )
    save_result(args.json, "simulator_accuracy", rows, steps=args.steps, warmup=1, device=device, source=source)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
