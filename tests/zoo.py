"""Small training setups used by the rewrite tests: model, loss, one batch.

The models that :mod:`tflms.testing.zoo` shares (the CNN, ResNet50, the transformer) are built
there, here in the tests' small variants; the training step is its :func:`~tflms.testing.zoo.train_step_of`.

Each factory returns a :class:`Setup`; :func:`run_steps` trains it from the same
initial state for a few steps and returns losses and final variables, so a plain
and an LMS step can be compared exactly on one model object.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

import tflms
from tflms.testing.zoo import make_model, train_step_of


@dataclasses.dataclass
class Setup:
    name: str
    model: keras.Model
    loss: keras.losses.Loss
    optimizer: keras.optimizers.Optimizer
    x: tf.Tensor
    y: tf.Tensor

    def __post_init__(self) -> None:
        self.optimizer.build(self.model.trainable_variables)
        self._initial = [v.numpy() for v in self.state()]

    def state(self) -> list:
        return list(self.model.variables) + list(self.optimizer.variables)

    def reset(self) -> None:
        for v, value in zip(self.state(), self._initial):
            v.assign(value)

    def step_fn(self) -> Callable:
        return train_step_of(self.model, self.loss, self.optimizer)


def run_steps(setup: Setup, step: Callable, n: int = 3, device: str | None = "/device:CPU:1"):
    """Train ``n`` steps from the initial state: (losses, variables as numpy)."""
    setup.reset()
    losses = []
    for _ in range(n):
        if device is None:
            losses.append(step(setup.x, setup.y).numpy())
        else:
            with tf.device(device):
                losses.append(step(setup.x, setup.y).numpy())
    return np.array(losses), [v.numpy() for v in setup.state()]


def tiny_step() -> tuple[keras.Model, Callable]:
    """The smallest traced training step, for the tests of TensorFlow's graphs: (model, step). The
    model is 8 -> Dense(16, relu) -> Dense(1) (seed 0); ``step(x, y)`` is the ``tf.function`` of
    :func:`~tflms.testing.zoo.train_step_of` with the mean squared error and SGD(0.1)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    step = train_step_of(model, lambda y, prediction: tf.reduce_mean((prediction - y) ** 2), keras.optimizers.SGD(0.1))
    return model, tf.function(step)


def plain_step(model: keras.Model, step_fn: Callable, optimizer: keras.optimizers.Optimizer, device: str) -> Callable:
    """The plain step of ``step_fn`` as a ``tf.function``, ``optimizer`` built beside ``model``'s
    weights on ``device``: what an offloaded step is compared with."""
    with tf.device(device):
        optimizer.build(model.trainable_variables)
    return tf.function(step_fn)


def train_batches(step: Callable, batches: list, model: keras.Model, device: str) -> tuple[list, list]:
    """(losses of ``step`` over ``batches``, one step each, on ``device``; ``model``'s variables after, as numpy)."""
    losses = []
    with tf.device(device):
        for x, y in batches:
            losses.append(step(x, y).numpy())
    return losses, [v.numpy() for v in model.variables]


def offload_run(
    model: keras.Model,
    step_fn: Callable,
    optimizer: keras.optimizers.Optimizer,
    batches: list,
    offload: str | None,
    device: str,
    host: str,
    **options,
) -> tuple[list, list, Callable]:
    """(losses, ``model``'s variables after, the step) of ``batches`` through ``step_fn``: with
    ``offload``, ``tflms.function(..., offload=offload, **options)`` (``optimizer`` already built
    on the host); without, :func:`plain_step`."""
    if offload:
        step = tflms.function(step_fn, device=device, host=host, offload=offload, **options)
    else:
        step = plain_step(model, step_fn, optimizer, device)
    return (*train_batches(step, batches, model, device), step)


@dataclasses.dataclass(eq=False)  # hashed by identity, for plain_run's cache
class Shared:
    """One model's setup, its plain step traced once, and the plain step's training results:
    for the tests of one pytest process that compare rewrites of the same step (tracing
    ResNet50 takes about 10 s, and a traced step's first call as long again on 2 cores).
    ``make test`` runs each test file in one process (``pytest-xdist --dist loadfile``)."""

    setup: Setup
    plain: Callable  # the tf.function of the plain step
    cf: Callable  # its concrete function for (setup.x, setup.y)

    @functools.cache  # noqa: B019 (one instance per model, kept for the process)
    def plain_run(self, n: int = 3) -> tuple:
        """``run_steps(setup, plain, n)``, computed once per ``n``: (losses, variables)."""
        return run_steps(self.setup, self.plain, n=n)


@functools.cache
def shared(name: str, **kwargs) -> Shared:
    """The :class:`Shared` setup of ``ZOO[name](**kwargs)``, made once per process."""
    setup = ZOO[name](**kwargs)
    plain = tf.function(setup.step_fn())
    return Shared(setup, plain, plain.get_concrete_function(setup.x, setup.y))


def _classification(name, model, batch, input_shape, classes, seed=0, optimizer=None):
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.normal(size=(batch, *input_shape)).astype("float32"))
    y = tf.constant(rng.integers(0, classes, size=(batch,)).astype("int32"))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return Setup(name, model, loss, optimizer or keras.optimizers.Adam(1e-3), x, y)


def mlp() -> Setup:
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((64,))] + [keras.layers.Dense(256, activation="relu") for _ in range(6)] + [keras.layers.Dense(10)]
    )
    return _classification("mlp", model, 64, (64,), 10)


#: The rewrite tests' CNN: two blocks of 32 filters, a max pooling, two of 64 with a Dropout between
#: them, global average pooling, a Dropout and the head.
CNN_BLOCKS = ((32, None), (32, "pool"), (64, 0.25), (64, None))


def cnn() -> Setup:
    keras.utils.set_random_seed(2)
    model = make_model("cnn", 32, blocks=CNN_BLOCKS, head_dropout=0.25)
    return _classification("cnn", model, 16, (32, 32, 3), 10)


def resnet50(batch: int = 4, size: int = 64) -> Setup:
    keras.utils.set_random_seed(3)
    return _classification("resnet50", make_model("resnet50", size), batch, (size, size, 3), 10)


def transformer() -> Setup:
    """One post-norm block of width 64 (4 heads, attention dropout 0.1) on sequences of 32."""
    keras.utils.set_random_seed(4)
    model = make_model("transformer", 32, dim=64, heads=4, layers=1, dropout=0.1)
    return _classification("transformer", model, 16, (32, 64), 10)


def lstm() -> Setup:
    keras.utils.set_random_seed(5)
    L = keras.layers
    model = keras.Sequential(
        [
            keras.Input((20, 16)),
            L.Dense(64, activation="relu"),
            L.LSTM(64, return_sequences=True),
            L.LSTM(32),
            L.Dense(5),
        ]
    )
    return _classification("lstm", model, 32, (20, 16), 5)


def nasnet(batch: int = 2) -> Setup:
    """NASNetMobile at 32x32 with SGD: separable convolutions, many small concatenations
    and ``MaxPool`` in the reduction cells (see ``tflms.plan.candidates.PINNED_INPUTS``)."""
    keras.utils.set_random_seed(6)
    model = keras.applications.NASNetMobile(
        weights=None, input_shape=(32, 32, 3), classes=10, classifier_activation=None
    )
    return _classification("nasnet", model, batch, (32, 32, 3), 10, optimizer=keras.optimizers.SGD(0.01))


def unet3d(batch: int = 2, size: int = 16) -> Setup:
    """A small 3-D U-Net: Conv3D (bias, ReLU) pairs, MaxPool3D down, UpSampling3D up, skip
    concatenations, per-voxel softmax (see ``tflms.plan.candidates.PINNED_INPUTS``)."""
    keras.utils.set_random_seed(7)
    L = keras.layers

    def block(h, filters):
        for _ in range(2):
            h = L.Conv3D(filters, 3, padding="same", activation="relu")(h)
        return h

    inp = keras.Input((size, size, size, 1))
    skips, h = [], inp
    for filters in (8, 16):
        h = block(h, filters)
        skips.append(h)
        h = L.MaxPooling3D(2)(h)
    h = block(h, 32)
    for filters, skip in zip((16, 8), reversed(skips)):
        h = block(L.Concatenate()([L.UpSampling3D(2)(h), skip]), filters)
    out = L.Conv3D(3, 1, activation="softmax")(h)
    rng = np.random.default_rng(7)
    x = tf.constant(rng.normal(size=(batch, size, size, size, 1)).astype("float32"))
    y = tf.constant(rng.integers(0, 3, size=(batch, size, size, size)).astype("int32"))
    loss = keras.losses.SparseCategoricalCrossentropy()
    return Setup("unet3d", keras.Model(inp, out), loss, keras.optimizers.Adam(1e-3), x, y)


ZOO = {
    "mlp": mlp,
    "cnn": cnn,
    "resnet50": resnet50,
    "transformer": transformer,
    "lstm": lstm,
    "nasnet": nasnet,
    "unet3d": unet3d,
}
