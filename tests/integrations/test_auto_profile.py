"""``op_profile="auto"``: the first rewritten call of a signature is profiled, the signature planned again
with the measured op times, and training stays bit-identical to the plain step."""

import os

import numpy as np
import pytest

import tflms
from tflms import _tf_internal as tfi
from tflms.emulate.costs import OpProfile

import zoo
from conftest import DEVICE, SMALL_KNOBS

pytestmark = pytest.mark.integration


@pytest.fixture
def profiled_calls(monkeypatch):
    """How many calls ran under the profiler (``tfi.profile_kernels``)."""
    calls = []
    real = tfi.profile_kernels

    def counting(fn, **kwargs):
        calls.append(fn)
        return real(fn, **kwargs)

    monkeypatch.setattr(tfi, "profile_kernels", counting)
    return calls


def _check_profile_of(plan):
    """The plan names a saved profile of its own step's ops."""
    path = plan.options["op_profile"]
    assert path != "auto" and os.path.isfile(path)
    profile = OpProfile.load(path)
    ops = set(plan.model.dag)
    assert len(profile) > 20 and set(profile.ops) <= ops  # inlined names mapped back to the step's
    convs = [op for op, (kind, _) in profile.ops.items() if "Conv2D" in kind]  # oneDNN renames them on a CPU
    assert convs and all(profile.seconds(op) > 0 for op in convs)


def test_function_profiles_the_first_call_once_and_trains_bit_identically(profiled_calls):
    shared = zoo.shared("cnn")
    setup = shared.setup
    plain_losses, plain_vars = shared.plain_run(3)
    lms = tflms.function(setup.step_fn(), device=DEVICE, knobs=SMALL_KNOBS.replace(op_profile="auto"))
    before = lms.get_plan(setup.x, setup.y)
    assert len(before.swaps) >= 1
    losses, variables = zoo.run_steps(setup, lms, n=3)
    np.testing.assert_array_equal(losses, plain_losses)
    for a, b in zip(variables, plain_vars):
        np.testing.assert_array_equal(a, b)
    assert len(profiled_calls) == 1  # the first call only
    plan = lms.get_plan(setup.x, setup.y)
    assert before.options["op_profile"] == "auto"
    assert plan is not before and len(lms.plans) == 1
    _check_profile_of(plan)
    # The rewritten step the later calls ran is the new plan's.
    assert (
        tflms.function(setup.step_fn(), device=DEVICE, knobs=SMALL_KNOBS.replace(op_profile=plan.options["op_profile"]))
        .get_plan(setup.x, setup.y)
        .to_json()
        == plan.to_json()
    )


def test_a_step_that_needs_no_rewrite_is_not_profiled(profiled_calls):
    setup = zoo.shared("cnn").setup
    lms = tflms.function(setup.step_fn(), device=DEVICE, knobs=tflms.Knobs(op_profile="auto"), budget="64GiB")
    zoo.run_steps(setup, lms, n=2)
    assert not profiled_calls
    assert lms.get_plan(setup.x, setup.y).options["op_profile"] == "auto" and not lms.get_plan(setup.x, setup.y).swaps


def test_fit_profiles_the_first_step_and_trains_bit_identically(profiled_calls):
    from test_keras import _compile, _fit

    setup = _compile(zoo.cnn())
    plain = _fit(setup, epochs=2)
    cb = tflms.LMSCallback(device=DEVICE, knobs=SMALL_KNOBS.replace(op_profile="auto"))
    lms = _fit(setup, [cb], epochs=2)
    assert lms[0] == plain[0]
    for a, b in zip(lms[1], plain[1]):
        np.testing.assert_array_equal(a, b)
    assert len(profiled_calls) == 1
    assert len(cb.plans) == 1 and len(cb.plan.swaps) >= 1
    _check_profile_of(cb.plan)


def test_bad_op_profile_is_one_clear_error():
    with pytest.raises(ValueError, match=r"op_profile must be .*'auto'.*Received: op_profile=3"):
        tflms.LMSConfig(knobs=tflms.Knobs(op_profile=3))


def test_auto_profile_with_horovod_is_refused():
    """Each rank would plan again from its own times: the ranks' plans could differ."""
    with pytest.raises(ValueError, match=r"op_profile='auto' is not available with horovod=True.*Received: op_"):
        tflms.LMSCallback(knobs=tflms.Knobs(op_profile="auto"), horovod=True)
