"""Shared by the Horovod worker scripts and tests/test_horovod.py: model, data, steps.

Importing this module does not initialise TensorFlow devices; workers call
:func:`split_cpu` first, before anything else touches TensorFlow.
"""

from __future__ import annotations

import hashlib

import keras
import numpy as np
import tensorflow as tf

import tflms
from tflms.testing.zoo import train_step_of

DEVICE = "/device:CPU:1"
HOST = "/device:CPU:0"
#: The two devices a rank places its step on (kind ``placed``).
PLACED = ("/device:CPU:1", "/device:CPU:2")
PER_RANK_BATCH = 8
IMAGE = (16, 16, 3)
CLASSES = 10
# Small thresholds so that the tiny model has several swaps.
KNOBS = tflms.Knobs(swapout_threshold=3, swapin_ahead=2, min_bytes=1024)
LMS_OPTIONS = {"device": DEVICE, "knobs": KNOBS}


def split_cpu() -> None:
    """/device:CPU:1 plays the GPU, /device:CPU:0 the host (as in tests/conftest.py); /device:CPU:2
    is a second device for a placed step (:data:`PLACED`)."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 3)
    tf.config.experimental.enable_op_determinism()


def build_cnn(seed: int) -> keras.Model:
    """A small CNN without BatchNorm/Dropout, so that 2 ranks x B equals 1 process x 2B."""
    keras.utils.set_random_seed(seed)
    L = keras.layers
    return keras.Sequential(
        [
            keras.Input(IMAGE),
            L.Conv2D(8, 3, padding="same", activation="relu"),
            L.Conv2D(8, 3, padding="same", activation="relu"),
            L.MaxPooling2D(),
            L.Conv2D(16, 3, padding="same", activation="relu"),
            L.Flatten(),
            L.Dense(32, activation="relu"),
            L.Dense(CLASSES),
        ]
    )


def make_optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)


def loss_fn() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def global_batches(steps: int, n_ranks: int, seed: int = 123) -> list[tuple[np.ndarray, np.ndarray]]:
    """One (x, y) global batch per step; rank r trains on rows [r*B, (r+1)*B)."""
    rng = np.random.default_rng(seed)
    n = PER_RANK_BATCH * n_ranks
    return [
        (
            rng.normal(size=(n, *IMAGE)).astype("float32"),
            rng.integers(0, CLASSES, size=(n,)).astype("int32"),
        )
        for _ in range(steps)
    ]


def shard(batch: tuple[np.ndarray, np.ndarray], rank: int) -> tuple[tf.Tensor, tf.Tensor]:
    lo, hi = rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH
    return tf.constant(batch[0][lo:hi]), tf.constant(batch[1][lo:hi])


def state(model: keras.Model, opt: keras.optimizers.Optimizer) -> list:
    return list(model.variables) + list(opt.variables)


def digest(arrays: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def reference_run(
    initial: list[np.ndarray], batches: list[tuple[np.ndarray, np.ndarray]], device: str | None = None
) -> tuple[list[float], list[np.ndarray]]:
    """Single process, plain tf.function, whole global batch: (losses, final state)."""
    model, opt, loss = build_cnn(0), make_optimizer(), loss_fn()
    opt.build(model.trainable_variables)
    for v, value in zip(state(model, opt), initial):
        v.assign(value)

    step = tf.function(train_step_of(model, loss, opt))

    losses = []
    with tf.device(device or "/device:CPU:0"):
        for x, y in batches:
            losses.append(float(step(tf.constant(x), tf.constant(y))))
    return losses, [v.numpy() for v in state(model, opt)]


def lms_step(model: keras.Model, opt: keras.optimizers.Optimizer, tape_kind: str, **options) -> tflms.LMSFunction:
    """A ``@tflms.function`` training step whose gradients are averaged by Horovod.

    ``tape_kind``: ``"tflms"`` (tflms.integrations.horovod.DistributedGradientTape on Keras
    variables), ``"grouped"`` (the same with 1 KiB allreduce groups, so several
    groups) or ``"workaround"`` (hvd.DistributedGradientTape on
    ``[v.value for v in model.trainable_variables]``).
    """
    loss = loss_fn()
    options = {**LMS_OPTIONS, **options}
    if options.get("devices"):  # a placed step names its devices instead of one device
        options.pop("device")

    if tape_kind in ("tflms", "grouped"):
        import tflms.integrations.horovod as lms_hvd

        group_bytes = 1024 if tape_kind == "grouped" else lms_hvd.DEFAULT_GROUP_BYTES

        train_step = train_step_of(
            model, loss, opt, lambda tape: lms_hvd.DistributedGradientTape(tape, group_bytes=group_bytes)
        )

    elif tape_kind == "workaround":
        import horovod.tensorflow as hvd

        def train_step(x, y):
            with tf.GradientTape() as tape:
                value = loss(y, model(x, training=True))
            tape = hvd.DistributedGradientTape(tape)
            grads = tape.gradient(value, [v.value for v in model.trainable_variables])
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return value

    else:
        raise ValueError(f"tape_kind must be 'tflms', 'grouped' or 'workaround'. Received: tape_kind={tape_kind!r}")
    return tflms.function(train_step, **options)


def graph_structure(graph) -> dict:
    """What a rewritten step's graph holds: its Horovod ops and their devices, every op's device, and
    the swap-outs' and swap-ins' counts, devices, inputs (swap-outs) and triggers (swap-ins)."""
    from tflms.rewrite.apply import SWAP_IN_SCOPE, SWAP_OUT_SCOPE

    ops = graph.get_operations()
    outs = [op for op in ops if op.name.startswith(SWAP_OUT_SCOPE + "/")]
    ins = [op for op in ops if op.name.startswith(SWAP_IN_SCOPE + "/")]
    return {
        "horovod_ops": sorted(op.type for op in ops if op.type.startswith("Horovod")),
        "horovod_devices": sorted({op.device for op in ops if op.type.startswith("Horovod")}),
        "op_devices": sorted({op.device for op in ops}),
        "n_swap_out": len(outs),
        "n_swap_in": len(ins),
        "swap_in_devices": sorted({op.device for op in ins}),
        "swap_out_devices": sorted({op.device for op in outs}),
        "swap_out_input_types": sorted(op.inputs[0].op.type for op in outs),
        "swap_in_trigger_types": sorted(c.type for op in ins for c in op.control_inputs),
    }
