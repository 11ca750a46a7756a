"""``import tflms`` stays light: the pure modules and ``tflms --help`` do not import TensorFlow
(that it does load on first use of a name that needs it: tests/test_imports.py). The imports
between tflms modules (the data flow, no cycle, no private name across stages) are checked in
tests/test_structure.py."""

import subprocess
import sys
from pathlib import Path

import pytest

import tflms

pytestmark = pytest.mark.unit


def tf_loaded_after(code: str) -> bool:
    """Whether a fresh interpreter has TensorFlow loaded after running ``code``."""
    out = subprocess.run(
        [sys.executable, "-c", f"import sys\n{code}\nprint('tensorflow' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.strip().splitlines()[-1] == "True"


@pytest.mark.parametrize(
    "code",
    [
        "import tflms",
        "import tflms; tflms.LMSConfig(host='/job:worker/task:0/device:CPU:0', budget='1GiB')",
        "import tflms.ir.graph, tflms.ir.decisions, tflms.emulate.simulator, tflms.emulate.order, tflms.plan.records",
        "import tflms.plan.planner, tflms.plan.autotune, tflms.plan.passes.schedule, tflms.testing.testbed",
        "from tflms.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass",
    ],
)
def test_light_paths_do_not_import_tensorflow(code):
    assert not tf_loaded_after(code)


PACKAGE = Path(tflms.__file__).parent


def test_no_module_over_600_lines():
    """No module of tflms is over about 600 lines (650 with the tolerance)."""
    long = {
        str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 650
    }
    assert long == {}
