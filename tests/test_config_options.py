"""LMSConfig validation (the op-type checks need TensorFlow: tests/test_config.py)."""

import pytest

from tflms import Knobs, LMSConfig
from tflms.config import keyword_options

pytestmark = pytest.mark.unit


def test_defaults_and_canonical_devices():
    cfg = LMSConfig(device="gpu:1", host="/CPU:0")
    assert cfg.device == "/device:GPU:1"
    assert cfg.host == "/device:CPU:0"
    assert LMSConfig().device is None


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"swapout_threshold": -1}, "swapout_threshold"),
        ({"swapin_ahead": 0}, "swapin_ahead"),
        ({"swapin_groupby": -2}, "swapin_groupby"),
        ({"min_bytes": -5}, "min_bytes"),
        ({"n_tensors": -1}, "n_tensors"),
        ({"batch_size": 0}, "batch_size"),
        ({"swapout_threshold": 2.5}, "swapout_threshold"),
        ({"swapout_threshold": True}, "swapout_threshold"),
        ({"device": "/device:FOO:0"}, "device"),
        ({"device": "garbage"}, "device"),
        ({"device": "/device:GPU"}, "device"),
        ({"device": ""}, "device"),
        ({"host": None}, "host"),
        ({"device": "/device:CPU:0"}, "device"),  # same as host
        ({"incl_scopes": [""]}, "incl_scopes"),
        ({"link_bandwidth": 0}, "link_bandwidth"),
        ({"link_bandwidth": "fast"}, "link_bandwidth"),
        ({"link_bandwidth": "fast/s"}, "link_bandwidth"),
        ({"link_bandwidth": float("inf")}, "link_bandwidth"),
        ({"link_latency": -1e-6}, "link_latency"),
        ({"link_latency": "10us"}, "link_latency"),
        ({"link_latency": float("nan")}, "link_latency"),
        ({"on_budget_miss": "warn"}, "on_budget_miss"),
        ({"on_budget_miss": None}, "on_budget_miss"),
        ({"on_budget_miss": True}, "on_budget_miss"),
    ],
)
def test_invalid_options_name_argument_and_value(kwargs, name):
    with pytest.raises(ValueError) as err:
        LMSConfig(**keyword_options(kwargs))  # a knob given in knobs=Knobs(...)
    msg = str(err.value)
    assert f"{name}=" in msg and "Received" in msg


@pytest.mark.parametrize("value", [16 * 10**9, 16e9, "16GB", "16 GB/s", "16GB/s"])
def test_link_bandwidth_is_bytes_per_second(value):
    assert LMSConfig(knobs=Knobs(link_bandwidth=value)).knobs.link_bandwidth == 16 * 10**9
    assert LMSConfig(knobs=Knobs(link_latency=0)).knobs.link_latency == 0.0


def test_from_options_rejects_unknown_names():
    with pytest.raises(TypeError, match="swapout_treshold"):
        LMSConfig.from_options(swapout_treshold=3)


def test_from_options_overrides_base_and_roundtrips():
    base = LMSConfig(knobs=Knobs(swapout_threshold=7, incl_scopes=("conv1/",)))
    cfg = LMSConfig.from_options(base, budget="1GiB").with_knobs(swapin_ahead=4)
    assert (cfg.knobs.swapout_threshold, cfg.knobs.swapin_ahead, cfg.knobs.incl_scopes) == (7, 4, ("conv1/",))
    assert cfg.budget == 1 << 30 and cfg.replace(knobs=Knobs()).knobs == Knobs()
    assert LMSConfig.from_dict(cfg.to_dict()) == cfg
    assert hash(cfg) == hash(LMSConfig.from_dict(cfg.to_dict()))


def test_names_are_sorted_and_deduplicated():
    cfg = LMSConfig(knobs=Knobs(excl_scopes=["b/", "a/", "b/"]))
    assert cfg.knobs.excl_scopes == ("a/", "b/")


def test_on_budget_miss_is_raise_or_best_and_recorded_only_when_not_raise():
    assert LMSConfig().on_budget_miss == "raise"
    assert LMSConfig().to_dict()["on_budget_miss"] == "raise"
    best = LMSConfig(budget="1GiB", on_budget_miss="best")
    assert best.to_dict()["on_budget_miss"] == "best"
    assert LMSConfig.from_dict(best.to_dict()) == best
    assert LMSConfig.from_dict(LMSConfig().to_dict()) == LMSConfig()
    with pytest.raises(ValueError, match=r"'raise'.*'best'.*Received: on_budget_miss='Best'"):
        LMSConfig(on_budget_miss="Best")


FLAT_KNOB = r"^swapout_threshold=40 is a knob, not an option: write knobs=tflms.Knobs\(swapout_threshold=40\)\.$"


def test_a_knob_given_as_an_option_raises_one_type_error_saying_what_to_write():
    with pytest.raises(TypeError, match=FLAT_KNOB):
        LMSConfig(swapout_threshold=40)
    with pytest.raises(TypeError, match=FLAT_KNOB):
        LMSConfig("1GiB", swapout_threshold=40)
    for make in (
        lambda: LMSConfig().replace(swapout_threshold=40),
        lambda: LMSConfig.from_options(LMSConfig(), swapout_threshold=40),
    ):
        with pytest.raises(TypeError, match=FLAT_KNOB):
            make()
    two = r"^min_bytes=0, serialize=False are knobs, not options: write knobs=tflms.Knobs\(min_bytes=0, serialize=Fa"
    with pytest.raises(TypeError, match=two):
        LMSConfig(budget="1GiB", min_bytes=0, serialize=False)
    assert LMSConfig(knobs=Knobs(swapout_threshold=40)).knobs.swapout_threshold == 40


@pytest.mark.parametrize("name, value", [("manual_memory_optimizer", False), ("layout_optimizer", True)])
def test_a_call_setting_is_not_an_option_of_a_plan(name, value):
    with pytest.raises(
        TypeError, match=rf"^{name}={value} is a setting of how a rewritten step is called.*tflms.function"
    ):
        LMSConfig(**{name: value})
    with pytest.raises(TypeError, match=rf"^{name}={value} is a setting"):
        LMSConfig().replace(**{name: value})
    with pytest.raises(TypeError):
        Knobs(**{name: value})


def test_flat_options_of_saved_plans_still_load():
    """A plan's options are flat (user options and knobs side by side); those of older plans may
    also hold the call settings, which are left out, or the passes as booleans."""
    cfg = LMSConfig(budget="1GiB", knobs=Knobs(swapout_threshold=7, min_bytes=0, incl_scopes=("a/",)))
    flat = cfg.to_dict()
    assert flat["swapout_threshold"] == 7 and flat["incl_scopes"] == ["a/"] and "knobs" not in flat
    assert "manual_memory_optimizer" not in flat and "layout_optimizer" not in flat
    assert LMSConfig.from_dict(flat) == cfg
    old = {**flat, "manual_memory_optimizer": True, "layout_optimizer": False}
    assert LMSConfig.from_dict(old) == cfg
    with pytest.raises(TypeError, match="Unknown LMS option"):
        LMSConfig.from_dict({**flat, "swapout_treshold": 3})
