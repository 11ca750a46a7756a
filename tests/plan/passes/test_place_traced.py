"""The placer on a traced Keras step with uneven layers: its largest predicted device peak against an
even split by layer count, both evaluated per device with the same simulator."""

import pytest
import tensorflow as tf

from tflms.ir.graph import GraphModel
from tflms.plan.passes.place import anchors, evaluate, forward_order, place, stage_of
from tflms.testing.placement_job import in_layer, uneven

pytestmark = pytest.mark.integration

DEVICES = ["/device:GPU:0", "/device:GPU:1"]


def uneven_step() -> tuple[GraphModel, list[str]]:
    """The two-device test bed's step with uneven layers (:func:`tflms.testing.placement_job.uneven`: two
    wide full-resolution convolutions, then six narrow ones after a 4x pooling) at batch 8, and its
    layers' names."""
    model, x, y, step = uneven(8)
    cf = tf.function(step).get_concrete_function(x, y)
    return GraphModel.from_func_graph(cf.graph), [layer.name for layer in model.layers]


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
