"""Progress of long plans: INFO records on logger ``tflms`` (``tflms plan`` shows them)."""

import logging

import pytest

from tflms import Knobs, LMSConfig, make_plan

from graphs import chain_model

pytestmark = pytest.mark.unit


def test_make_plan_logs_each_stage_with_its_seconds(caplog):
    model = chain_model(n_fwd=8, variable_bytes=4096)
    with caplog.at_level(logging.INFO, logger="tflms"):
        plan = make_plan(model, LMSConfig(budget=24 << 10, knobs=Knobs(min_bytes=1), policy="default"))
    messages = [r.getMessage() for r in caplog.records if r.name == "tflms"]
    assert plan.swaps and messages[0] == f"make_plan {model.name}: {model.dag.number_of_nodes()} ops"
    stages = ("passes before the swaps (", "swap knobs tuned to the budget 24.0 KiB", "memory-aware schedule (")
    assert len(messages) == 4
    for message, stage in zip(messages[1:], stages):
        assert message.startswith(f"make_plan {model.name}: {stage}"), message
        assert float(message.rsplit(" (", 1)[1].removesuffix(" s)")) >= 0  # the stage's seconds


def test_make_plan_logs_nothing_below_info(caplog):
    with caplog.at_level(logging.WARNING, logger="tflms"):
        make_plan(chain_model(), LMSConfig(knobs=Knobs(min_bytes=1)))
    assert not [r for r in caplog.records if r.name == "tflms"]
