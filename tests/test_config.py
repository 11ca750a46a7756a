"""LMSConfig's op-type options, checked against TensorFlow's op registry (the rest of
LMSConfig is tested without TensorFlow in tests/unit/test_config.py)."""

import pytest

from tflms import LMSConfig

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
        LMSConfig(**kwargs)
    msg = str(err.value)
    assert f"{name}=" in msg and "Received" in msg
    assert "TensorFlow does not know" in msg


def test_op_types_are_sorted_deduplicated_and_roundtrip():
    base = LMSConfig(swapout_threshold=7, incl_types=("Relu", "Conv2D", "Relu"), excl_types="MatMul")
    assert (base.knobs.incl_types, base.knobs.excl_types) == (("Conv2D", "Relu"), ("MatMul",))
    cfg = LMSConfig.from_options(base, swapin_ahead=4)
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
