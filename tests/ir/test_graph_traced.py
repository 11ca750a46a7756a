"""GraphModel of a traced TensorFlow step (the hand-built graphs are in tests/unit/test_graph.py)."""

import keras
import pytest
import tensorflow as tf

from tflms.ir.graph import GraphModel

pytestmark = pytest.mark.integration


def test_from_tf_graph_tags_phases_and_shapes():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.1)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    cf = step.get_concrete_function(tf.TensorSpec((None, 8)), tf.TensorSpec((None, 1)))
    m = GraphModel.from_func_graph(cf.graph, batch_size=32)
    relu = next(n for n in m.dag if n.endswith("Relu"))
    t = m.tensors[f"{relu}:0"]
    assert t.shape == (None, 16) and t.estimated and t.bytes == 32 * 16 * 4
    phases = {n: m.phase(n) for n in m.dag}
    assert phases[relu] == "forward"
    assert any(p == "backward" for p in phases.values())
    assert all(phases[n] == "backward" for n in m.dag if n.startswith("gradient_tape/"))
    assert all(phases[n] == "update" for n in m.dag if m.dag.nodes[n]["type"] == "AssignSubVariableOp")
    # kernel (8x16) + bias (16) + kernel (16x1) + bias (1) floats, SGD iteration (int64) + lr (float)
    assert m.variable_bytes == (8 * 16 + 16 + 16 + 1) * 4 + 8 + 4
