"""CPU overhead benchmark: step time with and without the LMS rewrite.

On a machine without GPU the CPU is split into two logical devices
(``/device:CPU:1`` computes, ``/device:CPU:0`` holds swapped tensors), so this
measures what the rewrite costs in scheduling and copies between the two, with
no PCIe involved. For each model, plain ``tf.function`` and ``@tflms.function``
steps run alternately for ``--runs`` rounds of ``--steps`` timed steps (after
warm-up); the median step time of each and their ratio are reported.

Usage::

    python benchmarks/cpu_overhead.py
    python benchmarks/cpu_overhead.py --models cnn --runs 3 --steps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf
from report import save_result

import tflms
from tflms.testing.zoo import make_model, train_step_of

DEVICE = "/device:CPU:1"


def _setup(name: str):
    keras.utils.set_random_seed(0)
    if name == "cnn":  # three pooled blocks
        model = make_model("cnn", 64, blocks=((32, "pool"), (64, "pool"), (128, "pool")))
        x_shape, batch = (64, 64, 3), 32
    elif name == "resnet50":
        model = make_model("resnet50", 64)
        x_shape, batch = (64, 64, 3), 16
    elif name == "transformer":
        model = make_model("transformer", 128, dim=128, heads=4, layers=4)
        x_shape, batch = (128, 128), 16
    else:
        raise ValueError(f"unknown model {name!r}")
    opt = keras.optimizers.Adam(1e-3)
    step = train_step_of(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True), opt)

    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(batch, *x_shape)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, size=(batch,)).astype("int32"))
    return (model, opt), step, x, y


def _time(fn, x, y, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn(x, y).numpy()
        times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["cnn", "resnet50", "transformer"])
    parser.add_argument("--runs", type=int, default=5, help="alternating rounds (default 5)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round (default 5)")
    parser.add_argument("--json", type=Path, default=Path(__file__).resolve().parent / "results" / "cpu_overhead.json")
    args = parser.parse_args(argv)

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

    rows = []
    print(f"{'model':<12} {'swaps':>5} {'swapped':>9} {'plain ms':>9} {'LMS ms':>8} {'ratio':>6}")
    for name in args.models:
        _keep, step, x, y = _setup(name)
        plain = tf.function(step)
        lms = tflms.function(step, device=DEVICE)

        def plain_on_device(x, y, plain=plain):
            with tf.device(DEVICE):
                return plain(x, y)

        for fn in (plain_on_device, lms):  # trace and warm up
            _time(fn, x, y, 2)
        plain_t, lms_t = [], []
        for _ in range(args.runs):
            plain_t += _time(plain_on_device, x, y, args.steps)
            lms_t += _time(lms, x, y, args.steps)
        plan = lms.get_plan(x, y)
        p_ms, l_ms = 1000 * statistics.median(plain_t), 1000 * statistics.median(lms_t)
        row = {
            "model": name,
            "batch": int(x.shape[0]),
            "swaps": len(plan.swaps),
            "swapped_bytes": plan.swapped_bytes,
            "plain_ms_median": round(p_ms, 2),
            "lms_ms_median": round(l_ms, 2),
            "ratio": round(l_ms / p_ms, 3),
            "plain_ms_all": [round(1000 * t, 2) for t in plain_t],
            "lms_ms_all": [round(1000 * t, 2) for t in lms_t],
        }
        rows.append(row)
        mib = plan.swapped_bytes / 2**20
        print(
            f"{name:<12} {len(plan.swaps):>5} {mib:>7.1f}Mi {p_ms:>9.1f} {l_ms:>8.1f} {l_ms / p_ms:>6.3f}", flush=True
        )
    save_result(
        args.json, "cpu_overhead", rows,
        source="wall-clock step times on the CPU 'device' (two logical CPU devices)", runs=args.runs, steps=args.steps,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    raise SystemExit(main())
