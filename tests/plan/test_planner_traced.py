"""The planner's op-type filters: LMSConfig checks op type names against TensorFlow's op
registry, so these cases need TensorFlow (the rest of the planner is in tests/unit)."""

import pytest

from tflms import Knobs, LMSConfig, make_plan

from graphs import chain_model

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    "options, expected",
    [
        ({"excl_types": ["Relu"]}, []),
        ({"incl_types": ["Relu"]}, ["f0:0", "f1:0", "f2:0"]),
        ({"incl_types": ["Relu"], "excl_scopes": ["f1"]}, ["f0:0", "f2:0"]),
    ],
)
def test_type_filters(options, expected):
    m = chain_model(n_fwd=6)
    cfg = LMSConfig(knobs=Knobs(swapout_threshold=6, swapin_groupby=0, min_bytes=0)).with_knobs(**options)
    assert [s.tensor for s in make_plan(m, cfg).swaps] == expected
