"""GPU benchmark: real max batch before OOM with and without LMS, throughput, real vs predicted peak.

Runs only where a GPU is present (never in CI). Each attempt runs in a fresh
subprocess (an out-of-memory error can leave TensorFlow's allocator unusable), which
trains ``--steps`` steps of a keras.applications model at one batch size, plain or
with ``@tflms.function``, and reports images/s and the real device peak
(``tf.config.experimental.get_memory_info('GPU:0')['peak']``) next to the
simulator's predicted peak. The parent doubles and bisects the batch size for
each mode.

Usage::

    python benchmarks/gpu.py                               # ResNet50 224x224
    python benchmarks/gpu.py --model ResNet152 --limit 2048
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def probe(model_name: str, size: int, batch: int, lms: bool, steps: int) -> dict:
    """Train ``steps`` steps at ``batch``; return measurements (runs in a subprocess)."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tflms

    for gpu in tf.config.list_physical_devices("GPU"):
        tf.config.experimental.set_memory_growth(gpu, True)
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
    fn = tflms.function(step) if lms else tf.function(step)
    cf = fn.get_concrete_function(x, y)
    plan = fn.get_plan(x, y) if lms else tflms.make_plan(tflms.GraphModel.from_func_graph(cf.graph), tflms.LMSConfig())
    predicted = plan.peak_bytes_after if lms else plan.peak_bytes_before
    tf.config.experimental.reset_memory_stats("GPU:0")
    fn(x, y).numpy()  # warm-up (and the allocator's first growth)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn(x, y).numpy()
    seconds = (time.perf_counter() - t0) / steps
    return {
        "ok": True,
        "batch": batch,
        "lms": lms,
        "images_per_s": round(batch / seconds, 2),
        "step_ms": round(1000 * seconds, 2),
        "real_peak_bytes": int(tf.config.experimental.get_memory_info("GPU:0")["peak"]),
        "predicted_peak_bytes": int(predicted),
        "swaps": len(plan.swaps) if lms else 0,
    }


def attempt(args: argparse.Namespace, batch: int, lms: bool) -> dict:
    cmd = [sys.executable, __file__, "--probe", "--model", args.model, "--image-size", str(args.image_size),
           "--batch", str(batch), "--steps", str(args.steps)] + (["--lms"] if lms else [])  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    oom = "ResourceExhausted" in r.stderr or "OOM" in r.stderr or "out of memory" in r.stderr
    return {"ok": False, "batch": batch, "lms": lms, "oom": oom, "error": r.stderr.strip().splitlines()[-1:]}


def largest(args: argparse.Namespace, lms: bool) -> tuple[int, list[dict]]:
    tried: dict[int, dict] = {}

    def fits(b: int) -> bool:
        tried[b] = attempt(args, b, lms)
        print(f"  {'LMS  ' if lms else 'plain'} batch {b:>5}: {tried[b]}", flush=True)
        return tried[b]["ok"]

    from tflms.autotune import largest_fitting

    best = largest_fitting(fits, args.limit, rel_tol=0.05)
    return best, [tried[b] for b in sorted(tried)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ResNet50", help="keras.applications name (default ResNet50)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per attempt")
    parser.add_argument("--limit", type=int, default=4096, help="largest batch tried")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per attempt")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/gpu.json"))
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--lms", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        print(json.dumps(probe(args.model, args.image_size, args.batch, args.lms, args.steps)), flush=True)
        return 0

    import tensorflow as tf

    if not tf.config.list_physical_devices("GPU"):
        print("no GPU found: this benchmark measures real GPU memory and runs only on a GPU machine; nothing measured")
        return 0
    plain_max, plain_runs = largest(args, lms=False)
    lms_max, lms_runs = largest(args, lms=True)
    result = {
        "benchmark": "gpu",
        "date": time.strftime("%Y-%m-%d"),
        "gpu": tf.config.experimental.get_device_details(tf.config.list_physical_devices("GPU")[0]),
        "tensorflow": tf.__version__,
        "model": args.model,
        "image_size": args.image_size,
        "max_batch_without_lms": plain_max,
        "max_batch_with_lms": lms_max,
        "attempts": plain_runs + lms_runs,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"{args.model} {args.image_size}px: max batch {plain_max} without LMS, {lms_max} with LMS")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    raise SystemExit(main())
