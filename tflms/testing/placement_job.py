"""One run of the two-device test bed (``tests/testing/test_placement_testbed.py``,
``benchmarks/placement_testbed.py``), in a measured process started with
``tflms.testbed.device_environ(cap)``: this process's CPU is device 0 and a
:class:`tflms.testing.device_worker.DeviceWorker` (the same cap) device 1.

``python -m tflms.testing.placement_job MODE BATCH CAP_MIB [MODEL]`` (or the script
``tests/placement_testbed_job.py``, the same) with MODE ``plain`` (the step on
device 0 alone), ``placed`` (``devices=[device 0, device 1]``) or, for MODEL ``uneven``, ``placer``
(the placer's stages) and ``even`` (an even split by layer count), each applied to the step's graph
with :func:`tflms.rewrite.apply.apply_placement`; CAP_MIB 0 for no cap; MODEL ``cnn`` (the zoo's
CNN, 64 px, the default) or ``uneven`` (:func:`uneven`). Prints ``RESULT`` and a JSON object: the
losses of 3 Adam steps and, per step, the measured peak of each device (bytes, each read from its
own allocator), and the predicted peaks per device. An out-of-memory in either process ends the run
without a ``RESULT`` line, or with ``status: "oom"`` where TensorFlow raised it.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from .. import _tf_internal as tfi
from ..integrations.function import function
from ..ir.graph import GraphModel
from ..plan.passes.place import anchors, evaluate, forward_order, place, stage_of
from ..rewrite.apply import apply_placement
from . import testbed
from .device_worker import DeviceWorker
from .zoo import build, train_step_of

STEPS = 3


def uneven(batch: int) -> tuple[keras.Model, Any, Any, Any]:
    """``(model, x, y, train_step)``: two wide full-resolution convolutions, then six narrow ones
    after a 4x pooling, ten layers whose activations differ 16- to 64-fold (64 px, Adam)."""
    keras.utils.set_random_seed(0)
    L = keras.layers
    layers = [keras.Input((64, 64, 3))]
    layers += [L.Conv2D(64, 3, padding="same", activation="relu", name=f"wide{i}") for i in range(2)]
    layers += [L.MaxPooling2D(4, name="pool")]
    layers += [L.Conv2D(16, 3, padding="same", activation="relu", name=f"narrow{i}") for i in range(6)]
    layers += [L.GlobalAveragePooling2D(name="gap"), L.Dense(10, name="head")]
    model = keras.Sequential(layers, name="uneven")
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(batch, 64, 64, 3)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, size=(batch,)).astype("int32"))
    return model, x, y, train_step_of(model, loss_fn, optimizer)


def in_layer(op: str, name: str) -> bool:
    """Whether ``op`` is under the name scope of Keras layer ``name`` (``name`` or ``name_1``...)."""
    return any(re.fullmatch(rf"{name}(_\d+)?", part) for part in op.split("/")[:-1])


def even_split(model: GraphModel, names: list[str]) -> dict[str, int]:
    """Each op's stage in an even split of ``model`` by layer count (layers ``names``, in order): the
    first half of the layers on stage 0, the rest on stage 1."""
    forward = forward_order(model)
    half = names[len(names) // 2]
    return stage_of(anchors(model, forward), [next(i for i, op in enumerate(forward) if in_layer(op, half))])


def staged(step: Any, x: Any, y: Any, devices: list[str], names: list[str] | None) -> tuple[Any, list[int]]:
    """``(step placed on devices, predicted peak per device)``: the placer's stages, or with layer
    ``names`` an even split by them, applied to a copy of the step's graph."""
    cf = tf.function(step).get_concrete_function(x, y)
    model = GraphModel.from_func_graph(cf.graph)
    stages = place(model, devices) if names is None else evaluate(model, devices, even_split(model, names))
    graph = tfi.copy_graph(cf)
    apply_placement(graph, stages)
    return tfi.rebuild(cf, graph), [st.peak_bytes for st in stages]


def main(mode: str, batch: int, cap_mib: int, name: str = "cnn") -> dict:
    tf.config.experimental.enable_op_determinism()
    testbed.claim_memory()
    cap = f"{cap_mib}MiB" if cap_mib else None
    out: dict = {"mode": mode, "model": name, "batch": batch, "cap_mib": cap_mib, "losses": [], "peaks": []}
    with DeviceWorker(cap=cap) as dev1:
        dev1.connect()
        devices = [testbed.DEVICE, dev1.device]
        with tf.device(testbed.DEVICE):
            model, x, y, step = build("cnn", batch=batch, size=64) if name == "cnn" else uneven(batch)
        if mode == "plain":
            fn = tf.function(step)
        elif mode in ("placer", "even"):
            names = [layer.name for layer in model.layers] if mode == "even" else None
            fn, out["predicted"] = staged(step, x, y, devices, names)
        else:
            fn = function(step, devices=devices, host=testbed.HOST)
            plan = fn.get_plan(x, y)
            out["predicted"] = [st.peak_bytes for st in plan.placement]
            out["predicted_plain"] = plan.peak_bytes_before
        try:
            for _ in range(STEPS):
                testbed.reset_peak()
                dev1.reset_peak()
                with tf.device(testbed.DEVICE):
                    loss = fn(x, y)
                out["losses"].append(float(loss.numpy()))
                out["peaks"].append([testbed.memory()["peak"], dev1.peak()])
        except tf.errors.ResourceExhaustedError as err:
            out["status"] = "oom"
            out["error"] = str(err)[:300]
            return out
        out["status"] = "ok" if dev1.alive else "worker died"
    return out


def cli(argv: list[str] | None = None) -> None:
    """``MODE BATCH CAP_MIB [MODEL]`` (the module doc): prints ``RESULT`` and the JSON of :func:`main`."""
    args = sys.argv[1:] if argv is None else argv
    result = main(args[0], int(args[1]), int(args[2]), *args[3:4])
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    cli()
