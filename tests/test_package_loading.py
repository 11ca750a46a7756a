"""TensorFlow loads on the first use of a name that needs it (the light paths, which must
not import it, are checked in tests/unit/test_imports.py)."""

import pytest
from test_package import tf_loaded_after

import tflms

pytestmark = pytest.mark.integration


def test_tensorflow_names_load_on_first_use():
    assert tf_loaded_after("import tflms; tflms.function")
    assert tflms.SwapPlan is tflms.plan.records.SwapPlan
    assert set(tflms.__all__) <= set(dir(tflms))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = tflms.nope
