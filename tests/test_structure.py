"""The package's layering, read from its source with ``ast`` (``tflms`` is not imported).

The stages are subpackages of ``tflms``, in data-flow order: :data:`STAGES`. The rule, for every
import between two tflms modules (at module level, inside a function, or under ``if
TYPE_CHECKING:``):

- a module of a stage imports only from its own stage, from an earlier stage, or from a base module;
- the base modules (:data:`BASE`: options, errors, TensorFlow's private API, device strings and
  small helpers) sit below all stages: they import only each other;
- the entry modules (:data:`ENTRY`: the package itself, its command line and the re-exports
  ``tflms.testbed`` and ``tflms.horovod``) sit above all: they may import anything, and nothing
  in a stage or the base imports them (but for ``from tflms import __version__``: the version
  is no stage's, and the package's lazy re-exports are what a stage must not reach);
- every other top-level module must be classified here (the test names it).

Imports between tflms modules also form no cycle (imports under ``if TYPE_CHECKING:`` left out:
they never run), no private name crosses stages, and every import names a module that exists.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import networkx as nx
import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[1] / "tflms"
#: The stages (subpackages of tflms) in data-flow order.
STAGES = ("ir", "emulate", "plan", "rewrite", "report", "integrations", "testing", "tools")
#: The top-level modules below every stage.
BASE = frozenset(
    {
        "tflms.config",
        "tflms.errors",
        "tflms._tf_internal",
        "tflms._util",
        "tflms._devices",
        "tflms._device_list",
        "tflms._checks",
    }
)
#: The top-level modules above every stage.
ENTRY = frozenset({"tflms", "tflms.__main__", "tflms.cli", "tflms.testbed", "tflms.horovod"})


class Import(NamedTuple):
    importer: str
    module: str  # the imported module
    name: str  # the name imported from it ('' when a module itself is imported)
    line: int
    typing_only: bool  # under ``if TYPE_CHECKING:``


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> list[Import]:
    """Every import between tflms modules, at module level or inside a function."""
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
            typing = id(node) in typing_only
            if isinstance(node, ast.Import):
                found += [
                    Import(name, a.name, "", node.lineno, typing) for a in node.names if a.name.split(".")[0] == "tflms"
                ]
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
                        Import(name, sub, "", node.lineno, typing)
                        if sub in modules
                        else Import(name, target, alias.name, node.lineno, typing)
                    )
    return found


def _stage(module: str) -> str:
    """The subpackage (pipeline stage) a module belongs to: ``tflms.plan.passes.sums`` -> ``tflms.plan``."""
    return ".".join(module.split(".")[:2])


def layer(module: str) -> int | None:
    """Where ``module`` sits in the data flow: 0 for a base module, ``1 + i`` for a module of
    ``STAGES[i]``, ``len(STAGES) + 1`` for an entry module; ``None`` for a top-level module not
    classified."""
    if module in BASE:
        return 0
    if module in ENTRY:
        return len(STAGES) + 1
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in STAGES:
        return 1 + STAGES.index(parts[1])
    return None


def back_arrows(edges: Iterable[tuple[str, str]]) -> list[str]:
    """The arrows of ``edges`` (importer, imported) that run against the data flow, and the
    modules not classified, as ``'importer -> imported'`` lines (sorted, each once)."""
    bad = set()
    for importer, imported in edges:
        for module in (importer, imported):
            if layer(module) is None:
                bad.add(f"{module} is not classified: add it to STAGES, BASE or ENTRY in tests/test_structure.py")
        if layer(importer) is not None and layer(imported) is not None and layer(imported) > layer(importer):
            bad.add(f"{importer} -> {imported}")
    return sorted(bad)


def import_cycles(edges: Iterable[tuple[str, str]]) -> list[str]:
    """The import cycles of ``edges``, each as ``'a -> b -> ... -> a'`` (sorted)."""
    graph = nx.DiGraph((a, b) for a, b in edges if a != b)
    cycles = []
    for cycle in nx.simple_cycles(graph):
        start = cycle.index(min(cycle))
        cycle = cycle[start:] + cycle[:start]
        cycles.append(" -> ".join([*cycle, cycle[0]]))
    return sorted(cycles)


def test_imports_follow_the_data_flow():
    """No import runs from a stage to a later one, from the base to a stage, or into an entry module."""
    edges = [(i.importer, i.module) for i in _imports() if (i.module, i.name) != ("tflms", "__version__")]
    assert len(edges) > 100  # the walk found the package's imports
    arrows = back_arrows(edges)
    assert not arrows, "imports against the data flow:\n" + "\n".join(arrows)


def test_no_import_cycles_inside_tflms():
    """Imports between tflms modules, function-level ones included, form no cycle."""
    cycles = import_cycles((i.importer, i.module) for i in _imports() if not i.typing_only)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checks_name_each_offending_arrow():
    """The checkers on a small import map with one arrow against the flow, one cycle and one
    module not classified report exactly those."""
    edges = [
        ("tflms.plan.planner", "tflms.emulate.simulator"),
        ("tflms.emulate.simulator", "tflms.ir.graph"),
        ("tflms.emulate.simulator", "tflms.plan.records"),  # against the flow
        ("tflms.ir.graph", "tflms._util"),
        ("tflms.cli", "tflms.integrations.function"),
        ("tflms.integrations.function", "tflms.extra"),  # not classified
    ]
    assert back_arrows(edges) == [
        "tflms.emulate.simulator -> tflms.plan.records",
        "tflms.extra is not classified: add it to STAGES, BASE or ENTRY in tests/test_structure.py",
    ]
    assert back_arrows([("tflms.config", "tflms.ir.graph"), ("tflms.testing.demo", "tflms")]) == [
        "tflms.config -> tflms.ir.graph",
        "tflms.testing.demo -> tflms",
    ]
    assert back_arrows(edges[:2] + edges[3:5]) == []
    assert import_cycles(edges) == []
    assert import_cycles([*edges, ("tflms.ir.graph", "tflms.plan.planner")]) == [
        "tflms.emulate.simulator -> tflms.ir.graph -> tflms.plan.planner -> tflms.emulate.simulator"
    ]


def test_no_private_name_crosses_subpackages():
    """A name starting with ``_`` is imported only within its own stage (subpackage)."""
    crossing = [
        f"{i.importer}:{i.line} imports {i.module}.{i.name}"
        for i in _imports()
        if i.name.startswith("_") and not i.name.startswith("__") and _stage(i.importer) != _stage(i.module)
    ]
    assert crossing == []


def test_every_import_between_tflms_modules_names_one_that_exists():
    """A function-level import that a move left pointing at an old module fails only when run:
    every import between tflms modules, function-level ones included, names an existing module."""
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    missing = [f"{i.importer}:{i.line} imports {i.module}" for i in _imports() if i.module not in modules]
    assert missing == []


def test_each_stage_says_what_it_holds_and_the_package_map_names_the_stages_in_order():
    """Each stage's ``__init__.py`` (and ``tflms/plan/passes``'s) has a docstring of at most four
    lines that says more than the stage's name. The package map is written once, in the docstring
    of ``tflms`` (a line ``<stage>/ ...`` a stage), and names every stage in the order of
    :data:`STAGES`; docs/how-it-works.md renders that docstring (``::: tflms``)."""
    import re

    def docstring(path: Path) -> str:
        return ast.get_docstring(ast.parse(path.read_text())) or ""

    bad = {}
    for stage in (*STAGES, "plan/passes"):
        text = docstring(PACKAGE / stage / "__init__.py")
        if not 1 <= len(text.splitlines()) <= 4 or len(text.split()) < 8:
            bad[stage] = text
    assert not bad, f"stage docstrings missing, bare or longer than four lines: {bad}"

    package_map = re.findall(r"^(\w+)/\s", docstring(PACKAGE / "__init__.py"), re.MULTILINE)
    assert tuple(package_map) == STAGES, "the package map in tflms/__init__.py does not list STAGES in order"
    how_it_works = (PACKAGE.parent / "docs" / "how-it-works.md").read_text()
    assert re.search(r"^::: tflms$", how_it_works, re.MULTILINE), "docs/how-it-works.md does not render the map"
