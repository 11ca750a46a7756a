"""tflms.LMSCallback in tf-keras 2.x ``model.fit``: bit-identical training, structure, lifecycle.

The models are built with ``import tf_keras`` in this process (the rest of the suite uses
Keras 3, so ``TF_USE_LEGACY_KERAS`` is not set here); one subprocess test runs the same
callback through ``tf.keras`` under ``TF_USE_LEGACY_KERAS=1``. Plain and LMS runs are
compared on the same model object: its weights restored and a fresh optimizer compiled
before each run (tf-keras builds the optimizer's slots lazily, in the first traced step:
inside the rewritten step for the LMS run). Both run under ``tf.device(DEVICE)`` with
``shuffle=False``.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tflms
from tflms import LMSWarning
from tflms import _tf_internal as tfi
from tflms.integrations.keras import LMSCallback

from conftest import DEVICE, HOST, REPO, SMALL
from helpers import check_structure

pytestmark = pytest.mark.integration

L = tf_keras.layers
BATCH = 16


def _init(seed):
    return tf_keras.initializers.GlorotUniform(seed=seed)


def mlp():
    """A functional MLP (regression, MSE)."""
    inputs = tf_keras.Input((32,))
    h = L.Dense(128, activation="relu", kernel_initializer=_init(1))(inputs)
    h = L.Dense(128, activation="relu", kernel_initializer=_init(2))(h)
    model = tf_keras.Model(inputs, L.Dense(1, kernel_initializer=_init(3))(h))
    rs = np.random.RandomState(0)
    x = rs.rand(48, 32).astype("float32")
    return model, x, x.sum(axis=1, keepdims=True), "mse"


def cnn():
    """A small Sequential CNN with BatchNormalization (classification)."""
    model = tf_keras.Sequential(
        [
            tf_keras.Input((16, 16, 3)),
            L.Conv2D(8, 3, padding="same", kernel_initializer=_init(1)),
            L.BatchNormalization(),
            L.ReLU(),
            L.MaxPooling2D(),
            L.Conv2D(16, 3, padding="same", kernel_initializer=_init(2)),
            L.BatchNormalization(),
            L.ReLU(),
            L.GlobalAveragePooling2D(),
            L.Dense(10, kernel_initializer=_init(3)),
        ]
    )
    rs = np.random.RandomState(0)
    x = rs.rand(48, 16, 16, 3).astype("float32")
    y = rs.randint(0, 10, 48)
    return model, x, y, tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)


MODELS = {"mlp": mlp, "cnn": cnn}


class Setup:
    """One tf-keras model, its data and its initial weights; ``fit`` trains it from them."""

    def __init__(self, build):
        self.model, self.x, self.y, self.loss = build()
        self.initial = self.model.get_weights()

    def compile(self, **kwargs):
        """Initial weights back, a fresh Adam (tf-keras resets the train function too)."""
        self.model.set_weights(self.initial)
        self.model.compile(optimizer=tf_keras.optimizers.Adam(1e-2), loss=self.loss, **kwargs)

    def fit(self, callbacks=(), samples=48, epochs=2, fresh=True, **kwargs):
        """Fit (from the initial state unless ``fresh=False``): the numbers to compare."""
        if fresh:
            self.compile(**kwargs)
        with tf.device(DEVICE):
            history = self.model.fit(
                self.x[:samples],
                self.y[:samples],
                batch_size=BATCH,
                epochs=epochs,
                shuffle=False,
                verbose=0,
                callbacks=list(callbacks),
            )
        return self.state(history.history)

    def state(self, history=None):
        model = self.model
        return {
            "history": history,
            "weights": [w.copy() for w in model.get_weights()],
            "optimizer": {v.name: v.numpy() for v in model.optimizer.variables},
            "train_counter": int(model._train_counter.numpy()),  # noqa: SLF001 - tf-keras counts steps in the step
        }


def _assert_same(a, b):
    """Bit for bit: losses, weights (BatchNorm statistics included), optimizer variables, step counter."""
    assert a["history"] == b["history"]
    assert len(a["weights"]) == len(b["weights"])
    for u, v in zip(a["weights"], b["weights"]):
        np.testing.assert_array_equal(u, v)
    assert a["optimizer"].keys() == b["optimizer"].keys() and len(a["optimizer"]) > 1
    for name, value in a["optimizer"].items():
        np.testing.assert_array_equal(value, b["optimizer"][name], err_msg=name)
    assert a["train_counter"] == b["train_counter"]


class Spy(tf_keras.callbacks.Callback):
    """A tf-keras callback that records ``model.train_function`` at train begin."""

    def on_train_begin(self, logs=None):
        self.seen = self.model.train_function


@pytest.fixture
def mlp_setup():
    return Setup(mlp)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fit_is_bit_identical_and_rewritten(name):
    setup = Setup(MODELS[name])
    assert tfi.tf_keras_model(setup.model)
    plain = setup.fit()
    assert plain["train_counter"] == 6 and len(plain["history"]["loss"]) == 2

    before, after = Spy(), Spy()
    cb = LMSCallback(device=DEVICE, **SMALL)
    lms = setup.fit([before, cb, after])
    _assert_same(lms, plain)
    assert any(not np.array_equal(a, b) for a, b in zip(setup.initial, lms["weights"]))  # it trained

    keras_function = before.seen
    assert isinstance(keras_function, tf.types.experimental.PolymorphicFunction)  # tf-keras's own
    assert after.seen is not keras_function  # the callback's, while fitting
    assert setup.model.train_function is keras_function  # tf-keras's own back after fit

    assert isinstance(cb.plan, tflms.SwapPlan) and len(cb.plan.swaps) >= 1
    assert cb.plans == [cb.plan]  # one trace for every batch and epoch
    data = (tf.constant(setup.x[:BATCH]), tf.constant(setup.y[:BATCH]))
    cf = cb.step.get_concrete_function(data)
    assert cb.plans == [cb.plan]  # fit's own trace
    n_out, n_in = check_structure(cf, cb.plan, DEVICE, HOST)
    assert n_out >= 1 and n_in >= n_out
    # The step counter is counted inside the rewritten step, as tf-keras's run_step counts it.
    counter = setup.model._train_counter.handle  # noqa: SLF001
    captured = [inner for outer, inner in cf.graph.captures if outer is counter]
    assert captured and any(
        op.type == "AssignAddVariableOp" and op.inputs[0] is captured[0] for op in cf.graph.get_operations()
    )


def test_a_partial_last_batch_runs_the_step_planned_for_the_real_batch(mlp_setup):
    """Batches of 16, 16 and 8: the step is traced as tf-keras traces it (an unknown batch) and
    planned for the first batch's 16; the last, partial batch runs the same step."""
    plain = mlp_setup.fit(samples=40)  # batches of 16, 16, 8
    cb = LMSCallback(device=DEVICE, **SMALL)
    lms = mlp_setup.fit([cb], samples=40)
    _assert_same(lms, plain)
    assert len(cb.plans) == 1 and cb.plan.swaps
    assert {s.shape[0] for s in cb.plan.swaps} == {16}


def test_steps_per_execution_2(mlp_setup):
    """Two batches per call of the train function; the epoch's last call runs the one left (tf-keras
    lowers ``steps_per_execution`` for it)."""
    plain = mlp_setup.fit(samples=40, steps_per_execution=2)
    cb = LMSCallback(device=DEVICE, **SMALL)
    lms = mlp_setup.fit([cb], samples=40, steps_per_execution=2)
    _assert_same(lms, plain)
    assert lms["train_counter"] == 6 and len(cb.plans) == 1
    assert int(mlp_setup.model.steps_per_execution.numpy()) == 2


def test_second_fit_evaluate_and_predict_continue_like_plain(mlp_setup):
    def run(callbacks):
        first = mlp_setup.fit(callbacks, epochs=1)
        second = mlp_setup.fit(callbacks, epochs=1, fresh=False)
        with tf.device(DEVICE):
            evaluated = mlp_setup.model.evaluate(mlp_setup.x, mlp_setup.y, batch_size=BATCH, verbose=0)
            predicted = mlp_setup.model.predict(mlp_setup.x, batch_size=BATCH, verbose=0)
        return first, second, evaluated, predicted

    plain = run([])
    cb = LMSCallback(device=DEVICE, **SMALL)
    lms = run([cb])
    _assert_same(lms[0], plain[0])
    _assert_same(lms[1], plain[1])
    assert lms[2] == plain[2]
    np.testing.assert_array_equal(lms[3], plain[3])
    assert len(cb.plans) == 1  # the second fit re-installed the same rewritten step

    # Without the callback, the next fit runs tf-keras's own function.
    spy = Spy()
    mlp_setup.fit([spy], epochs=1, fresh=False)
    assert spy.seen is mlp_setup.model.train_function and spy.seen is not cb._installation.function  # noqa: SLF001


def test_batch_hooks_are_called_only_where_a_subclass_has_them(mlp_setup):
    assert not LMSCallback(device=DEVICE)._implements_train_batch_hooks()  # noqa: SLF001

    class Counting(LMSCallback):
        batches = 0

        def on_train_batch_end(self, batch, logs=None):
            super().on_train_batch_end(batch, logs)
            self.batches += 1

    cb = Counting(device=DEVICE, **SMALL)
    assert cb._implements_train_batch_hooks() and not cb._implements_test_batch_hooks()  # noqa: SLF001
    mlp_setup.fit([cb], epochs=1)
    assert cb.batches == 3 and len(cb.plan.swaps) >= 1


def test_run_eagerly_warns_and_trains_plain(mlp_setup):
    plain = mlp_setup.fit(epochs=1, run_eagerly=True)
    cb = LMSCallback(device=DEVICE, **SMALL)
    with pytest.warns(LMSWarning, match="run_eagerly=True"):
        lms = mlp_setup.fit([cb], epochs=1, run_eagerly=True)
    _assert_same(lms, plain)
    assert cb.plan is None and cb.step is None


def test_jit_compile_is_refused(mlp_setup):
    with pytest.raises(ValueError, match=r"tf-keras model is compiled with XLA only when asked.*jit_compile=True"):
        mlp_setup.fit([LMSCallback(device=DEVICE)], epochs=1, jit_compile=True)


def test_offload_is_refused(mlp_setup):
    cb = LMSCallback(device=DEVICE, host=HOST, offload="optimizer")
    with pytest.raises(ValueError, match=r"tf-keras model.*Keras 3 model.*Received: offload='optimizer'"):
        mlp_setup.fit([cb], epochs=1)


LEGACY_SCRIPT = textwrap.dedent(
    """
    import numpy as np, tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    tf.config.experimental.enable_op_determinism()
    import tflms
    keras = tf.keras
    assert keras.__name__.startswith("tf_keras"), keras.__name__
    init = keras.initializers.GlorotUniform(seed=1)
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu", kernel_initializer=init),
                              keras.layers.Dense(1, kernel_initializer=init)])
    start = model.get_weights()
    x = np.random.RandomState(0).rand(48, 32).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    def fit(callbacks):
        model.set_weights(start)
        model.compile(keras.optimizers.Adam(), "mse")
        with tf.device("/device:CPU:1"):
            loss = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=callbacks).history
        return loss, model.get_weights() + [v.numpy() for v in model.optimizer.variables]
    plain = fit([])
    cb = tflms.LMSCallback(device="/device:CPU:1", knobs=tflms.Knobs(min_bytes=4096))
    lms = fit([cb])
    assert lms[0] == plain[0], (lms[0], plain[0])
    assert all(np.array_equal(a, b) for a, b in zip(lms[1], plain[1]))
    print("swaps", len(cb.plan.swaps))
    """
)


def test_tf_keras_through_tf_use_legacy_keras():
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    run = subprocess.run(
        [sys.executable, "-c", LEGACY_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert int(run.stdout.split("swaps")[-1]) >= 1
