"""``apply_placement`` on a traced step in this process (the two logical CPUs of ``conftest.py`` as
the two devices): the devices it sets, what it leaves to TensorFlow's placer, idempotence, and the
placed step's numbers. Three devices and the host, for every zoo model: ``tests/integrations/test_placement.py``."""

import numpy as np
import pytest
import tensorflow as tf

from tflms import _tf_internal as tfi
from tflms._devices import same_device
from tflms.ir.graph import GraphModel
from tflms.plan.passes.place import place
from tflms.rewrite.apply import SWAP_ATTR, apply_placement, is_rewritten

import zoo
from conftest import DEVICE, HOST

pytestmark = pytest.mark.integration

DEVICES = [DEVICE, HOST]  # no host is needed without swaps: both logical CPUs play devices


@pytest.fixture(scope="module")
def traced():
    shared = zoo.shared("cnn")
    model = GraphModel.from_func_graph(shared.cf.graph)
    return shared, place(model, DEVICES)


def test_apply_placement_sets_each_stage_device_and_leaves_variables_to_tensorflow(traced):
    shared, stages = traced
    graph = tfi.copy_graph(shared.cf)
    assert not is_rewritten(graph)
    count = apply_placement(graph, stages)
    where = {op: st.device for st in stages for op in st.ops}
    placed = 0
    for op in graph.get_operations():
        resource = op.type == "Placeholder" or any(t.dtype == tf.resource for t in op.inputs)
        if resource:
            assert op.device == shared.cf.graph.get_operation_by_name(op.name).device  # untouched
        else:
            assert same_device(op.device, where[op.name]) and op.get_attr(SWAP_ATTR) == b"place"
            placed += 1
    assert count == placed > 0 and is_rewritten(graph)
    # Twice: the same devices.
    before = {op.name: op.device for op in graph.get_operations()}
    assert apply_placement(graph, stages) == count
    assert {op.name: op.device for op in graph.get_operations()} == before
    # Both devices hold forward and backward ops.
    for device in DEVICES:
        names = [op for op, d in where.items() if d == device]
        assert any(n.startswith("gradient_tape/") for n in names) and any(n.startswith("sequential") for n in names)


def test_placed_cnn_trains_bit_identically(traced):
    shared, stages = traced
    graph = tfi.copy_graph(shared.cf)
    apply_placement(graph, stages)
    placed = tfi.rebuild(shared.cf, graph)
    plain_losses, plain_state = shared.plain_run(3)
    losses, state = zoo.run_steps(shared.setup, placed, n=3)
    assert np.array_equal(losses, plain_losses)
    assert all(np.array_equal(a, b) for a, b in zip(state, plain_state))


def test_a_placement_of_another_step_is_refused(traced):
    shared, stages = traced
    other = tf.function(lambda x: x * 2.0).get_concrete_function(tf.TensorSpec((2,), tf.float32))
    with pytest.raises(ValueError, match="the placement does not fit this function: no op"):
        apply_placement(tfi.copy_graph(other), stages)
