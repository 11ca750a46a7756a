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
from tflms._devices import same_device
from tflms.integrations.keras import short_summary
from tflms.integrations.offload import place_weights
from tflms.testing.zoo import MODELS, _gpt

import zoo
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
        place_weights(self.model.trainable_variables, DEVICE)
        for v, value in zip(self.model.variables, self.initial):
            v.assign(value)

    def step_fn(self, optimizer):
        return zoo.train_step_of(self.model, self.loss_fn, optimizer)

    def run(self, name: str, offload: str | None, **options):
        self.reset()
        optimizer = OPTIMIZERS[name]()
        if offload == "weights":
            place_weights(self.model, HOST)
        if offload:
            tflms.build_optimizer(optimizer, self.model.trainable_variables, HOST)
        run = zoo.offload_run(
            self.model, self.step_fn(optimizer), optimizer, self.batches, offload, DEVICE, HOST, **(options or ROOMY)
        )
        return (*run, optimizer)


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


def _attr(op):
    try:
        return op.get_attr("_tflms_swap")
    except ValueError:
        return None


def test_each_weight_read_reaches_the_device_through_a_host_gated_copy(setup):
    """The rewritten graph: every device op that reads a weight reads a landing on the device, fed
    by an ``Identity`` on the host that waits for its trigger (a device op); and in the partitions
    the runtime ran (after Grappler), the sends, their control inputs and the landings are there."""
    from tflms import _tf_internal as tfi

    setup.reset()
    optimizer = OPTIMIZERS["adam"]()
    place_weights(setup.model, HOST)
    tflms.build_optimizer(optimizer, setup.model.trainable_variables, HOST)
    step = tflms.function(setup.step_fn(optimizer), device=DEVICE, host=HOST, offload="weights", **ROOMY)
    x, y = setup.batches[0]
    graph = step.get_concrete_function(x, y).graph
    sends = [op for op in graph.get_operations() if op.name.startswith("tflms_weightin/")]
    landings = [op for op in graph.get_operations() if _attr(op) == b"landing"]
    assert len(sends) == len(landings) > len(setup.model.trainable_variables)  # forward and backward copies
    assert all(same_device(op.device, HOST) and _attr(op) == b"offload" for op in sends)
    assert all(same_device(op.device, DEVICE) and op.inputs[0].op in sends for op in landings)
    gated = [op for op in sends if op.control_inputs]
    assert len(gated) >= len(sends) - 4  # only the first layer's copies may go at the start
    assert all(c.device == "" and not c.name.startswith("tflms") for op in gated for c in op.control_inputs)
    # No device op reads a weight's host tensor but through a landing.
    handles = {id(ext): internal.op.name for ext, internal in graph.captures}
    weights = {handles[id(v.value.handle)] for v in setup.model.trainable_variables}
    reads = [op for op in graph.get_operations() if op.type == "ReadVariableOp" and op.inputs[0].op.name in weights]
    for read in reads:
        for consumer in read.outputs[0].consumers():
            assert consumer in sends or same_device(consumer.device, HOST) or consumer.type == "Shape", consumer.name
    with tf.device(DEVICE):
        partitions = tfi.ran_graphs(lambda: step(x, y))
    ran = {n.name: n for g in partitions for n in g.node}
    for op in gated:
        node = ran[op.name]  # kept by Grappler, on the host, with its trigger's control input
        assert same_device(node.device, HOST) and any(i.startswith("^") for i in node.input), node
    assert all(same_device(ran[op.name].device, DEVICE) for op in landings)
    # The weights' assigns run on the host, beside their variables: nothing of the update on the device.
    n_weights = len(setup.model.trainable_variables)
    assert sum(n.op == "AssignSubVariableOp" and same_device(n.device, HOST) for n in ran.values()) == n_weights


def test_fit_with_callback_is_bit_identical(setup):
    """``model.fit`` with ``LMSCallback(offload="weights")``: the callback moves the trainable
    variables to the host and builds the optimizer there; the same losses and weights as a plain fit."""
    results = []
    for offload in (None, "weights"):
        setup.reset()
        model = setup.model
        model.compile(optimizer=OPTIMIZERS["adam"](), loss=setup.loss_fn, jit_compile=False)
        x = np.concatenate([b[0].numpy() for b in setup.batches])
        y = np.concatenate([b[1].numpy() for b in setup.batches])
        callbacks = [tflms.LMSCallback(device=DEVICE, host=HOST, offload=offload, **ROOMY)] if offload else []
        with tf.device(DEVICE):
            history = model.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False, callbacks=callbacks)
            snapshot = [v.numpy() for v in model.variables]
            if offload:  # a second fit finds the weights on the host and the optimizer built there
                model.fit(x[:4], y[:4], batch_size=4, epochs=1, verbose=0, callbacks=callbacks)
        on_host = [same_device(v.value.device, HOST) for v in model.trainable_variables]
        results.append((history.history["loss"], snapshot, on_host))
    (plain_loss, plain_vars, plain_host), (off_loss, off_vars, off_host) = results
    assert not any(plain_host) and all(off_host)
    assert plain_loss[-1] < plain_loss[0]
    assert "the weights, the optimizer's state and update on the host" in short_summary(callbacks[0].plan)
    _assert_same((plain_loss, plain_vars), (off_loss, off_vars))


def test_a_batchnorm_models_moving_statistics_stay_on_the_device():
    """The small CNN of the zoo (BatchNorm): its trainable variables move, its moving statistics
    (non-trainable, updated by the forward pass) stay on the device and are counted there; the
    offloaded steps are the plain steps, to a relative 1e-5 (SGD-like rounding of the plain
    step's BatchNorm gradient, as for ``offload="optimizer"``: bit-identical for Adam)."""
    keras.utils.set_random_seed(0)
    with tf.device(DEVICE):
        model = MODELS["cnn"][0](16)
    initial = [v.numpy() for v in model.variables]
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(4, 16, 16, 3)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, 4))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    out = []
    for offload in (None, "weights"):
        place_weights(model.trainable_variables, DEVICE)
        for v, value in zip(model.variables, initial):
            v.assign(value)
        optimizer = keras.optimizers.Adam(1e-3)
        if offload:
            place_weights(model, HOST)
            tflms.build_optimizer(optimizer, model.trainable_variables, HOST)
        else:
            with tf.device(DEVICE):
                optimizer.build(model.trainable_variables)

        train_step = zoo.train_step_of(model, loss_fn, optimizer)
        step = (
            tflms.function(train_step, device=DEVICE, host=HOST, offload=offload, **ROOMY)
            if offload
            else tf.function(train_step)
        )
        with tf.device(DEVICE):
            losses = [float(step(x, y)) for _ in range(STEPS)]
        out.append((losses, [v.numpy() for v in model.variables]))
    frozen = [v for v in model.variables if not v.trainable]
    assert frozen and all(same_device(v.value.device, DEVICE) for v in frozen)
    assert all(same_device(v.value.device, HOST) for v in model.trainable_variables)
    _assert_same(out[0], out[1])


# -- errors ---------------------------------------------------------------------------------------


def test_weights_values_and_refusals(setup):
    assert tflms.LMSConfig(offload="weights").offload == "weights"
    cfg = tflms.LMSConfig(offload="weights", budget="1GiB")
    assert tflms.LMSConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match=r"XLA.*Received: offload='weights'"):
        tflms.function(tf.function(lambda x: x * 2, jit_compile=True), offload="weights")
    with pytest.raises(ValueError, match=r"horovod=True.*Received: offload='weights'"):
        tflms.LMSCallback(offload="weights", horovod=True)
    with pytest.raises(ValueError, match=r"only trainable variables.*trainable=False"):
        place_weights([setup.model.trainable_variables[0], keras.Variable(1.0, trainable=False)], HOST)


def test_weights_on_the_device_are_refused(setup):
    """A step traced with ``offload="weights"`` whose weights were not moved: one error saying how."""
    setup.reset()
    optimizer = OPTIMIZERS["adam"]()
    tflms.build_optimizer(optimizer, setup.model.trainable_variables, HOST)
    step = tflms.function(setup.step_fn(optimizer), device=DEVICE, host=HOST, offload="weights", **ROOMY)
    x, y = setup.batches[0]
    with pytest.raises(ValueError, match=r"weights on the host.*place_weights.*Received: offload='weights'"):
        step.get_concrete_function(x, y)


def test_moving_the_weights_after_the_optimizer_is_built_is_refused(setup):
    setup.reset()
    model = setup.model
    model.compile(optimizer=OPTIMIZERS["adam"](), loss=setup.loss_fn)
    model.optimizer.build(model.trainable_variables)
    with pytest.raises(ValueError, match=r"before the optimizer is built.*Received: model="):
        place_weights(model, HOST)


def test_a_non_trainable_variable_written_by_the_update_is_refused(setup):
    """A variable the step reads in its forward pass and writes from the gradients is taken for a
    weight: when it is not trainable, ``offload="weights"`` refuses it (``place_weights`` would not
    move it). (One that only the update reads and writes is optimizer state, and is fine.)"""
    setup.reset()
    optimizer = OPTIMIZERS["sgd_momentum"]()
    place_weights(setup.model.trainable_variables, HOST)  # the model was compiled by another test
    tflms.build_optimizer(optimizer, setup.model.trainable_variables, HOST)
    with tf.device(HOST):
        counter = tf.Variable(tf.zeros((4,)), trainable=False)
    model, loss_fn = setup.model, setup.loss_fn

    def step_and_count(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True) + 0.0 * tf.reduce_sum(counter))  # read forward
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        counter.assign_add(tf.fill((4,), tf.reduce_sum(grads[-1])))  # written from a gradient
        return loss

    step = tflms.function(step_and_count, device=DEVICE, host=HOST, offload="weights", **ROOMY)
    x, y = setup.batches[0]
    with pytest.raises(ValueError, match=r"not trainable.*Received: offload='weights'"):
        step.get_concrete_function(x, y)
