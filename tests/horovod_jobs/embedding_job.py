"""Worker of tests/test_horovod.py's embedding tests, started by ``horovodrun --gloo -np 2``.

A small GPT (token ``Embedding`` plus a learned position table, causal attention,
``BLOCKS`` blocks) trains on every rank's shard of the same global batches. Its token
embedding's gradient is a ``tf.IndexedSlices`` that comes *after* a dense gradient (the
position table, the layer's own weight), the case where ``hvd.grouped_allreduce`` (0.28.1)
fails. The ranks call ``tflms.horovod.init(split_cpu=True)`` and give no ``device``: without
GPU each rank's CPU is split and tflms swaps from ``/device:CPU:1`` to ``/device:CPU:0``.

Cases (``--cases``, run in this order in one process), each from a model built with a
rank-dependent seed (rank 0's variables broadcast), ``STEPS`` steps:

* ``fit_dense``: ``model.fit`` with ``HorovodLMSCallback()`` (default ``sparse_as_dense``);
* ``fit_sparse``: the same with ``HorovodLMSCallback(sparse_as_dense=False)``;
* ``loop_dense``: a ``@tflms.function`` step with ``tflms.horovod.DistributedGradientTape``;
* ``loop_sparse``: the same with ``DistributedGradientTape(tape, sparse_as_dense=False)``.

Writes per case ``<out>/<case>_initial.npz`` (rank 0: model + optimizer state after the
broadcast) and ``<out>/<case>_rank<r>.npz`` (final state), and ``<out>/rank<r>.json``
(losses, plans, structure of the rewritten steps, the kinds of the gradients, the device
tflms resolved, the warnings). Importing this module touches no TensorFlow device: the
test imports it for the model and the data.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import jobkit

VOCAB, LENGTH, DIM, HEADS, BLOCKS = 64, 16, 32, 2, 2
PER_RANK_BATCH = 4  # sequences
STEPS = 3
CASES = ("fit_dense", "fit_sparse", "loop_dense", "loop_sparse")
# No device: init(split_cpu=True) makes /device:CPU:1 the default device on a machine without GPU.
LMS_OPTIONS = {k: v for k, v in jobkit.LMS_OPTIONS.items() if k != "device"}


def build_gpt(seed: int):
    """A functional GPT whose first trainable weight (the position table) has a dense gradient
    and whose second (the token embedding) a sparse one."""
    import keras

    class TokenAndPosition(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.token = keras.layers.Embedding(VOCAB, DIM)

        def build(self, input_shape):
            self.position = self.add_weight(
                shape=(LENGTH, DIM), initializer=keras.initializers.RandomNormal(stddev=0.02), name="position"
            )
            self.token.build(input_shape)

        def call(self, ids):
            return self.token(ids) + self.position

    keras.utils.set_random_seed(seed)
    L = keras.layers
    ids = keras.Input((LENGTH,), dtype="int32")
    h = TokenAndPosition()(ids)
    for _ in range(BLOCKS):
        a = L.LayerNormalization()(h)
        a = L.MultiHeadAttention(HEADS, DIM // HEADS)(a, a, use_causal_mask=True)
        h = L.Add()([h, a])
        f = L.LayerNormalization()(h)
        f = L.Dense(4 * DIM, activation="gelu")(f)
        h = L.Add()([h, L.Dense(DIM)(f)])
    logits = L.Dense(VOCAB)(L.LayerNormalization()(h))
    return keras.Model(ids, logits)


def make_optimizer():
    import keras

    return keras.optimizers.SGD(learning_rate=0.5, momentum=0.9)


def global_batches(n_ranks: int, seed: int = 5) -> list[tuple]:
    """One (tokens, next tokens) global batch per step; rank r trains on rows [r B, (r+1) B)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    n = PER_RANK_BATCH * n_ranks
    out = []
    for _ in range(STEPS):
        seq = rng.integers(0, VOCAB, size=(n, LENGTH + 1)).astype("int32")
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def shard(batch: tuple, rank: int) -> tuple:
    lo, hi = rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH
    return batch[0][lo:hi], batch[1][lo:hi]


def state(model, opt) -> list:
    return list(model.variables) + list(opt.variables)


def reference_run(initial: list, batches: list[tuple]) -> list:
    """One process, plain ``tf.function`` steps on whole global batches from ``initial``: the final state."""
    import tensorflow as tf

    from tflms.testing.zoo import train_step_of

    model, opt, loss = build_gpt(0), make_optimizer(), jobkit.loss_fn()
    opt.build(model.trainable_variables)
    for v, value in zip(state(model, opt), initial, strict=True):
        v.assign(value)

    step = tf.function(train_step_of(model, loss, opt))

    for x, y in batches:
        step(tf.constant(x), tf.constant(y))
    return [v.numpy() for v in state(model, opt)]


def rewritten_structure(graph) -> dict:
    from tflms.rewrite.apply import SWAP_IN_SCOPE, SWAP_OUT_SCOPE

    ops = graph.get_operations()
    outs = [op for op in ops if op.name.startswith(SWAP_OUT_SCOPE + "/")]
    ins = [op for op in ops if op.name.startswith(SWAP_IN_SCOPE + "/")]
    return {
        "horovod_ops": sorted(op.type for op in ops if op.type.startswith("Horovod")),
        "n_swap_out": len(outs),
        "n_swap_in": len(ins),
        "swap_out_devices": sorted({op.device for op in outs}),
        "swap_in_devices": sorted({op.device for op in ins}),
    }


def plan_report(plan, fingerprint) -> dict:
    return {
        "n_swaps": len(plan.swaps),
        "device": plan.options.get("device"),
        "host": plan.options.get("host"),
        "fingerprint": fingerprint,
        "plan_fingerprint": plan.fingerprint(),
    }


def run_fit(case: str, out: str, rank: int, size: int, batches: list) -> dict:
    import keras
    import numpy as np
    import tensorflow as tf

    import tflms.horovod as lms_hvd

    model = build_gpt(0 if rank == 0 else 100 + rank)
    model.compile(optimizer=make_optimizer(), loss=jobkit.loss_fn(), jit_compile=False)
    x = np.concatenate([shard(b, rank)[0] for b in batches])
    y = np.concatenate([shard(b, rank)[1] for b in batches])
    lms = lms_hvd.HorovodLMSCallback(sparse_as_dense=case == "fit_dense", **LMS_OPTIONS)
    begin: list = []

    class AtBegin(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):  # after the LMS callback's broadcast
            begin.extend(v.numpy() for v in state(self.model, self.model.optimizer))

    history = model.fit(x, y, batch_size=PER_RANK_BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[lms, AtBegin()])
    if rank == 0:
        np.savez(os.path.join(out, f"{case}_initial.npz"), *begin)
    np.savez(os.path.join(out, f"{case}_rank{rank}.npz"), *[v.numpy() for v in state(model, model.optimizer)])
    data = tuple(tf.constant(a) for a in shard(batches[0], rank))
    return {
        "loss": history.history["loss"],
        "plan": plan_report(lms.plan, lms.fingerprint),
        "structure": rewritten_structure(lms.step.get_concrete_function(data).graph),
        "rewrite_device": lms.step.memory_report(data)["device"],
        "sparse_as_dense": lms.sparse_as_dense,
    }


def run_loop(case: str, out: str, rank: int, size: int, batches: list) -> dict:
    import numpy as np
    import tensorflow as tf

    import tflms
    import tflms.horovod as lms_hvd
    from tflms.testing.zoo import train_step_of

    model, opt, loss = build_gpt(0 if rank == 0 else 100 + rank), make_optimizer(), jobkit.loss_fn()
    opt.build(model.trainable_variables)
    lms_hvd.broadcast_variables(state(model, opt), root_rank=0)
    if rank == 0:
        np.savez(os.path.join(out, f"{case}_initial.npz"), *[v.numpy() for v in state(model, opt)])
    sparse_as_dense = case == "loop_dense"

    train_step = train_step_of(
        model, loss, opt, lambda tape: lms_hvd.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense)
    )
    step = tflms.function(train_step, **LMS_OPTIONS)

    x0, y0 = (tf.constant(a) for a in shard(batches[0], rank))
    plan = step.get_plan(x0, y0)
    fingerprint = lms_hvd.assert_same_plan(plan)
    losses = [float(step(*(tf.constant(a) for a in shard(b, rank)))) for b in batches]
    np.savez(os.path.join(out, f"{case}_rank{rank}.npz"), *[v.numpy() for v in state(model, opt)])
    return {
        "losses": losses,
        "plan": plan_report(plan, fingerprint),
        "structure": rewritten_structure(step.get_concrete_function(x0, y0).graph),
        "rewrite_device": step.memory_report(x0, y0)["device"],
    }


def gradient_kinds(batches: list) -> list[str]:
    """``'sparse'`` or ``'dense'`` for each trainable variable's gradient (a plain tape, one process's batch)."""
    import tensorflow as tf

    model, loss = build_gpt(0), jobkit.loss_fn()
    x, y = (tf.constant(a) for a in shard(batches[0], 0))
    with tf.GradientTape() as tape:
        value = loss(y, model(x, training=True))
    grads = tape.gradient(value, model.trainable_variables)
    return ["sparse" if isinstance(g, tf.IndexedSlices) else "dense" for g in grads]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()

    import tflms.horovod as lms_hvd

    lms_hvd.init(split_cpu=True)  # first: splits the CPU (no GPU here) before TensorFlow uses it
    import tensorflow as tf

    import tflms

    tf.config.experimental.enable_op_determinism()
    rank, size = lms_hvd.rank(), lms_hvd.size()
    batches = global_batches(size)
    report: dict = {
        "rank": rank,
        "tflms_file": tflms.__file__,
        "logical_devices": sorted(d.name for d in tf.config.list_logical_devices()),
        "resolved_device": tflms.resolve_device(tflms.LMSConfig(**LMS_OPTIONS)),
        "gradient_kinds": gradient_kinds(batches),
    }
    runners = {"fit": run_fit, "loop": run_loop}
    for case in args.cases.split(","):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report[case] = runners[case.split("_")[0]](case, args.out, rank, size, batches)
        report[case]["warnings"] = [str(w.message) for w in caught if issubclass(w.category, tflms.LMSWarning)]
        print(f"rank {rank}: {case} done", file=sys.stderr, flush=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
