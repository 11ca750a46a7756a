"""The ``tflms`` command line (also ``python -m tflms``).

Commands:
    tflms demo     ResNet50 at a batch whose predicted peak exceeds a memory budget:
                   plan, rewrite and train a few steps with LMS
    tflms plan     plan a keras.applications model (or your factory) for a batch size
    tflms bench    run a benchmark script from benchmarks/
    tflms build-horovod   build/install the Horovod wheel for this TensorFlow
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main", "CPU_BUDGET"]

#: The simulated device budget of ``tflms demo`` on a machine without GPU.
CPU_BUDGET = "1GiB"


class CLIError(Exception):
    """An error reported as one line, exit code 1."""


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


def _gpu_memory_bytes() -> int | None:
    """Total memory of GPU 0 from nvidia-smi, or None."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
        return int(float(out.strip().splitlines()[0])) * 2**20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in text.replace("x", ",").split(",") if d.strip())
    except ValueError:
        shape = ()
    if not shape or any(d < 1 for d in shape):
        raise argparse.ArgumentTypeError(f"expected dimensions like 224,224,3. Received: {text!r}")
    return shape


def _parse_size(text: str) -> int:
    from .config import parse_bytes

    try:
        return parse_bytes(text, "budget")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def build_model(spec: str, input_shape: tuple[int, ...], classes: int = 1000) -> Any:
    """A compiled Keras model from a keras.applications name or ``package.module:factory``.

    A factory is called with no arguments and must return a compiled ``keras.Model``.
    """
    import keras

    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise CLIError(f"cannot load MODEL factory {spec!r}: {err}") from None
        model = factory()
        if not isinstance(model, keras.Model):
            raise CLIError(f"MODEL factory {spec!r} must return a keras.Model. Received: {type(model).__name__}")
        return model
    ctor = getattr(keras.applications, spec, None)
    if ctor is None or not callable(ctor) or spec[:1].islower():
        names = sorted(n for n in dir(keras.applications) if n[:1].isupper())
        raise CLIError(
            f"unknown MODEL {spec!r}: use a keras.applications name ({', '.join(names[:6])}, ...) "
            f"or package.module:factory"
        )
    model = ctor(weights=None, input_shape=input_shape, classes=classes)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy")
    return model


def demo(args: argparse.Namespace) -> int:
    """ResNet50 at a batch whose predicted peak exceeds the budget, trained with LMS."""
    device, where = _setup_devices()
    import keras
    import numpy as np
    import tensorflow as tf

    import tflms
    from tflms.plan import format_bytes

    print(f"tflms {tflms.__version__}, TensorFlow {tf.__version__}: {where}")
    budget, source = args.budget, "--budget"
    if budget is None:
        gpu_memory = _gpu_memory_bytes() if device is None else None
        budget, source = (gpu_memory, "GPU memory") if gpu_memory else (_parse_size(CPU_BUDGET), "simulated budget")
    print(f"device memory budget: {format_bytes(budget)} ({source}); all peaks below are simulator predictions")

    keras.utils.set_random_seed(0)
    size = args.image_size
    model = build_model("ResNet50", (size, size, 3), classes=10)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    optimizer = model.optimizer
    optimizer.build(model.trainable_variables)

    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    # Traced once with an unknown batch to find a batch size that exceeds the budget.
    any_batch = tf.function(train_step).get_concrete_function(
        tf.TensorSpec((None, size, size, 3)), tf.TensorSpec((None,), tf.int32)
    )

    def peak(batch: int) -> int:
        return tflms.Simulator(tflms.GraphModel.from_func_graph(any_batch.graph, batch_size=batch)).peak()

    batch = args.batch
    if batch is None:  # smallest power of two whose plain step would not fit
        batch = 1
        while peak(batch) <= budget and batch < 4096:
            batch *= 2
    how = "--batch" if args.batch else "the smallest power of two whose plain step exceeds the budget"
    print(f"ResNet50 {size}x{size}, batch {batch} ({how})")

    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(batch, size, size, 3)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, size=(batch,)).astype("int32"))
    step = tflms.function(train_step, device=device, budget=budget)
    t0 = time.perf_counter()
    try:
        plan = step.get_plan(x, y)
    except tflms.BudgetError as err:
        raise CLIError(str(err)) from None
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
        ms = 1000 * float(np.median(times[1:]))
        print(f"step time (median after the first): {ms:.0f} ms, {batch / ms * 1000:.1f} images/s")
    return 0


def plan_cmd(args: argparse.Namespace) -> int:
    """Plan MODEL at --batch; print the summary, optionally write JSON and a plot."""
    _setup_devices()
    import tflms
    from tflms.autotune import keras_train_step

    shape = tuple(args.input_shape)
    model = build_model(args.model, shape, classes=args.classes)
    step = keras_train_step(model)
    gm = tflms.GraphModel.from_func_graph(step.graph, batch_size=args.batch)
    config = tflms.LMSConfig(budget=args.budget)
    try:
        plan = tflms.make_plan(gm, config)
    except tflms.BudgetError as err:
        raise CLIError(str(err)) from None
    print(plan.summary(max_rows=args.rows))
    if args.json:
        Path(args.json).write_text(plan.to_json() + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        from tflms.plot import plot_memory

        plot_memory(gm, plan, args.plot)
        print(f"wrote {args.plot}")
    if args.max_batch:
        if args.budget is None:
            raise CLIError("--max-batch needs --budget")
        print(tflms.max_batch_size(step, args.budget))
    return 0


BENCHMARKS = {
    "pass-speed": "pass_speed.py",
    "capacity": "capacity.py",
    "overhead": "cpu_overhead.py",
    "gpu": "gpu.py",
}


def bench(args: argparse.Namespace) -> int:
    """Run benchmarks/<name>.py with the remaining arguments."""
    root = Path(__file__).resolve().parent.parent / "benchmarks"
    script = root / BENCHMARKS[args.name]
    if not script.exists():
        raise CLIError(f"benchmark script {script} not found: run tflms bench from a source checkout")
    return subprocess.call([sys.executable, str(script), *args.rest])


def build_horovod(args: argparse.Namespace) -> int:
    from . import build_horovod as bh

    return bh.main(args.rest)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tflms`` console script."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    parser = argparse.ArgumentParser(prog="tflms", description="Large model support for TensorFlow 2.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="ResNet50 beyond a memory budget, trained with LMS")
    p.add_argument(
        "--budget", type=_parse_size, help=f"device memory budget (default: GPU memory; {CPU_BUDGET} on CPU)"
    )
    p.add_argument("--batch", type=int, help="batch size (default: smallest power of two that exceeds the budget)")
    p.add_argument("--image-size", type=int, default=96, help="input height and width (default 96)")
    p.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    p.add_argument("--rows", type=int, default=15, help="rows of the plan table to print (default 15)")
    p.set_defaults(func=demo)

    p = sub.add_parser("plan", help="plan a model for a batch size (simulator)")
    p.add_argument("model", metavar="MODEL", help="keras.applications name (e.g. ResNet50) or package.module:factory")
    p.add_argument("--batch", type=int, required=True, help="batch size")
    p.add_argument("--input-shape", type=_parse_shape, default=(224, 224, 3), help="e.g. 224,224,3 (default)")
    p.add_argument("--classes", type=int, default=1000, help="classes of a keras.applications model (default 1000)")
    p.add_argument("--budget", type=_parse_size, help="device memory budget, e.g. 16GiB: autotune to it")
    p.add_argument("--json", help="write the plan JSON here")
    p.add_argument("--plot", help="write the memory timeline PNG here")
    p.add_argument("--max-batch", action="store_true", help="also print the largest batch that fits the budget")
    p.add_argument("--rows", type=int, default=30, help="rows of the plan table to print (default 30)")
    p.set_defaults(func=plan_cmd)

    p = sub.add_parser("bench", help="run a benchmark from benchmarks/ (writes JSON, prints a table)")
    p.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options for the benchmark script")
    p.set_defaults(func=bench)

    p = sub.add_parser("build-horovod", help="build/install the Horovod wheel (options: build-horovod -- --help)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options passed to python -m tflms.build_horovod")
    p.set_defaults(func=build_horovod)

    args = parser.parse_args(argv)
    for name in ("batch", "image_size", "steps", "rows", "classes"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1. Received: {value}")
    try:
        return args.func(args)
    except CLIError as err:
        print(f"tflms: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
