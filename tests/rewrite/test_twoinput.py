"""The two-input model of issue 57 (``tflms.testing.measure`` zoo entry ``twoinput``): a subclassed Keras
model that overrides ``train_step``, four Conv2D + MaxPool2D stages on an image, a Dense branch on
a vector, concatenated, a Dense head. Its step takes a tuple of two tensors as ``x``.

In one process on the logical CPU pair (numbers and structure): the rewritten step trains
bit-identically to the plain one, through ``tflms.optimize`` and through ``LMSCallback`` on the
model's own ``train_step``; a budget that the plain step's prediction fits leaves the step as
traced. The measured comparison with the plain step is in tests/test_testbed.py.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tflms
from tflms.testing.zoo import build

from conftest import DEVICE, HOST, SMALL
from helpers import check_structure, check_survives_grappler, swap_ops

pytestmark = pytest.mark.integration

BATCH, SIZE = 4, 32


def _state(model, step):
    return list(model.variables) + list(step.optimizer.variables)


def _train(state, initial, step, x, y, n=3):
    """``n`` steps of ``step`` from ``initial``: (losses, variables as numpy)."""
    for v, value in zip(state, initial):
        v.assign(value)
    with tf.device(DEVICE):
        losses = [step(x, y).numpy() for _ in range(n)]
    return np.array(losses), [v.numpy() for v in state]


def test_twoinput_rewritten_step_trains_bit_identically():
    model, x, y, step = build("twoinput", BATCH, SIZE)
    assert isinstance(x, tuple) and [t.shape.as_list() for t in x] == [[BATCH, SIZE, SIZE, 3], [BATCH, 64]]
    state = _state(model, step)
    initial = [v.numpy() for v in state]
    cf = tf.function(step).get_concrete_function(x, y)
    lms, plan = tflms.optimize(cf, device=DEVICE, **SMALL)
    assert plan.swaps, plan.reason
    # Both image-side ReLU outputs and the pooled outputs exist; only the former may be swapped
    # on a CPU (tflms.plan.candidates.PINNED_INPUTS): MaxPoolGrad reads the pooled output directly.
    assert all(s.producer_type != "MaxPool" for s in plan.swaps), [s.tensor for s in plan.swaps]

    def lms_step(x, y):  # as tflms.function calls it
        with tflms.manual_memory_optimizer():
            return lms(x, y)

    def plain_step(x, y):
        with tflms.manual_memory_optimizer():
            return cf(x, y)

    losses_plain, vars_plain = _train(state, initial, plain_step, x, y)
    losses_lms, vars_lms = _train(state, initial, lms_step, x, y)
    np.testing.assert_array_equal(losses_lms, losses_plain)
    for a, b in zip(vars_lms, vars_plain, strict=True):
        np.testing.assert_array_equal(a, b)
    assert losses_plain[0] != losses_plain[2]  # it trained
    n_out, n_in = check_structure(lms, plan, DEVICE, HOST)
    assert n_out == len(plan.swaps) and n_in >= n_out
    check_survives_grappler(lms, DEVICE)
    assert swap_ops(cf.graph) == ([], [])  # the traced step is untouched


def test_twoinput_fit_with_its_own_train_step_is_bit_identical_with_the_callback():
    """The user's setup: ``fit`` on the subclassed model, whose ``train_step`` Keras wraps."""
    model, x, y, step = build("twoinput", BATCH, SIZE)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(True))
    model.optimizer.build(model.trainable_variables)
    state = list(model.variables) + list(model.optimizer.variables)
    initial = [v.numpy() for v in state]
    data = ((np.concatenate([x[0].numpy()] * 2), np.concatenate([x[1].numpy()] * 2)), np.concatenate([y.numpy()] * 2))

    def fit(callbacks):
        for v, value in zip(state, initial):
            v.assign(value)
        with tf.device(DEVICE):
            history = model.fit(*data, batch_size=BATCH, epochs=2, verbose=0, shuffle=False, callbacks=callbacks)
        return history.history["loss"], [v.numpy() for v in state]

    plain_losses, plain_vars = fit([])
    cb = tflms.LMSCallback(device=DEVICE, **SMALL)
    lms_losses, lms_vars = fit([cb])
    assert cb.plan is not None and cb.plan.swaps, cb.plan
    assert lms_losses == plain_losses and plain_losses[0] != plain_losses[1]
    for a, b in zip(lms_vars, plain_vars, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_budget_the_plain_step_fits_leaves_the_twoinput_step_as_traced():
    """tflms never rewrites a step whose plain prediction fits the budget: the plan is empty and
    ``optimize`` returns the traced function itself."""
    _, x, y, step = build("twoinput", BATCH, SIZE)
    cf = tf.function(step).get_concrete_function(x, y)
    plain_peak = tflms.Simulator(tflms.GraphModel.from_func_graph(cf.graph), HOST).peak()
    for budget in (plain_peak, plain_peak + 2**20):
        new_cf, plan = tflms.optimize(cf, device=DEVICE, budget=budget, **SMALL)
        assert new_cf is cf
        assert not plan.swaps and not plan.orders and not plan.recomputes
        assert plan.peak_bytes_after == plan.peak_bytes_before == plain_peak
        assert "fits the budget" in plan.reason
    # Without a budget, the same step is rewritten.
    new_cf, plan = tflms.optimize(cf, device=DEVICE, **SMALL)
    assert new_cf is not cf and plan.swaps
