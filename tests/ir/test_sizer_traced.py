"""``func_graph_sizer``: a traced graph read once and sized per batch is the graph read afresh per batch."""

import pytest

from tflms.ir.graph import GraphModel, estimate_bytes, func_graph_sizer
from tflms.ir.trace import keras_train_step
from tflms.testing.zoo import build

pytestmark = pytest.mark.integration


def _read_afresh(graph, batch_size):
    """The reference: every op's outputs read from TensorFlow and sized at once."""
    records = [
        {
            "name": op.name,
            "type": op.type,
            "device": op.device,
            "inputs": [t.name for t in op.inputs],
            "outputs": [
                (
                    t.dtype.name,
                    dims := (tuple(t.shape.as_list()) if t.shape.rank is not None else None),
                    *estimate_bytes(dims, t.dtype.size if t.dtype.is_numpy_compatible else 0, batch_size),
                )
                for t in op.outputs
            ],
            "control_inputs": [c.name for c in op.control_inputs],
        }
        for op in graph.get_operations()
    ]
    return GraphModel.from_ops(records, name=graph.name)


def test_a_graph_read_once_and_sized_per_batch_is_the_graph_read_per_batch():
    model = build("cnn", batch=2, size=16)[0]
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", jit_compile=False)
    graph = keras_train_step(model).graph  # traced with an unknown batch
    sized = func_graph_sizer(graph)
    for batch in (None, 1, 48, 5):
        mine, fresh = sized(batch), _read_afresh(graph, batch)
        assert mine.tensors == fresh.tensors and mine.inputs_of == fresh.inputs_of
        assert list(mine.dag.nodes(data=True)) == list(fresh.dag.nodes(data=True))
        assert list(mine.dag.edges(data=True)) == list(fresh.dag.edges(data=True))
        assert mine.variable_bytes > 0 and mine.variables  # the weights and the optimizer's slots
        assert (mine.variables, mine.variable_bytes) == (
            (found := GraphModel.from_func_graph(graph, batch)).variables,
            found.variable_bytes,
        )
    assert sized(48).tensors != sized(5).tensors  # the batch sizes the tensors
