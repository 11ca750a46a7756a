"""Data-parallel training throughput with LMS on every Horovod rank (synthetic data).

Run with::

    horovodrun --gloo -np 2 -H localhost:2 python benchmarks/horovod_train.py \\
        --model ResNet50 --image-size 64 --batch 4 --steps 5 [--json out.json]

(the venv's ``bin`` must be on PATH). Each rank trains a
``keras.applications`` model (``weights=None``) on its own random batch of
``--batch`` images through ``@tflms.function`` with
``tflms.integrations.horovod.DistributedGradientTape``, after broadcasting rank 0's initial
variables; every rank checks that it made the same swap plan. Rank 0 alone
prints each rank's throughput (images/s, timed steps after ``--warmup``) and
the total, and writes ``--json``.

Devices: on a machine without GPUs the CPU is split into two logical devices
before TensorFlow initialises them, and ``/device:CPU:1`` plays the GPU
(``/device:CPU:0`` the host) unless ``--device`` is given. With GPUs each rank
sees only its local-rank GPU (memory growth on) and LMS uses it. Started
without ``horovodrun`` it runs as a single rank (Horovod need not be installed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time

# Importable without installing tflms, as `python benchmarks/horovod_train.py`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CPU_DEVICE = "/device:CPU:1"


def _names(text: str) -> tuple[str, ...]:
    return tuple(t for t in (s.strip() for s in text.split(",")) if t)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from tflms.config import Knobs, LMSConfig

    d = {**Knobs.__dataclass_fields__, **LMSConfig.__dataclass_fields__}
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="ResNet50", help="a keras.applications name, e.g. ResNet50, MobileNetV2")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="images per rank per step")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (the first one traces and rewrites)")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (momentum 0.9)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--group-mib",
        type=float,
        default=8.0,
        help="allreduce gradients in groups of at most this many MiB; 0: one group",
    )
    p.add_argument("--json", metavar="PATH", help="rank 0 writes the results here")
    p.add_argument("--print-plan", action="store_true", help="rank 0 prints the swap plan table")
    lms = p.add_argument_group("LMS options (tflms.LMSConfig)")
    lms.add_argument("--no-lms", action="store_true", help="plain tf.function, for comparison")
    lms.add_argument("--device", default=None, help=f"compute device (default: local-rank GPU, else {CPU_DEVICE})")
    lms.add_argument("--host", default=d["host"].default)
    lms.add_argument("--swapout-threshold", type=int, default=d["swapout_threshold"].default)
    lms.add_argument("--swapin-ahead", type=int, default=d["swapin_ahead"].default)
    lms.add_argument("--swapin-groupby", type=int, default=d["swapin_groupby"].default)
    lms.add_argument("--min-bytes", type=int, default=d["min_bytes"].default)
    lms.add_argument("--n-tensors", type=int, default=d["n_tensors"].default)
    lms.add_argument(
        "--serialize",
        action=argparse.BooleanOptionalAction,
        default=d["serialize"].default,
        help="the memory-aware schedule's ordering edges (default: on)",
    )
    for name in ("incl_scopes", "excl_scopes", "incl_types", "excl_types"):
        lms.add_argument("--" + name.replace("_", "-"), type=_names, default=(), help="comma-separated")
    args = p.parse_args(argv)
    for name in ("image_size", "batch", "steps", "classes"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1. Received: {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0. Received: {args.warmup}")
    return args


def setup_devices(args: argparse.Namespace, local_rank: int) -> str | None:
    """Configure devices before TensorFlow initialises them; return the LMS device."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        gpu = gpus[local_rank % len(gpus)]
        tf.config.set_visible_devices(gpu, "GPU")
        tf.config.experimental.set_memory_growth(gpu, True)
        return args.device  # None: tflms picks the (only visible) GPU
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    return args.device or CPU_DEVICE


def _on(device: str | None):
    import tensorflow as tf

    return tf.device(device) if device else contextlib.nullcontext()


def build_model(args: argparse.Namespace):
    import keras

    try:
        factory = getattr(keras.applications, args.model)
    except AttributeError:
        raise SystemExit(f"--model must name a keras.applications model. Received: --model {args.model}") from None
    keras.utils.set_random_seed(args.seed)
    return factory(
        weights=None,
        input_shape=(args.image_size, args.image_size, 3),
        classes=args.classes,
        classifier_activation=None,
    )


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tflms.integrations.horovod as lms_hvd

    try:
        lms_hvd.init()
    except ImportError:
        if "HOROVOD_RANK" in os.environ:  # started by horovodrun: Horovod is required
            raise
        print("horovod_train: Horovod is not installed; running a single process", file=sys.stderr)
    device = setup_devices(args, lms_hvd.local_rank())

    import keras
    import numpy as np
    import tensorflow as tf

    import tflms
    from tflms.config import keyword_options
    from tflms.testing.zoo import train_step_of

    rank, size = lms_hvd.rank(), lms_hvd.size()
    options = {
        "device": device,
        "host": args.host,
        "swapout_threshold": args.swapout_threshold,
        "swapin_ahead": args.swapin_ahead,
        "swapin_groupby": args.swapin_groupby,
        "min_bytes": args.min_bytes,
        "n_tensors": args.n_tensors,
        "serialize": args.serialize,
        "incl_scopes": args.incl_scopes,
        "excl_scopes": args.excl_scopes,
        "incl_types": args.incl_types,
        "excl_types": args.excl_types,
    }
    config = tflms.LMSConfig(**keyword_options(options))  # the knobs into knobs=tflms.Knobs(...)
    with _on(device):
        model = build_model(args)
        opt = keras.optimizers.SGD(learning_rate=args.lr, momentum=0.9)
        opt.build(model.trainable_variables)
        rng = np.random.default_rng(args.seed + 1000 * rank)  # each rank its own data
        x = tf.constant(rng.normal(size=(args.batch, args.image_size, args.image_size, 3)).astype("float32"))
        y = tf.constant(rng.integers(0, args.classes, size=(args.batch,)).astype("int32"))
    lms_hvd.broadcast_variables(list(model.variables) + list(opt.variables), root_rank=0)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    group_bytes = None if args.group_mib <= 0 else max(1, int(args.group_mib * 2**20))

    train_step = train_step_of(
        model, loss_fn, opt, lambda tape: lms_hvd.DistributedGradientTape(tape, group_bytes=group_bytes)
    )
    t0 = time.perf_counter()
    if args.no_lms:
        step = tf.function(train_step)
        step.get_concrete_function(x, y)
        plan = None
    else:
        step = tflms.function(train_step, config=config)
        plan = step.get_plan(x, y)  # traces and rewrites
        lms_hvd.assert_same_plan(plan)
    prepare_s = time.perf_counter() - t0

    losses, times = [], []
    with _on(device):
        for i in range(args.warmup + args.steps):
            t = time.perf_counter()
            losses.append(float(step(x, y)))
            if i >= args.warmup:
                times.append(time.perf_counter() - t)
    elapsed = sum(times)
    mine = args.batch * len(times) / elapsed
    per_rank = lms_hvd.allgather_scalar(mine)
    result = {
        "model": args.model,
        "image_size": args.image_size,
        "batch_per_rank": args.batch,
        "ranks": size,
        "steps": args.steps,
        "warmup": args.warmup,
        "allreduce_group_bytes": group_bytes,
        "images_per_s_per_rank": per_rank,
        "images_per_s_total": sum(per_rank),
        "step_s_median_rank0": float(np.median(times)),
        "trace_and_plan_s_rank0": prepare_s,
        "losses_rank0": losses,
        "lms": None
        if plan is None
        else {
            "options": config.to_dict(),
            "device": tflms.resolve_device(config),
            "swaps": len(plan.swaps),
            "swap_ins": plan.n_swap_ins,
            "swapped_bytes": plan.swapped_bytes,
            "predicted_peak_bytes_before": plan.peak_bytes_before,
            "predicted_peak_bytes_after": plan.peak_bytes_after,
            "plan_fingerprint": plan.fingerprint(),
        },
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "python": platform.python_version(),
    }
    if lms_hvd.is_root():
        from tflms.plan.records import format_bytes

        if plan is not None and args.print_plan:
            print(plan.summary(), flush=True)
        lms_line = (
            "LMS off"
            if plan is None
            else (
                f"LMS on {result['lms']['device']}: {len(plan.swaps)} tensors swapped "
                f"({format_bytes(plan.swapped_bytes)}/step), predicted peak "
                f"{format_bytes(plan.peak_bytes_before)} -> {format_bytes(plan.peak_bytes_after)}"
            )
        )
        print(
            f"horovod_train: {args.model} {args.image_size}x{args.image_size}, batch {args.batch}/rank x {size} "
            f"ranks, {args.steps} timed steps after {args.warmup} warm-up; {lms_line}",
            flush=True,
        )
        for r, v in enumerate(per_rank):
            print(f"throughput rank {r}: {v:.2f} images/s", flush=True)
        print(f"throughput total: {sum(per_rank):.2f} images/s ({size} ranks)", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2, sort_keys=True)
    return result


if __name__ == "__main__":
    main()
