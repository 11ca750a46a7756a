"""The ``tflms`` command line (also ``python -m tflms``).

Commands:
    tflms demo             plan, rewrite and train a small CNN with LMS; print the plan
    tflms build-horovod    build/install the Horovod wheel for this TensorFlow
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

__all__ = ["main"]


def _setup_devices() -> tuple[str | None, str]:
    """On a machine without GPU, split the CPU into two logical devices.

    Returns (device, explanation). Must run before TensorFlow initialises devices.
    """
    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        return None, "GPU found: LMS swaps between /device:GPU:0 and the host"
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    return "/device:CPU:1", "no GPU: /device:CPU:1 plays the GPU and /device:CPU:0 the host"


def demo(args: argparse.Namespace) -> int:
    """Plan, rewrite and train a small CNN with LMS on this machine."""
    device, where = _setup_devices()
    import keras
    import numpy as np
    import tensorflow as tf

    import tflms

    print(f"tflms {tflms.__version__}, TensorFlow {tf.__version__}: {where}")
    keras.utils.set_random_seed(0)
    L = keras.layers
    layers: list = [keras.Input((args.image_size, args.image_size, 3))]
    for filters in (32, 64, 128):
        layers += [L.Conv2D(filters, 3, padding="same"), L.BatchNormalization(), L.ReLU()]
        layers += [L.Conv2D(filters, 3, padding="same"), L.BatchNormalization(), L.ReLU(), L.MaxPooling2D()]
    layers += [L.GlobalAveragePooling2D(), L.Dense(10)]
    model = keras.Sequential(layers)
    optimizer = keras.optimizers.Adam(1e-3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(args.batch, args.image_size, args.image_size, 3)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, size=(args.batch,)).astype("int32"))

    step = tflms.function(train_step, device=device, swapout_threshold=args.swapout_threshold)
    t0 = time.perf_counter()
    plan = step.get_plan(x, y)
    print(f"traced, planned and rewrote the step in {time.perf_counter() - t0:.1f} s\n")
    print(plan.summary(max_rows=args.rows))
    print()
    bar = keras.utils.Progbar(args.steps, stateful_metrics=["loss"])
    times = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        loss = float(step(x, y))
        times.append(time.perf_counter() - t0)
        bar.update(i + 1, values=[("loss", loss)])
    if len(times) > 1:
        print(f"step time (after the first): {1000 * float(np.median(times[1:])):.1f} ms median")
    return 0


def build_horovod(args: argparse.Namespace) -> int:
    from . import build_horovod as bh

    return bh.main(args.rest)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tflms`` console script."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    parser = argparse.ArgumentParser(prog="tflms", description="Large model support for TensorFlow 2.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="plan, rewrite and train a small CNN with LMS")
    p.add_argument("--batch", type=int, default=32, help="batch size (default 32)")
    p.add_argument("--image-size", type=int, default=64, help="input height and width (default 64)")
    p.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    p.add_argument("--swapout-threshold", type=int, default=10, help="LMS swapout_threshold (default 10)")
    p.add_argument("--rows", type=int, default=20, help="rows of the plan table to print (default 20)")
    p.set_defaults(func=demo)

    p = sub.add_parser("build-horovod", help="build/install the Horovod wheel (options: build-horovod -- --help)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options passed to python -m tflms.build_horovod")
    p.set_defaults(func=build_horovod)

    args = parser.parse_args(argv)
    for name in ("batch", "image_size", "steps", "rows"):
        value = getattr(args, name, 1)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1. Received: {value}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
