"""``offload="weights"`` on the one-process CPU pair: bit-identical steps, placement, gating, errors.

``/device:CPU:1`` plays the device and ``/device:CPU:0`` the host (``conftest.py``). The model (a
small GPT of ``tflms.testing.zoo``: embeddings, attention, LayerNorm, Dense) is built once on the
device; each run restores its initial weights on the device, makes a fresh optimizer, and for the
offloaded run moves the trainable variables to the host (``place_weights``) and builds the
optimizer there. Memory is measured on the test bed (``tests/testing/test_offload_testbed.py``).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tflms
from tflms.integrations.offload import place_weights
from tflms.ir.devices import same_device
from tflms.ir.graph import GraphModel
from tflms.plan.passes.offload import offload_decisions, with_offload
from tflms.testing.zoo import _gpt

from conftest import DEVICE, HOST

pytestmark = pytest.mark.integration

OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(1e-3),
    "adamw": lambda: keras.optimizers.AdamW(1e-3, weight_decay=0.01),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
}
STEPS = 3
ROOMY = {"budget": "64GiB"}
SEQ, VOCAB = 16, 64


class Setup:
    def __init__(self) -> None:
        keras.utils.set_random_seed(0)
        rng = np.random.default_rng(0)
        self.batches = [
            (
                tf.constant(rng.integers(0, VOCAB, (4, SEQ)).astype("int32")),
                tf.constant(rng.integers(0, VOCAB, (4, SEQ)).astype("int32")),
            )
            for _ in range(STEPS)
        ]
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        keras.utils.set_random_seed(0)
        with tf.device(DEVICE):
            self.model = _gpt(SEQ, vocab=VOCAB, dim=32, heads=2, layers=3)
        self.initial = [v.numpy() for v in self.model.variables]

    def reset(self) -> None:
        """Initial weights, every variable back on the device."""
        for v, value in zip(self.model.variables, self.initial):
            if not same_device(v.value.device, DEVICE):
                with tf.init_scope(), tf.device(DEVICE):
                    v._value = tf.Variable(value, trainable=v.trainable, dtype=v.value.dtype)
            v.assign(value)

    def step_fn(self, optimizer):
        model, loss_fn = self.model, self.loss_fn

        def train_step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return train_step

    def run(self, name: str, offload: str | None, **options):
        self.reset()
        optimizer = OPTIMIZERS[name]()
        if offload == "weights":
            place_weights(self.model, HOST)
        if offload:
            tflms.build_optimizer(optimizer, self.model.trainable_variables, HOST)
            step = tflms.function(
                self.step_fn(optimizer), device=DEVICE, host=HOST, offload=offload, **(options or ROOMY)
            )
        else:
            with tf.device(DEVICE):
                optimizer.build(self.model.trainable_variables)
            step = tf.function(self.step_fn(optimizer))
        losses = []
        with tf.device(DEVICE):
            for x, y in self.batches:
                losses.append(step(x, y).numpy())
        return losses, [v.numpy() for v in self.model.variables], step, optimizer


@pytest.fixture(scope="module")
def setup():
    return Setup()


def _assert_same(a, b):
    assert a[0] == b[0]  # losses, bit for bit
    for u, v in zip(a[1], b[1]):
        np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_weights_offloaded_step_is_bit_identical(setup, name):
    plain = setup.run(name, None)
    off = setup.run(name, "weights")
    assert plain[0][0] != plain[0][-1]
    _assert_same(plain, off)
    assert all(same_device(v.value.device, HOST) for v in setup.model.trainable_variables)
