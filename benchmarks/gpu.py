"""GPU benchmark: real device peak vs predicted, largest batch under a real cap, step time, link bandwidth.

Runs only where a GPU is present (never in CI). Every attempt is a fresh subprocess
(an out-of-memory error can leave TensorFlow's allocator unusable) that trains a
``keras.applications`` model (Adam, synthetic data, ``weights=None``) at one batch size
and reports the real device peak (``tf.config.experimental.get_memory_info('GPU:0')``,
steady steps after two warm-up steps) next to the simulator's predicted peak.

``--cap`` makes the GPU's memory a real cap of that size (a logical device with
``memory_limit``: TensorFlow's BFC allocator gets that much and no more), so the largest
batch is found in seconds per attempt on any GPU size. The attempts of one search round
run side by side (``--jobs``), each under its own cap; the timed runs run alone.

Modes: ``plain`` (``tf.function``), ``tflms`` (``tflms.function`` with default options),
``fenced`` (the same with ``swapout_window=--window``: the forward pass waits for the
swap-outs, so it cannot run ahead of the link; see the README's GPU results) and
``budget`` (``tflms.function(budget=fraction * cap)``: autotuned to the cap).

Phases, each written to the JSON as it ends:

1. ``bandwidth``: host->device and device->host copy rate of one 256 MiB tensor;
2. ``search``: the largest batch that trains under the cap, plain and budget (a grid, then
   one round between the largest batch that fits and the smallest that does not);
3. ``timed``: alone on the GPU, plain, tflms and fenced at the largest plain batch, and
   budget at its largest: step time, measured and predicted peak, bytes over the link
   per step and the rate that makes over the step.

Usage::

    python benchmarks/gpu.py --cap 4GiB                      # ResNet50 224x224
    python benchmarks/gpu.py --model ResNet152 --cap 8GiB --plain 16,24,32 --budget 48,64,96
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MIB = 1 << 20


def _gpu_setup(cap: int | None) -> None:
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        raise SystemExit("no GPU visible to TensorFlow")
    if cap:
        limit = tf.config.LogicalDeviceConfiguration(memory_limit=cap // MIB)
        tf.config.set_logical_device_configuration(gpus[0], [limit])
    else:
        tf.config.experimental.set_memory_growth(gpus[0], True)


def bandwidth(nbytes: int = 256 * MIB, reps: int = 5) -> dict:
    """Host->device and device->host copy rate (GB/s) of one ``nbytes`` float32 tensor, eager."""
    import numpy as np
    import tensorflow as tf

    _gpu_setup(None)
    data = np.ones(nbytes // 4, dtype=np.float32)
    rates: dict[str, list[float]] = {"host_to_device_GBps": [], "device_to_host_GBps": []}
    for i in range(reps + 1):
        with tf.device("/CPU:0"):
            host = tf.constant(data)  # a new handle: TensorFlow keeps a copy per device of each
        t0 = time.perf_counter()
        with tf.device("/GPU:0"):
            dev = tf.identity(host) * 1.0  # a new device tensor, for the same reason
            float(tf.reduce_sum(dev[:1]))  # waits for the copy
        t1 = time.perf_counter()
        with tf.device("/CPU:0"):
            back = tf.identity(dev)
        back.numpy()
        t2 = time.perf_counter()
        if i:  # the first is a warm-up
            rates["host_to_device_GBps"].append(nbytes / (t1 - t0) / 1e9)
            rates["device_to_host_GBps"].append(nbytes / (t2 - t1) / 1e9)
    return {k: round(max(v), 2) for k, v in rates.items()} | {"bytes": nbytes}


def probe(
    model_name: str, size: int, batch: int, mode: str, steps: int, cap: int | None, fraction: float, window: int = 2
) -> dict:
    """Train ``steps`` timed steps at ``batch`` in ``mode``; return measurements (in a subprocess)."""
    _gpu_setup(cap)
    import keras
    import numpy as np
    import tensorflow as tf

    import tflms

    keras.utils.set_random_seed(0)
    model = getattr(keras.applications, model_name)(weights=None, input_shape=(size, size, 3), classes=1000)
    opt = keras.optimizers.Adam(1e-4)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(batch, size, size, 3)).astype("float32"))
    y = tf.constant(rng.integers(0, 1000, size=(batch,)).astype("int32"))
    t0 = time.perf_counter()
    if mode == "plain":
        fn = tf.function(step)
        cf = fn.get_concrete_function(x, y)
        plan = None  # the plain step's prediction needs no plan: the simulator's peak of its graph
        predicted = tflms.Simulator(tflms.GraphModel.from_func_graph(cf.graph), tflms.LMSConfig().host).peak()
    else:
        options = {"budget": int(cap * fraction)} if mode == "budget" else {}
        options |= {"swapout_window": window} if mode == "fenced" else {}
        fn = tflms.function(step, **options)
        plan = fn.get_plan(x, y)
        predicted = plan.peak_bytes_after
    plan_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    losses = [float(fn(x, y))]
    first_s = time.perf_counter() - t0
    losses.append(float(fn(x, y)))
    tf.config.experimental.reset_memory_stats("GPU:0")
    t0 = time.perf_counter()
    for _ in range(steps):
        losses.append(float(fn(x, y)))
    seconds = (time.perf_counter() - t0) / steps
    link = sum(s.bytes * (1 + len(s.swap_ins)) for s in plan.swaps) if plan else 0
    return {
        "ok": True,
        "batch": batch,
        "mode": mode,
        "step_ms": round(1000 * seconds, 2),
        "images_per_s": round(batch / seconds, 1),
        "measured_peak_bytes": int(tf.config.experimental.get_memory_info("GPU:0")["peak"]),
        "predicted_peak_bytes": int(predicted),
        "swaps": len(plan.swaps) if plan else 0,
        **({"swapout_window": window} if mode == "fenced" else {}),
        "link_bytes_per_step": link,
        "link_GBps_over_step": round(link / seconds / 1e9, 2),
        "predicted_link_ms": round(1000 * plan.link_seconds, 2) if plan else 0.0,
        "plan_s": round(plan_s, 1),
        "first_step_s": round(first_s, 1),
        "losses": losses,
    }


def _subprocess(args: argparse.Namespace, extra: list[str], timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--model", args.model, "--image-size", str(args.image_size), *extra]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:.0f} s"}
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    oom = any(s in r.stderr for s in ("ResourceExhausted", "OOM", "out of memory"))
    tail = [ln for ln in r.stderr.strip().splitlines() if ln.strip()][-3:]
    return {"ok": False, "oom": oom, "returncode": r.returncode, "error": tail}


def attempt(args: argparse.Namespace, batch: int, mode: str, steps: int | None = None) -> dict:
    extra = ["--probe", "--batch", str(batch), "--mode", mode, "--steps", str(steps or args.steps),
             "--cap", str(args.cap), "--fraction", str(args.fraction), "--window", str(args.window)]  # fmt: skip
    t0 = time.perf_counter()
    r = _subprocess(args, extra, args.timeout)
    r.update(batch=batch, mode=mode, wall_s=round(time.perf_counter() - t0, 1))
    print(f"  {mode:6} batch {batch:>4}: " + json.dumps({k: v for k, v in r.items() if k != "losses"}), flush=True)
    return r


def _parallel(args: argparse.Namespace, jobs: list[tuple[int, str]]) -> list[dict]:
    with ThreadPoolExecutor(args.jobs) as pool:
        return list(pool.map(lambda j: attempt(args, *j), jobs))


def _largest(runs: list[dict], mode: str) -> tuple[int, int | None]:
    """(largest batch that trained, smallest batch above it that did not) in ``mode``."""
    ok = [r["batch"] for r in runs if r["mode"] == mode and r["ok"]]
    best = max(ok, default=0)
    failed = [r["batch"] for r in runs if r["mode"] == mode and not r["ok"] and r["batch"] > best]
    return best, min(failed, default=None)


def main(argv: list[str] | None = None) -> int:
    from tflms.config import parse_bytes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ResNet50", help="keras.applications name (default ResNet50)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--cap", type=parse_bytes, default=parse_bytes("4GiB"), help="real device memory cap")
    parser.add_argument("--fraction", type=float, default=0.9, help="budget mode: budget = fraction * cap")
    parser.add_argument("--window", type=int, default=2, help="fenced mode: swapout_window (default 2)")
    parser.add_argument("--plain", default="24,32,40,48,56,64", help="plain batches of the first round")
    parser.add_argument("--budget", default="64,80,96,112,128,160,192", help="budget batches of the first round")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per search attempt")
    parser.add_argument("--timed-steps", type=int, default=10, help="measured steps per timed run")
    parser.add_argument("--jobs", type=int, default=8, help="search attempts side by side")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per attempt")
    parser.add_argument("--deadline", type=float, default=0, help="seconds: skip timed runs that would end later")
    parser.add_argument("--json", type=Path, default=Path(__file__).resolve().parent / "results" / "gpu.json")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bandwidth", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("plain", "tflms", "fenced", "budget"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bandwidth:
        print(json.dumps(bandwidth()), flush=True)
        return 0
    if args.probe:
        r = probe(args.model, args.image_size, args.batch, args.mode, args.steps, args.cap, args.fraction, args.window)
        print(json.dumps(r), flush=True)
        return 0

    start = time.monotonic()
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        print("no GPU found: this benchmark measures real GPU memory and runs only on a GPU machine; nothing measured")
        return 0
    result: dict = {
        "benchmark": "gpu",
        "date": time.strftime("%Y-%m-%d"),
        "gpu": tf.config.experimental.get_device_details(gpus[0]),
        "tensorflow": tf.__version__,
        "model": args.model,
        "image_size": args.image_size,
        "cap_bytes": args.cap,
        "budget_fraction": args.fraction,
    }

    def save() -> None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")

    print("bandwidth:", flush=True)
    result["bandwidth"] = _subprocess(args, ["--bandwidth"], args.timeout)
    print("  " + json.dumps(result["bandwidth"]), flush=True)
    save()
    print(f"search under a {args.cap / MIB:,.0f} MiB cap:", flush=True)
    grid = [(int(b), "plain") for b in args.plain.split(",")] + [(int(b), "budget") for b in args.budget.split(",")]
    runs = _parallel(args, grid)
    refine: list[tuple[int, str]] = []
    for mode in ("plain", "budget"):
        best, fail = _largest(runs, mode)
        if best and fail and fail - best > 1:
            n = max(1, args.jobs // 2)
            between = {best + (fail - best) * (i + 1) // (n + 1) for i in range(n)} - {best, fail}
            refine += [(b, mode) for b in sorted(between)]
    longest = max((r["wall_s"] for r in runs), default=0.0)
    if refine and args.deadline and time.monotonic() - start + 2 * longest > args.deadline:
        print(f"  no second round: it would leave too little time before --deadline {args.deadline:.0f} s", flush=True)
    else:
        runs += _parallel(args, refine)
    result["search"] = runs
    plain_max, _ = _largest(runs, "plain")
    budget_max, _ = _largest(runs, "budget")
    result["max_batch_plain"], result["max_batch_budget"] = plain_max, budget_max
    save()
    print(f"largest batch under the cap: plain {plain_max}, tflms (budget) {budget_max}", flush=True)
    print("timed, alone:", flush=True)
    timed: list[dict] = []
    longest = max((r["wall_s"] for r in runs), default=0.0) / 2  # an attempt alone takes less
    todo = [(plain_max, m) for m in ("plain", "tflms", "fenced")] + [(budget_max, "budget")] if plain_max else []
    for batch, mode in todo:
        if batch and args.deadline and time.monotonic() - start + longest > args.deadline:
            print(f"  {mode} batch {batch}: skipped, it would end past --deadline {args.deadline:.0f} s", flush=True)
            continue
        if batch:
            timed.append(attempt(args, batch, mode, args.timed_steps))
            longest = max(longest, timed[-1]["wall_s"])
            result["timed"] = timed
            save()
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    raise SystemExit(main())
