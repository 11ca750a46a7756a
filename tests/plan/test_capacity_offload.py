"""The capacity search with ``offload=``: every batch size is searched as the step runs with the
offload (:func:`tflms.plan.capacity.offloaded`), so the optimizer's state no longer counts on the
device."""

import keras
import pytest

import tflms
from tflms.ir.trace import graph_source
from tflms.plan.capacity import offloaded
from tflms.testing.zoo import build

pytestmark = pytest.mark.integration


def test_offloading_the_optimizer_raises_the_largest_batch():
    """A budget of the offloaded step's peak at batch 1: the plain step does not fit it there."""
    model = build("gpt", 1, width=64)[0]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss, jit_compile=False)
    config = tflms.LMSConfig(offload="optimizer")
    step = graph_source(model)(1)
    budget = tflms.Simulator(offloaded(step, config), config.host).peak()
    assert tflms.Simulator(step, config.host).peak() > budget
    plain = tflms.max_batch_size(model, budget, limit=2)
    offload = tflms.max_batch_size(model, budget, limit=2, offload="optimizer")
    assert plain.without_lms == 0 and offload.without_lms == 1
    assert offload.with_lms >= plain.with_lms
