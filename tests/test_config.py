"""LMSConfig's op-type options, checked against TensorFlow's op registry (the rest of
LMSConfig is tested without TensorFlow in tests/unit/test_config.py)."""

import pytest

from tflms import Knobs, LMSConfig
from tflms.config import keyword_options

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"incl_types": ["Conv2D", "NotAnOp"]}, "incl_types"),
        ({"excl_types": ["Relux"]}, "excl_types"),
    ],
)
def test_unknown_op_types_name_argument_and_value(kwargs, name):
    with pytest.raises(ValueError) as err:
        LMSConfig(**keyword_options(kwargs))
    msg = str(err.value)
    assert f"{name}=" in msg and "Received" in msg
    assert "TensorFlow does not know" in msg


def test_op_types_are_sorted_deduplicated_and_roundtrip():
    base = LMSConfig(knobs=Knobs(swapout_threshold=7, incl_types=("Relu", "Conv2D", "Relu"), excl_types="MatMul"))
    assert (base.knobs.incl_types, base.knobs.excl_types) == (("Conv2D", "Relu"), ("MatMul",))
    cfg = base.with_knobs(swapin_ahead=4)
    assert (cfg.knobs.swapout_threshold, cfg.knobs.swapin_ahead, cfg.knobs.incl_types) == (7, 4, ("Conv2D", "Relu"))
    assert LMSConfig.from_dict(cfg.to_dict()) == cfg
    assert hash(cfg) == hash(LMSConfig.from_dict(cfg.to_dict()))


def test_on_budget_miss_reaches_tflms_function_and_the_keras_callback():
    """``on_budget_miss`` is an LMSConfig option: ``tflms.function`` and ``LMSCallback`` take it
    as they take the others, and refuse a bad value when made, naming it."""
    import tflms
    from tflms.integrations.keras import LMSCallback

    def step(x):
        return x

    assert tflms.function(step, budget="1GiB", on_budget_miss="best").config.on_budget_miss == "best"
    assert LMSCallback(budget="1GiB", on_budget_miss="best").config.on_budget_miss == "best"
    for make in (lambda: tflms.function(step, on_budget_miss="nope"), lambda: LMSCallback(on_budget_miss="nope")):
        with pytest.raises(ValueError, match=r"on_budget_miss must be 'raise'.*Received: on_budget_miss='nope'"):
            make()


def test_the_entry_points_refuse_a_knob_given_as_an_option_and_take_call_settings():
    """Knobs go in ``knobs=tflms.Knobs(...)`` everywhere; ``manual_memory_optimizer`` and
    ``layout_optimizer`` are arguments of the entry points that call a rewritten step."""
    import tensorflow as tf

    import tflms
    from tflms.integrations.horovod.callback import HorovodLMSCallback
    from tflms.integrations.keras import LMSCallback

    def step(x):
        return x * 2.0

    cf = tf.function(step).get_concrete_function(tf.TensorSpec((2,)))
    message = r"^swapout_threshold=40 is a knob, not an option: write knobs=tflms.Knobs\(swapout_threshold=40\)\.$"
    for make in (
        lambda: tflms.function(step, swapout_threshold=40),
        lambda: tflms.function(swapout_threshold=40),
        lambda: tflms.optimize(cf, swapout_threshold=40),
        lambda: LMSCallback(swapout_threshold=40),
        lambda: HorovodLMSCallback(swapout_threshold=40),
        lambda: tflms.max_batch_size(lambda b: cf, "1GiB", swapout_threshold=40),
    ):
        with pytest.raises(TypeError, match=message):
            make()
    with pytest.raises(TypeError, match=r"layout_optimizer=True is a setting"):
        tflms.optimize(cf, layout_optimizer=True)
    fn = tflms.function(step, knobs=Knobs(swapout_threshold=40), manual_memory_optimizer=False, layout_optimizer=True)
    assert fn.config.knobs.swapout_threshold == 40 and "layout_optimizer" not in fn.config.to_dict()
    assert (fn._manual_memory_optimizer, fn._layout_optimizer) == (False, True)  # noqa: SLF001
    cb = LMSCallback(knobs=Knobs(swapin_ahead=4), layout_optimizer=True)
    assert cb.config.knobs.swapin_ahead == 4 and cb._call_settings["layout_optimizer"] is True  # noqa: SLF001
    hvd = HorovodLMSCallback(knobs=Knobs(swapin_ahead=4), manual_memory_optimizer=False)
    assert hvd.config.knobs.swapin_ahead == 4 and hvd._call_settings["manual_memory_optimizer"] is False  # noqa: SLF001
    for make in (lambda: tflms.function(step, layout_optimizer="no"), lambda: LMSCallback(manual_memory_optimizer=1)):
        with pytest.raises(ValueError, match="must be True or False"):
            make()
