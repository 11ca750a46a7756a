"""Pass-speed benchmark: time graph model + plan + rewrite on growing training steps.

The steps are Adam training steps of a stack of transformer encoder blocks
(MultiHeadAttention + LayerNorm + MLP) built from Keras layers; the number of
blocks sets the op count. Tracing is not timed (it is TensorFlow's work, and
the same with or without tflms). For each size it times, best of ``--repeat``:

* ``model``: :meth:`tflms.GraphModel.from_func_graph`
* ``plan``: :func:`tflms.make_plan` (candidates, groups, triggers, two simulations)
* ``rewrite``: :func:`tflms.rewrite.apply.apply_plan` + rebuild of the ConcreteFunction,
  editing the traced graph in place as ``@tflms.function`` does on its own traces
* ``copy``: the FuncGraph copy that ``tflms.optimize(cf)`` adds by default so that
  a user's function is never edited (not part of ``total``)

Usage::

    python benchmarks/pass_speed.py                      # sizes 1 8 32 64 blocks
    python benchmarks/pass_speed.py --blocks 1 4 --json out.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import keras
import tensorflow as tf
from report import save_result

import tflms
from tflms import _tf_internal as tfi
from tflms.integrations.function import paused_gc
from tflms.rewrite.apply import apply_plan


def transformer_step(blocks: int, seq: int = 64, dim: int = 128, batch: int = 8):
    """(concrete training step, (model, optimizer)) for ``blocks`` transformer encoder blocks.

    The model must stay referenced while the step is used: functions keep only
    weak references to variables.
    """
    keras.utils.set_random_seed(0)
    L = keras.layers
    inp = keras.Input((seq, dim))
    h = inp
    for _ in range(blocks):
        a = L.MultiHeadAttention(num_heads=4, key_dim=dim // 4)(h, h)
        h = L.LayerNormalization()(h + a)
        f = L.Dense(4 * dim, activation="gelu")(h)
        h = L.LayerNormalization()(h + L.Dense(dim)(f))
    out = L.Dense(10)(L.GlobalAveragePooling1D()(h))
    model = keras.Model(inp, out)
    opt = keras.optimizers.Adam(1e-3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    x = tf.zeros((batch, seq, dim))
    y = tf.zeros((batch,), tf.int32)
    return tf.function(step).get_concrete_function(x, y), (model, opt)


def time_pass(cf, config: tflms.LMSConfig, repeat: int) -> dict:
    best = {"model": float("inf"), "plan": float("inf"), "rewrite": float("inf"), "copy": float("inf")}
    for _ in range(repeat):
        with paused_gc():  # as tflms.optimize does
            t0 = time.perf_counter()
            model = tflms.GraphModel.from_func_graph(cf.graph)
            t1 = time.perf_counter()
            plan = tflms.make_plan(model, config)
            t2 = time.perf_counter()
            graph = tfi.copy_graph(cf)
            t3 = time.perf_counter()
            apply_plan(graph, plan, device=config.device, host=config.host)
            tfi.rebuild(cf, graph)
            t4 = time.perf_counter()
        for key, dt in (("model", t1 - t0), ("plan", t2 - t1), ("copy", t3 - t2), ("rewrite", t4 - t3)):
            best[key] = min(best[key], dt)
    best["total"] = best["model"] + best["plan"] + best["rewrite"]
    return {
        "ops": model.dag.number_of_nodes(),
        "edges": model.dag.number_of_edges(),
        "swaps": len(plan.swaps),
        "swap_ins": plan.n_swap_ins,
        "seconds": {k: round(v, 4) for k, v in best.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 8, 32, 64], help="transformer blocks per size")
    parser.add_argument("--repeat", type=int, default=3, help="timed repetitions per size (best is kept)")
    parser.add_argument("--json", type=Path, default=Path(__file__).resolve().parent / "results" / "pass_speed.json")
    args = parser.parse_args(argv)

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    config = tflms.LMSConfig(device="/device:CPU:1")

    rows = []
    header = ("blocks", "ops", "swaps", "model s", "plan s", "rewrite s", "total s", "+copy s")
    widths = (6, 7, 6, 8, 7, 9, 8, 8)
    print(" ".join(h.rjust(w) for h, w in zip(header, widths)))
    for blocks in args.blocks:
        t0 = time.perf_counter()
        cf, _keep_alive = transformer_step(blocks)
        trace = time.perf_counter() - t0
        row = {
            "blocks": blocks,
            "trace_seconds": round(trace, 2),
            "serialize": config.knobs.serialize,
            **time_pass(cf, config, args.repeat),
        }
        s = row["seconds"]
        print(
            f"{blocks:>6} {row['ops']:>7} {row['swaps']:>6} {s['model']:>8.3f} {s['plan']:>7.3f} "
            f"{s['rewrite']:>9.3f} {s['total']:>8.3f} {s['copy']:>8.3f}",
            flush=True,
        )
        rows.append(row)
    save_result(args.json, "pass_speed", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
