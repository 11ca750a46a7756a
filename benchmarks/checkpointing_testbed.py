"""tflms against gradient checkpointing (``tf.recompute_grad`` per block), side by side (issue 65).

The model of issue 65: an 8-block pre-LayerNorm transformer (width 256, 4 heads, MLP 1024,
sequence 128, 6.3M parameters) with a mean-pooled 10-class head, Adam, a custom GradientTape step.
(ResNet50 96², the issue's second model, is not wired yet: its BatchNorm would update its moving
statistics again in checkpointing's recompute.) Ways:

- ``plain``: ``tf.function`` of the step;
- ``checkpointing``: the same blocks each wrapped in ``tf.recompute_grad``, ``tf.function`` of
  the step;
- ``tflms``: ``tflms.function(step, device=..., host=...)`` with no other option.

Each (way, batch) runs in a fresh measured process under the real ``--cap``: one warm-up step and
``--steps`` measured ones; per run the status, the per-step peaks, the median step time and
samples/s, and the losses. The largest batch under the cap is the largest of ``--batches`` that
trained. On a GPU (``--gpu``) the measured process is GPU 0 (:func:`tflms.testbed.run_measured`).

Writes benchmarks/results/checkpointing_transformer[_gpu].json. No criterion here.

Usage::

    python benchmarks/checkpointing_testbed.py                          # the transformer, 600 MiB
    python benchmarks/checkpointing_testbed.py --ways plain,tflms --batches 16 --steps 1  # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from report import save_result

from tflms.testing.measured import run_measured

RESULTS = Path(__file__).resolve().parent / "results"
HERE = str(Path(__file__).resolve().parent)
WAYS = ("plain", "checkpointing", "tflms")
#: The transformer of issue 65.
BLOCKS, WIDTH, HEADS, MLP, SEQ, CLASSES = 8, 256, 4, 1024, 128, 10


def _transformer(checkpoint: bool) -> Any:
    """``(call(x), variables)``: the blocks as Keras layers; ``call`` runs them, each block in
    ``tf.recompute_grad`` where ``checkpoint``."""
    import keras
    import tensorflow as tf

    L = keras.layers
    blocks = []
    for i in range(BLOCKS):
        blocks.append(
            (
                L.LayerNormalization(name=f"ln_a{i}"),
                L.MultiHeadAttention(HEADS, WIDTH // HEADS, name=f"attn{i}"),
                L.LayerNormalization(name=f"ln_b{i}"),
                L.Dense(MLP, activation="gelu", name=f"up{i}"),
                L.Dense(WIDTH, name=f"down{i}"),
            )
        )
    head = L.Dense(CLASSES, name="head")

    def block_fn(layers: tuple) -> Any:
        ln_a, attn, ln_b, up, down = layers

        def run(h: Any) -> Any:
            a = ln_a(h)
            h = h + attn(a, a)
            return h + down(up(ln_b(h)))

        return tf.recompute_grad(run) if checkpoint else run

    fns = [block_fn(b) for b in blocks]

    def call(x: Any) -> Any:
        h = x
        for fn in fns:
            h = fn(h)
        return head(tf.reduce_mean(h, axis=1))

    # Built once eagerly so that every variable exists before the step is traced.
    call(tf.zeros((1, SEQ, WIDTH)))
    variables = [v for b in blocks for layer in b for v in layer.trainable_variables] + head.trainable_variables
    return call, variables


def job(way: str, batch: int, steps: int) -> dict[str, Any]:
    """One way at one batch in this measured process: peaks, step times, losses."""
    import time

    import keras
    import numpy as np
    import tensorflow as tf

    import tflms
    from tflms import testbed

    tf.config.experimental.enable_op_determinism()
    device, host = testbed.devices()
    keras.utils.set_random_seed(0)
    with tf.device(device):
        call, variables = _transformer(way == "checkpointing")
        rng = np.random.default_rng(0)
        x = tf.constant(rng.normal(size=(batch, SEQ, WIDTH)).astype("float32"))
        y = tf.constant(rng.integers(0, CLASSES, size=(batch,)).astype("int32"))
        optimizer = keras.optimizers.Adam(1e-3)
        optimizer.build(variables)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, call(x))
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss

    run = tflms.function(step, device=device, host=host) if way == "tflms" else tf.function(step)
    peaks, seconds, losses = [], [], []
    with tf.device(device):
        for _ in range(steps + 1):
            testbed.reset_peak()
            start = time.perf_counter()
            losses.append(float(run(x, y)))
            seconds.append(time.perf_counter() - start)
            peaks.append(int(testbed.memory()["peak"]))
    out: dict[str, Any] = {"peaks": peaks, "step_seconds": seconds, "losses": losses}
    out["median_step_seconds"] = statistics.median(seconds[1:])
    out["samples_per_second"] = batch / out["median_step_seconds"]
    if way == "tflms":
        plan = run.get_plan(x, y)
        out.update(predicted=plan.peak_bytes_after, predicted_plain=plan.peak_bytes_before, swaps=len(plan.swaps))
        out["replans"] = run.replans
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, of {', '.join(WAYS)}")
    parser.add_argument("--batches", default="16,24,48,72,96,144", help="comma-separated batch sizes")
    parser.add_argument("--cap", default="600MiB", help="the real cap of the measured device")
    parser.add_argument("--steps", type=int, default=3, help="measured steps after one warm-up")
    parser.add_argument("--gpu", action="store_true", help="measure GPU 0 instead of the test bed")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = []
    for way in args.ways.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            kwargs = {"way": way, "batch": batch, "steps": args.steps}
            r = run_measured(
                "checkpointing_testbed:job", kwargs, cap=args.cap, gpu=args.gpu, timeout=1800, pythonpath=[HERE]
            )
            row: dict[str, Any] = {
                "way": way,
                "batch": batch,
                "status": r.status,
                "process_seconds": round(r.seconds, 1),
            }
            row.update(r.value if r.ok else {"error": r.error[-1500:]})
            print(
                json.dumps({k: row.get(k) for k in ("way", "batch", "status", "samples_per_second", "peaks")}),
                flush=True,
            )
            rows.append(row)
    largest = {w: max((r["batch"] for r in rows if r["way"] == w and r["status"] == "ok"), default=None) for w in WAYS}
    suffix = "_gpu" if args.gpu else ""
    save_result(
        args.out or RESULTS / f"checkpointing_transformer{suffix}.json",
        "checkpointing_transformer",
        rows,
        source=(
            "GPU 0"
            if args.gpu
            else "tflms test bed (BFC allocator on the CPU as the device, its cap claimed in "
            "one region; a second TF process as the host; TensorFlow's own CPU kernels)"
        ),
        cap=args.cap,
        steps=args.steps,
        warmup=1,
        largest_batch=largest,
        command=" ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
    )


if __name__ == "__main__":
    main()
