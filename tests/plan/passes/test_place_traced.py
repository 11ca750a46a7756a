"""The placer on a traced Keras step with uneven layers: its largest predicted device peak against an
even split by layer count, both evaluated per device with the same simulator."""

import re

import keras
import pytest
import tensorflow as tf

from tflms.ir.graph import GraphModel
from tflms.plan.passes.place import anchors, evaluate, forward_order, place, stage_of

pytestmark = pytest.mark.integration

DEVICES = ["/device:GPU:0", "/device:GPU:1"]


def uneven_step() -> GraphModel:
    """Two wide full-resolution convolutions, then eight narrow ones after a 4x pooling: ten layers
    whose activations differ 16- to 64-fold (Adam, batch 8, 64 px)."""
    keras.utils.set_random_seed(0)
    L = keras.layers
    layers = [keras.Input((64, 64, 3))]
    layers += [L.Conv2D(64, 3, padding="same", activation="relu", name=f"wide{i}") for i in range(2)]
    layers += [L.MaxPooling2D(4, name="pool")]
    layers += [L.Conv2D(16, 3, padding="same", activation="relu", name=f"narrow{i}") for i in range(6)]
    layers += [L.GlobalAveragePooling2D(name="gap"), L.Dense(10, name="head")]
    model = keras.Sequential(layers, name="uneven")
    opt = keras.optimizers.Adam(1e-3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    cf = step.get_concrete_function(tf.TensorSpec((8, 64, 64, 3)), tf.TensorSpec((8,), tf.int32))
    return GraphModel.from_func_graph(cf.graph), [layer.name for layer in model.layers]


def in_layer(op: str, name: str) -> bool:
    """Whether ``op`` is under the name scope of Keras layer ``name`` (``name`` or ``name_1``...)."""
    return any(re.fullmatch(rf"{name}(_\d+)?", part) for part in op.split("/")[:-1])


def test_placer_beats_an_even_split_by_layer_count_by_20_percent():
    model, names = uneven_step()
    forward = forward_order(model)
    half = names[len(names) // 2]  # the first layer of the second half
    first = next(i for i, op in enumerate(forward) if in_layer(op, half))
    even = stage_of(anchors(model, forward), [first])
    # The even split really splits by layers: each layer's forward ops on one side of the cut.
    for name in names:
        sides = {even[op] for op in forward if in_layer(op, name)}
        assert len(sides) == 1, (name, sides)
    assert {even[op] for op in forward if in_layer(op, names[0])} == {0}
    even_peak = max(st.peak_bytes for st in evaluate(model, DEVICES, even))
    placed = place(model, DEVICES)
    placed_peak = max(st.peak_bytes for st in placed)
    assert placed_peak <= 0.8 * even_peak, (placed_peak, even_peak)
