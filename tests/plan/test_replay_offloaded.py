"""``replay`` of an offloaded plan on a step that already has the offload applied (``plan.model``
of a plan made by :func:`tflms.function`) gives that step again: the offload is not applied twice."""

import pytest
import tensorflow as tf

import tflms
from tflms.emulate.simulator import Simulator
from tflms.plan.registry import replay
from tflms.testing.zoo import build

from conftest import DEVICE, HOST

pytestmark = pytest.mark.integration


def test_replay_on_the_offloaded_step_changes_nothing():
    _, x, y, step = build("gpt", 2, width=64, layers=2, offload_host=HOST)
    cf = tf.function(step).get_concrete_function(x, y)
    _, plan = tflms.optimize(cf, device=DEVICE, host=HOST, offload="optimizer", budget="64GiB")
    once = replay(tflms.GraphModel.from_func_graph(cf.graph), plan)
    twice = replay(once, plan)
    assert sorted(twice.dag.nodes) == sorted(once.dag.nodes)
    assert twice.variable_bytes == once.variable_bytes
    assert Simulator(twice, HOST).peak() == Simulator(once, HOST).peak() == plan.peak_bytes_after
