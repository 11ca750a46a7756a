"""LMSConfig's op-type options, checked against TensorFlow's op registry (the rest of
LMSConfig is tested without TensorFlow in tests/unit/test_config.py)."""

import pytest

from tflms import LMSConfig


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
