"""GraphModel of a traced TensorFlow step (the hand-built graphs are in tests/unit/test_graph.py)."""

import pytest
import tensorflow as tf

from tflms.ir.graph import GraphModel

import zoo

pytestmark = pytest.mark.integration


def test_from_tf_graph_tags_phases_and_shapes():
    _, step = zoo.tiny_step()
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
