"""Step time on the test bed: the timeline's prediction against the measured step, plain and with tflms.

For each model, in a fresh measured process of the two-process test bed
(:mod:`tflms.testing.testbed`): the link between the device and the host worker is probed
(:func:`tflms.testing.link.probe_link`: gRPC over loopback), the plain step is profiled once
(:func:`tflms.testing.profile.profile_ops`) and timed, and ``tflms.function`` plans with that
profile and the probed link (``Knobs.op_profile``, ``link_bandwidth``, ``link_latency``) under a
budget of ``--fraction`` of the plain step's predicted peak, and is timed too. The predicted step
times are the timeline's (:mod:`tflms.emulate.timeline`) from the plain step's profile: with one
compute stream (a GPU's model, the planner's) and with as many as the executor has inter-op threads
(a CPU runs independent ops side by side).

No criterion: the test bed's link is gRPC between two processes on the same 2 CPU cores that
compute the step, so a transfer takes cores from the compute (the timeline assumes copy
engines of their own, as on a GPU), and timings on a shared machine vary.

Usage::

    python benchmarks/testbed_time.py
    python benchmarks/testbed_time.py --models cnn --steps 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

from report import save_result

#: model -> (batch, size) of the measured steps.
MODELS = {"cnn": (32, 64), "resnet50": (16, 96), "transformer": (8, 256)}
#: Options of a model's tflms step besides the defaults (none: the default policy runs no
#: ``split_sums``, which the transformer's rewrite once failed with).
OPTIONS: dict[str, dict] = {"transformer": {}}
RESULTS = Path(__file__).resolve().parent / "results"


def measure_time(
    model: str, batch: int, size: int, steps: int, fraction: float, profile_dir: str, options: dict | None = None
) -> list[dict]:
    """In a measured process: the plain and the rewritten step's measured and predicted step times."""
    import tensorflow as tf

    import tflms
    from tflms.config import keyword_options
    from tflms.emulate.costs import coverage, op_seconds
    from tflms.emulate.timeline import TimelineModel
    from tflms.plan.registry import replay
    from tflms.testing import testbed
    from tflms.testing.link import probe_link
    from tflms.testing.profile import profile_ops
    from tflms.testing.zoo import build

    device, host = testbed.DEVICE, testbed.HOST
    probe = probe_link(device, host, sizes=(1 << 12, 1 << 20, 1 << 23), repeats=3, cache_dir=None)
    _, x, y, train_step = build(model, batch, size)
    plain = tf.function(train_step)
    graph = tflms.GraphModel.from_func_graph(plain.get_concrete_function(x, y).graph)

    def timed(fn: Any) -> float:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            float(fn(x, y))
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    with tf.device(device):
        plain(x, y)
        plain(x, y)
        profile = profile_ops(plain, (x, y), steps=1, warmup=0, device=device)
        plain_s = timed(plain)
    path = profile.save(Path(profile_dir) / f"testbed_profile_{model}_b{batch}.json")
    times = op_seconds(graph, profile)
    threads = tf.config.threading.get_inter_op_parallelism_threads() or len(os.sched_getaffinity(0))
    plain_tl = TimelineModel(graph, times).run()
    plain_threads = TimelineModel(graph, times, streams=threads).run()
    peak = tflms.Simulator(graph, host).peak()
    knobs = dict(probe.knobs(), op_profile=str(path), **(options or {}))
    lms = tflms.function(train_step, device=device, host=host, budget=int(fraction * peak), **keyword_options(knobs))
    plan = lms.get_plan(x, y)
    with tf.device(device):
        lms(x, y)
        lms(x, y)
        lms_s = timed(lms)
    step = replay(graph, plan)
    step_times = op_seconds(step, profile)
    lms_tl = TimelineModel(step, step_times).run(plan.swaps, probe.link, plan.fences)
    lms_threads = TimelineModel(step, step_times, streams=threads).run(plan.swaps, probe.link, plan.fences)
    common = {
        "model": model,
        "batch": batch,
        "size": size,
        "profiled_ops": len(profile),
        "profile_coverage": round(coverage(graph, profile), 3),
        "inter_op_threads": threads,
        "link": {k: getattr(probe, k) for k in ("to_host", "to_device", "latency")},
    }
    return [
        common
        | {
            "mode": "plain",
            "swaps": 0,
            "measured_ms": round(1e3 * plain_s, 2),
            "predicted_ms": round(1e3 * plain_tl.step_seconds, 2),
            "predicted_stall_ms": 0.0,
            "predicted_threads_ms": round(1e3 * plain_threads.step_seconds, 2),
        },
        common
        | {
            "mode": "tflms",
            "options": options or {},
            "swaps": len(plan.swaps),
            "swapped_mib": round(plan.swapped_bytes / 2**20, 1),
            "budget_bytes": plan.options["budget"],
            "measured_ms": round(1e3 * lms_s, 2),
            "predicted_ms": round(1e3 * lms_tl.step_seconds, 2),
            "predicted_stall_ms": round(1e3 * lms_tl.stall_seconds, 2),
            "predicted_threads_ms": round(1e3 * lms_threads.step_seconds, 2),
        },
    ]


def main(argv: list[str] | None = None) -> int:
    from tflms.testbed import run_measured  # the public name: the test bed's modules are being split

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per mode (the median is kept)")
    parser.add_argument("--fraction", type=float, default=0.7, help="budget: this fraction of the predicted peak")
    parser.add_argument("--json", type=Path, default=RESULTS / "testbed_time.json")
    args = parser.parse_args(argv)
    rows: list[dict] = []
    for model in [m for m in args.models.split(",") if m]:
        if model not in MODELS:
            parser.error(f"--models: unknown model {model!r}; use {', '.join(MODELS)}")
        batch, size = MODELS[model]
        kwargs = {"model": model, "batch": batch, "size": size, "steps": args.steps, "fraction": args.fraction,
                  "profile_dir": str(args.json.parent), "options": OPTIONS.get(model, {})}  # fmt: skip
        result = run_measured("testbed_time:measure_time", kwargs, pythonpath=[str(Path(__file__).resolve().parent)])
        if not result.ok:
            print(f"{model}: {result.status}: {(result.error or '')[-500:]}")
            continue
        rows += result.value
        for r in result.value:
            print(f"{model} {r['mode']:6}: measured {r['measured_ms']} ms, predicted {r['predicted_ms']} ms")
    save_result(args.json, "testbed_time", rows, device="test bed", steps=args.steps, fraction=args.fraction)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    raise SystemExit(main())
