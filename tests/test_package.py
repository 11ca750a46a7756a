"""``import tflms`` stays light: the pure modules and ``tflms --help`` do not import TensorFlow
(that it does load on first use of a name that needs it: tests/test_imports.py)."""

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx
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
        "import tflms.ir.graph, tflms.emulate.simulator, tflms.emulate.order, tflms.plan.records",
        "import tflms.plan.planner, tflms.plan.autotune, tflms.plan.passes.schedule, tflms.testing.testbed",
        "from tflms.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass",
    ],
)
def test_light_paths_do_not_import_tensorflow(code):
    assert not tf_loaded_after(code)


PACKAGE = Path(tflms.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> list[tuple[str, str, str, int]]:
    """Every import between tflms modules, at module level or inside a function:
    ``(importer, imported module, imported name or '', line)``. Imports under
    ``if TYPE_CHECKING:`` (annotations only, never run) are left out."""
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        typing_only = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
            for n in ast.walk(node)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                found += [(name, a.name, "", node.lineno) for a in node.names if a.name.split(".")[0] == "tflms"]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] != "tflms":
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    found.append(
                        (name, sub, "", node.lineno) if sub in modules else (name, target, alias.name, node.lineno)
                    )
    return found


def _stage(module: str) -> str:
    """The subpackage (pipeline stage) a module belongs to: ``tflms.plan.passes.sums`` -> ``tflms.plan``."""
    return ".".join(module.split(".")[:2])


def test_no_import_cycles_inside_tflms():
    """Imports between tflms modules, function-level ones included, form no cycle."""
    graph = nx.DiGraph((a, b) for a, b, _, _ in _imports() if a != b)
    assert graph.number_of_edges() > 60  # the walk found the package's imports
    assert list(nx.simple_cycles(graph)) == []


def test_no_private_name_crosses_subpackages():
    """A name starting with ``_`` is imported only within its own stage (subpackage)."""
    crossing = [
        f"{a}:{line} imports {b}.{n}"
        for a, b, n, line in _imports()
        if n.startswith("_") and not n.startswith("__") and _stage(a) != _stage(b)
    ]
    assert crossing == []


def test_no_module_over_600_lines():
    """No module of tflms is over about 600 lines (650 with the tolerance)."""
    long = {
        str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 650
    }
    assert long == {}


def test_every_import_between_tflms_modules_names_one_that_exists():
    """A function-level import that a move left pointing at an old module fails only when run:
    every import between tflms modules, function-level ones included, names an existing module."""
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    missing = [f"{a}:{line} imports {b}" for a, b, _, line in _imports() if b not in modules]
    assert missing == []
