"""Recovery from an out-of-memory step (tflms.integrations.recovery), in one process.

A fault (tflms.testing.faults.out_of_memory) makes a chosen call of the rewritten step ask the
device for a tensor no device has, after the step's first variable write and before its last,
so the failed call has written part of its state (a BatchNorm's moving statistics, a seed
generator's state, a metric). The recovered run must train to the numbers of a run that never
failed, bit for bit: the written variables are restored and the same batch runs again.
"""

import logging

import numpy as np
import pytest
import tensorflow as tf

import tflms
import tflms.integrations.function
from tflms.integrations import recovery
from tflms.rewrite.apply import is_rewritten
from tflms.testing.faults import out_of_memory

import zoo
from conftest import DEVICE, SMALL

pytestmark = pytest.mark.integration

STEPS = 5


def _fit(setup, callbacks=()):
    """5 steps of fit (one epoch of 5 batches) from the initial state: (history, variables)."""
    setup.reset()
    x, y = setup.x.numpy(), setup.y.numpy()
    xs = np.concatenate([np.roll(x, k, axis=0) for k in range(STEPS)])
    ys = np.concatenate([np.roll(y, k, axis=0) for k in range(STEPS)])
    with tf.device(DEVICE):
        history = setup.model.fit(
            xs, ys, batch_size=x.shape[0], epochs=1, verbose=0, shuffle=False, callbacks=list(callbacks)
        )
    return history.history, [v.numpy() for v in setup.state()]


def _assert_same(a, b):
    assert a[0] == b[0]
    for u, v in zip(a[1], b[1], strict=True):
        np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize(("name", "k"), [("cnn", 3), ("resnet50", 1), ("transformer", 5)])
def test_fit_recovers_an_out_of_memory_step_bit_identically(name, k, caplog):
    """The zoo's CNN (BatchNorm, dropout), ResNet50 (BatchNorm) and transformer (dropout), with an
    accuracy metric: a fault at step k of 5 through ``fit`` + ``LMSCallback`` is undone and the
    step planned again for less memory; the run ends with the plain run's logs and variables."""
    setup = zoo.resnet50(batch=4, size=32) if name == "resnet50" else zoo.ZOO[name]()
    setup.model.compile(optimizer=setup.optimizer, loss=setup.loss, metrics=["accuracy"], jit_compile=False)
    plain = _fit(setup)
    cb = tflms.LMSCallback(device=DEVICE, **SMALL)
    with out_of_memory(calls={k}) as fault, caplog.at_level(logging.WARNING, logger="tflms"):
        recovered = _fit(setup, [cb])
    assert recovered[0].pop("tflms_replans") == [1]
    assert fault.failed == [k] and fault.calls == STEPS + 1
    _assert_same(recovered, plain)
    (replan,) = cb.step.replans
    assert cb.plan.options["budget"] == replan["budget"] < replan["failed_peak"]
    assert cb.plan.peak_bytes_after < replan["failed_peak"]  # the plan that ran needs less
    assert sum("ran out of device memory" in r.message for r in caplog.records) == 1


def test_function_falls_back_to_the_plain_step():
    """``tflms.function`` in a custom loop: while the plans for less memory run out of memory too,
    the same batch runs again; when planning cannot lower the predicted peak any more, the plain
    step runs it; the run trains to the plain numbers bit for bit."""
    setup = zoo.cnn()
    plain_losses, plain_vars = zoo.run_steps(setup, tf.function(setup.step_fn()), n=3)
    step = tflms.function(setup.step_fn(), device=DEVICE, **SMALL)
    with out_of_memory(calls=range(2, 3 + recovery.MAX_REPLANS)) as fault:
        losses, variables = zoo.run_steps(setup, step, n=3)
    assert fault.failed == list(range(2, 2 + len(step.replans)))  # each failure, one re-plan
    assert step.replans[-1]["budget"] == "plain" and len(step.replans) <= 1 + recovery.MAX_REPLANS
    assert step.plans[0].swaps == () and "plain step runs" in step.plans[0].reason
    with tf.device(DEVICE):  # what runs is the unedited step, not a trace a plan rewrote in place
        assert not is_rewritten(step.get_concrete_function(setup.x, setup.y).graph)
    np.testing.assert_array_equal(losses, plain_losses)
    for a, b in zip(variables, plain_vars, strict=True):
        np.testing.assert_array_equal(a, b)


def test_when_the_plain_step_runs_out_of_memory_too_one_error_says_what_was_tried():
    """A step whose plain version runs out of memory as well (it asks for a huge tensor after its
    updates were computed): one ResourceExhaustedError lists every way tried, and every variable
    keeps its value from before the call."""
    setup = zoo.cnn()
    side = tf.Variable([1], dtype=tf.int32)
    base = setup.step_fn()

    def step(x, y):
        loss = base(x, y)
        with tf.control_dependencies([loss]):
            huge = tf.raw_ops.Empty(shape=tf.concat([side, side], 0), dtype=tf.float32)
        return loss + tf.reduce_sum(huge[:0, :0])

    lms = tflms.function(step, device=DEVICE, **SMALL)
    setup.reset()
    with tf.device(DEVICE):
        lms(setup.x, setup.y)  # a first call that fits
    before = [v.numpy() for v in setup.state()]
    side.assign([2**21])
    with pytest.raises(tf.errors.ResourceExhaustedError) as info, tf.device(DEVICE):
        lms(setup.x, setup.y)
    message = str(info.value)
    assert "ran out of device memory in every way tried" in message
    assert message.count("a plan of") == len(lms.replans) and "the plain step (predicted" in message
    for a, b in zip([v.numpy() for v in setup.state()], before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_written_variables_are_those_the_step_may_write():
    """The state saved before a call on probation: every variable an op writes (weights, Adam's
    slots and iterations, BatchNorm's moving statistics), not a variable that is only read."""
    setup = zoo.cnn()
    fixed = tf.Variable(2.0, name="only_read")
    step = setup.step_fn()

    def scaled(x, y):
        return step(x * fixed, y)

    cf = tf.function(scaled).get_concrete_function(setup.x, setup.y)
    written = {v.name for v in recovery.written_variables(cf)}
    assert "only_read:0" not in written
    names = {v.path if hasattr(v, "path") else v.name for v in setup.state()}
    assert len(written) >= len(setup.model.trainable_variables) + len(setup.optimizer.variables) - 1, (written, names)
    assert any("moving_mean" in n for n in written) and any("iteration" in n for n in written)


@pytest.mark.parametrize(("ratio", "looser"), [(1.2, False), (0.6, True)])
def test_the_margin_is_learned_from_the_measured_peaks(monkeypatch, ratio, looser, caplog):
    """``budget="auto"``: after a plan's first two calls, its measured peak (here the device's memory
    report is simulated as ``ratio`` times the plan's prediction: one process cannot measure a
    logical CPU) sets the budget that puts the peak at 0.95 of the limit: tighter where it came
    close to the limit (more swapped), looser where it left much unused (less swapped). The
    numbers stay the plain step's: the loop changes which tensors are swapped, not what is computed."""
    setup = zoo.cnn()
    probe = tflms.function(setup.step_fn(), device=DEVICE, budget=None, **SMALL).get_plan(setup.x, setup.y)
    limit = int(probe.peak_bytes_before / 0.95)  # the plain step would peak at 0.95 of it
    step = tflms.function(setup.step_fn(), device=DEVICE, **SMALL)
    current: dict = {}

    def memory(device):
        plan = step.plans[0] if step.plans else probe
        return {"current": 0, "peak": int(ratio * plan.peak_bytes_after)}

    monkeypatch.setattr(recovery, "device_memory", memory)
    monkeypatch.setattr(recovery, "device_memory_limit", lambda device: (limit, "a simulated limit"))
    monkeypatch.setattr(tflms.integrations.function, "device_memory_limit", lambda device: (limit, "a simulated limit"))
    monkeypatch.setattr(tf.config.experimental, "reset_memory_stats", lambda device: current.clear())
    plain_losses, plain_vars = zoo.run_steps(setup, tf.function(setup.step_fn()), n=4)
    with caplog.at_level(logging.WARNING, logger="tflms"):
        losses, variables = zoo.run_steps(setup, step, n=4)
    first_budget = int(0.9 * limit)  # budget="auto" before anything was measured
    (learned,) = step.replans
    assert learned["old_budget"] == first_budget and "learned margin" in learned["why"]
    assert (learned["budget"] > first_budget) is looser
    assert len(step.measured_peaks) >= 2  # a plan that swaps nothing is not rewritten, nor measured
    assert sum("learned margin" in r.message for r in caplog.records) == 1
    np.testing.assert_array_equal(losses, plain_losses)
    for a, b in zip(variables, plain_vars, strict=True):
        np.testing.assert_array_equal(a, b)


def test_an_auto_budget_that_no_plan_meets_plans_for_the_limit_itself(monkeypatch):
    """``budget="auto"`` is 0.9 of the device's limit; where no plan is predicted within it but the
    best is within the limit itself, the step is planned for the limit (a warning says so; the
    recovery watches its first calls) instead of raising; past the limit, BudgetError as before."""
    setup = zoo.cnn()
    with pytest.raises(tflms.BudgetError) as info:
        tflms.function(setup.step_fn(), device=DEVICE, budget=1, **SMALL).get_plan(setup.x, setup.y)
    best = info.value.best_peak_bytes
    limit = int(best / 0.95)  # 0.9 of it is below the best plan, the limit above
    monkeypatch.setattr(tflms.integrations.function, "device_memory_limit", lambda device: (limit, "a simulated limit"))
    step = tflms.function(setup.step_fn(), device=DEVICE, **SMALL)
    with pytest.warns(tflms.LMSWarning, match="planned for the limit itself"):
        plan = step.get_plan(setup.x, setup.y)
    assert plan.options["budget"] == limit and plan.peak_bytes_after <= limit and plan.swaps
    monkeypatch.setattr(tflms.integrations.function, "device_memory_limit", lambda device: (best - 1, "too small"))
    with pytest.raises(tflms.BudgetError):
        tflms.function(setup.step_fn(), device=DEVICE, **SMALL).get_plan(setup.x, setup.y)


def test_a_step_predicted_to_fit_that_runs_out_of_memory_is_planned_for_less():
    """A step predicted to fit its budget runs unrewritten, watched all the same: when it runs out of
    memory (here its own op asks for a huge tensor at its second call, once), its writes are undone
    and it is planned for less than its predicted peak, with swaps, and trains to the plain numbers."""
    setup = zoo.cnn()
    base = setup.step_fn()
    calls = []

    def side():
        calls.append(1)
        return np.array([2**21 if len(calls) == 2 else 1], np.int32)

    def step(x, y):
        loss = base(x, y)
        size = tf.numpy_function(side, [], tf.int32, stateful=True)
        size.set_shape([1])
        with tf.control_dependencies([loss]):
            huge = tf.raw_ops.Empty(shape=tf.concat([size, size], 0), dtype=tf.float32)
        return loss + tf.reduce_sum(huge[:0, :0])

    plain_losses, plain_vars = zoo.run_steps(setup, tf.function(setup.step_fn()), n=3)
    lms = tflms.function(step, device=DEVICE, budget="1GiB", **SMALL)
    losses, variables = zoo.run_steps(setup, lms, n=3)
    (replan,) = lms.replans
    assert replan["old_budget"] == 1 << 30 and replan["budget"] < replan["failed_peak"]
    assert lms.plans[0].swaps and len(calls) == 4  # the second call ran twice
    np.testing.assert_array_equal(losses, plain_losses)
    for a, b in zip(variables, plain_vars, strict=True):
        np.testing.assert_array_equal(a, b)
