"""``import tflms`` stays light: the pure modules and ``tflms --help`` do not import TensorFlow
(that it does load on first use of a name that needs it: tests/test_imports.py)."""

import subprocess
import sys

import pytest

import tflms


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
        "import tflms.graph, tflms.planner, tflms.simulator, tflms.plan, tflms.autotune, tflms.schedule, tflms.testbed",
        "from tflms.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass",
    ],
)
def test_light_paths_do_not_import_tensorflow(code):
    assert not tf_loaded_after(code)


def test_no_import_cycles_inside_tflms():
    """Module-level and function-level imports between tflms modules form no cycle
    (imports under ``if TYPE_CHECKING:`` are for annotations only and do not count)."""
    import ast
    from pathlib import Path

    import networkx as nx

    graph = nx.DiGraph()
    for path in (Path(tflms.__file__).parent).glob("*.py"):
        tree = ast.parse(path.read_text())
        typing_only = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
            for n in ast.walk(node)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and id(node) not in typing_only:
                targets = [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
                graph.add_edges_from((path.stem, t) for t in targets)
    assert graph.number_of_edges() > 20  # the walk found the package's imports
    assert list(nx.simple_cycles(graph)) == []
