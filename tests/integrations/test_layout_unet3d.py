"""A rewritten step on a CPU device runs with the ``ConfigProto`` of a plain ``tf.function`` call
(Grappler's layout optimizer left as TensorFlow has it: on a CPU it converts nothing unless
``cpu_layout_conversion`` asks it to), and a Conv3D U-Net trains bit-identically to the plain step."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2

import tflms
from tflms import _tf_internal as tfi
from tflms.testing.zoo import train_step_of

from conftest import DEVICE, HOST
from helpers import check_structure, check_survives_grappler

pytestmark = pytest.mark.integration

SIZE = 64  # a 64³ volume, one channel
STEPS = 4
RewriterConfig = rewriter_config_pb2.RewriterConfig


def _unet3d(size: int = SIZE, channels: int = 4, levels: int = 2) -> keras.Model:
    """A small 3D U-Net: two Conv3D/BatchNorm/ReLU per level, max-pooling down, Conv3DTranspose
    and UpSampling3D up (one each), Concatenate skips, a sigmoid 1x1x1 head."""

    def block(h, c):
        for _ in range(2):
            h = keras.layers.Conv3D(c, 3, padding="same", use_bias=False)(h)
            h = keras.layers.BatchNormalization()(h)
            h = keras.layers.Activation("relu")(h)
        return h

    inputs = keras.Input((size, size, size, 1))
    h, skips, c = inputs, [], channels
    for _ in range(levels):
        h = block(h, c)
        skips.append(h)
        h = keras.layers.MaxPooling3D(2)(h)
        c *= 2
    h = block(h, c)
    for k, skip in enumerate(reversed(skips)):
        c //= 2
        h = keras.layers.Conv3DTranspose(c, 2, strides=2)(h) if k == 0 else keras.layers.UpSampling3D(2)(h)
        h = block(keras.layers.Concatenate()([h, skip]), c)
    return keras.Model(inputs, keras.layers.Conv3D(1, 1, activation="sigmoid")(h))


@pytest.fixture
def call_configs(monkeypatch):
    """The ``RewriterConfig`` in the thread's function call options at each call of a
    ConcreteFunction (tflms.function calls its rewritten one so): what the runtime instantiates
    the step with."""
    seen = []
    call = tfi.ConcreteFunction.__call__

    def recording(self, *args, **kwargs):
        seen.append(tfi._call_config().graph_options.rewrite_options)  # noqa: SLF001
        return call(self, *args, **kwargs)

    monkeypatch.setattr(tfi.ConcreteFunction, "__call__", recording)
    return seen


def test_a_conv3d_unet_trains_bit_identically_with_the_layout_optimizer_as_tensorflow_has_it(call_configs):
    """The issue's case: tflms.function on ``/device:CPU:1`` against tf.function, one process.
    The rewritten step swaps, is called with TensorFlow's own layout setting (not ``OFF``), and
    its losses and every variable (weights, BatchNorm statistics, optimizer slots) after each of
    4 steps are bit-identical to the plain step's."""
    keras.utils.set_random_seed(0)
    model = _unet3d()
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((1, SIZE, SIZE, SIZE, 1), dtype=np.float32))
    y = tf.constant((rng.random((1, SIZE, SIZE, SIZE, 1)) > 0.5).astype(np.float32))
    initial = [v.numpy() for v in model.variables]
    loss_fn = keras.losses.BinaryCrossentropy()

    def train(lms):
        for v, value in zip(model.variables, initial, strict=True):
            v.assign(value)
        opt = keras.optimizers.Adam(1e-2)
        opt.build(model.trainable_variables)

        step = train_step_of(model, loss_fn, opt)

        fn = tflms.function(step, device=DEVICE, knobs=tflms.Knobs(min_bytes=1 << 20)) if lms else tf.function(step)
        losses, variables = [], []
        for _ in range(STEPS):
            losses.append(float(fn(x, y)))
            variables.append([v.numpy() for v in [*model.variables, *opt.variables]])
        return fn, losses, variables

    _, plain_losses, plain_variables = train(lms=False)
    call_configs.clear()
    step, losses, variables = train(lms=True)

    plan = step.get_plan(x, y)
    cf = step.get_concrete_function(x, y)
    assert plan.swaps, "the plan swaps nothing: the test would not test a rewritten step"
    check_structure(cf, plan, DEVICE, HOST)
    check_survives_grappler(cf, DEVICE)
    assert losses == plain_losses
    assert losses[-1] < losses[0]
    for k in range(STEPS):
        assert len(variables[k]) == len(plain_variables[k])
        differ = [i for i, (a, b) in enumerate(zip(variables[k], plain_variables[k])) if not np.array_equal(a, b)]
        assert not differ, f"after step {k + 1}, {len(differ)} of {len(variables[k])} variables differ"

    # Every call of the rewritten step left the layout optimizer as the plain step has it.
    plain_layout = tfi._call_config().graph_options.rewrite_options.layout_optimizer  # noqa: SLF001
    assert len(call_configs) == STEPS
    assert {c.layout_optimizer for c in call_configs} == {plain_layout} != {RewriterConfig.OFF}
    assert {c.memory_optimization for c in call_configs} == {RewriterConfig.MANUAL}  # the other knob still set


def test_on_a_cpu_the_layout_optimizer_changes_nothing_unless_asked_to_convert():
    """Pins the TensorFlow fact behind the rule (``GenericLayoutOptimizer`` on a CPU): the U-Net's
    step comes out of Grappler the same with the layout optimizer on or off, while with
    ``cpu_layout_conversion=NCHW_TO_NHWC`` a channels-first convolution gets Transposes.
    ``tfi.layout_converts`` answers accordingly, and ``True`` for a GPU."""
    keras.utils.set_random_seed(0)
    model = _unet3d(size=16)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(x, training=True))
        return tape.gradient(loss, model.trainable_variables)

    cf = step.get_concrete_function(tf.TensorSpec((1, 16, 16, 16, 1)))

    def optimized(**fields):
        config = config_pb2.ConfigProto()
        for name, value in fields.items():
            setattr(config.graph_options.rewrite_options, name, value)
        return tfi.grappler_optimize(cf, DEVICE, config)

    on, off = optimized(), optimized(layout_optimizer=RewriterConfig.OFF)
    assert [n.SerializeToString(deterministic=True) for n in on.node] == [
        n.SerializeToString(deterministic=True) for n in off.node
    ]

    w = tf.Variable(tf.ones((3, 3, 3, 8)))

    @tf.function
    def nchw(x):
        return tf.nn.conv2d(x, w, 1, "SAME", data_format="NCHW")

    nchw_cf = nchw.get_concrete_function(tf.TensorSpec((2, 3, 8, 8)))
    converted = tfi.grappler_optimize(
        nchw_cf,
        DEVICE,
        config_pb2.ConfigProto(
            graph_options=config_pb2.GraphOptions(
                rewrite_options=rewriter_config_pb2.RewriterConfig(cpu_layout_conversion=RewriterConfig.NCHW_TO_NHWC)
            )
        ),
    )
    assert any(n.op == "Transpose" for n in converted.node)

    asks = config_pb2.ConfigProto()
    asks.graph_options.rewrite_options.cpu_layout_conversion = RewriterConfig.NCHW_TO_NHWC
    assert not tfi.layout_converts(DEVICE, config_pb2.ConfigProto())
    assert tfi.layout_converts(DEVICE, asks)
    assert tfi.layout_converts("/device:GPU:0", config_pb2.ConfigProto())
    assert tfi.layout_converts("/job:localhost/replica:0/task:0/device:GPU:1", config_pb2.ConfigProto())
    with tf.device(DEVICE):
        assert not tfi.layout_converts(None, config_pb2.ConfigProto())


def test_fit_with_the_callback_on_a_cpu_device_runs_as_plain_fit_with_tensorflows_layout_setting(monkeypatch):
    """``LMSCallback`` on ``/device:CPU:1``: its train function is called with the layout
    optimizer as plain ``fit`` has it, and a Conv3D U-Net (16³) trains to the plain fit's losses
    and weights, bit for bit."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 16, 16, 16, 1), dtype=np.float32)
    y = (rng.random((4, 16, 16, 16, 1)) > 0.5).astype(np.float32)
    seen = []
    run = tflms.LMSFunction._run  # noqa: SLF001 - calls the rewritten step within the call settings

    def recording_run(self, new_cf, device, args, kwargs):
        def recorded(*a, **k):
            seen.append(tfi._call_config().graph_options.rewrite_options)  # noqa: SLF001
            return new_cf(*a, **k)

        return run(self, recorded, device, args, kwargs)

    monkeypatch.setattr(tflms.LMSFunction, "_run", recording_run)

    def fit(lms):
        keras.utils.set_random_seed(0)
        model = _unet3d(size=16)
        model.compile(optimizer="adam", loss="binary_crossentropy", jit_compile=False)
        cb = tflms.LMSCallback(device=DEVICE, knobs=tflms.Knobs(batch_size=2, min_bytes=1 << 14)) if lms else None
        history = model.fit(x, y, batch_size=2, epochs=2, verbose=0, shuffle=False, callbacks=[cb] if cb else [])
        return cb, history.history["loss"], model.get_weights()

    _, plain_losses, plain_weights = fit(lms=False)
    assert not seen  # plain fit: Keras's own train function
    cb, losses, weights = fit(lms=True)
    assert cb.plan.swaps
    assert losses == plain_losses
    for a, b in zip(weights, plain_weights, strict=True):
        np.testing.assert_array_equal(a, b)
    plain_layout = tfi._call_config().graph_options.rewrite_options.layout_optimizer  # noqa: SLF001
    assert len(seen) == 4  # 2 epochs of 2 batches
    assert {c.layout_optimizer for c in seen} == {plain_layout} != {RewriterConfig.OFF}
