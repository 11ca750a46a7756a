"""The install requirements: tflms installs the ``tensorflow`` package that the ecosystem's
packages (keras-hub through tensorflow-text, tf-keras) depend on, so installing them beside
tflms adds no second TensorFlow."""

import ast
import importlib.metadata
import os
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.unit


def _requirement(choice: str) -> list[str]:
    env = {**os.environ, "TFLMS_TF": choice}
    # setup.py calls setup() on import: made a no-op first.
    code = (
        "import sys, setuptools; setuptools.setup = lambda **k: None; "
        f"sys.path.insert(0, {str(REPO)!r}); import setup; print(setup.tensorflow_requirement())"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


def test_the_cpu_build_is_the_tensorflow_package_the_ecosystem_depends_on():
    assert _requirement("cpu") == ["tensorflow==2.21.*"]
    assert _requirement("gpu") == ["tensorflow[and-cuda]==2.21.*"]
    assert _requirement("none") == []


def test_keras_hub_and_tf_keras_beside_tflms_add_no_second_tensorflow():
    """In the test environment (``pip install -e '.[test]'``, which brings keras-hub and tf-keras):
    one TensorFlow distribution, not ``tensorflow`` beside ``tensorflow-cpu``."""
    installed = {d.metadata["Name"].lower().replace("_", "-") for d in importlib.metadata.distributions()}
    assert {"keras-hub", "tf-keras", "tensorflow-text"} <= installed
    assert "tensorflow" in installed and "tensorflow-cpu" not in installed
