"""Every name the documentation points at exists: each ``tests/....py`` path and each dotted
``tflms.`` name in the docstrings and comments of the package's modules, in the README and in
the hand-written and generated pages of docs/ resolves (the path is a file of the repository;
the name is an importable module, or an attribute chain of one). A test that moves or a
function that is renamed fails this test with every place that still names the old one."""

from __future__ import annotations

import ast
import importlib
import inspect
import io
import re
import textwrap
import tokenize
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.docs

#: A repository path of a test or helper module: ``tests/plan/test_recompute.py``.
TEST_PATH = re.compile(r"(?<![\w./-])tests/[\w./-]*?\w\.py\b")
#: A dotted name under the package: ``tflms.ir.graph.GraphModel``. Not part of a longer word,
#: a path or a URL (``github.com/.../tflms.git`` is preceded by ``/``); a trailing period is
#: punctuation, not part of the name.
DOTTED = re.compile(r"(?<![\w./:-])tflms(?:\.[A-Za-z_]\w*)+")
#: Dotted names that are not Python names: the logger of the passes.
NOT_PYTHON = frozenset({"tflms.passes"})


def texts_of_module(path: Path) -> list[tuple[int, str]]:
    """``(line, text)`` of every docstring (module, class, function) and comment of ``path``."""
    source = path.read_text()
    found = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    found.append((body[0].lineno, body[0].value.value))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found.append((token.start[0], token.string))
    return found


def references(text: str, where: str, first_line: int = 1) -> list[tuple[str, str]]:
    """``(reference, where:line)`` for every test path and ``tflms.`` name in ``text``."""
    found = []
    for offset, line in enumerate(text.splitlines()):
        for pattern in (TEST_PATH, DOTTED):
            for match in pattern.finditer(line):
                found.append((match.group(0), f"{where}:{first_line + offset}"))
    return found


def resolves(reference: str, root: Path = REPO) -> bool:
    """Whether ``reference`` (a repository path or a dotted name) names something that exists."""
    if reference.endswith(".py") and "/" in reference:
        return (root / reference).is_file()
    if reference in NOT_PYTHON:
        return True
    parts = reference.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if hasattr(obj, name):
                obj = getattr(obj, name)
            elif isinstance(obj, type) and _declares(obj, name):
                return True  # a field without a class-level default: the end of the chain
            else:
                return False
        return True
    return False


def _declares(cls: type, name: str) -> bool:
    """Whether ``cls`` declares ``name`` as a field (annotated, a dataclass field or a slot) or
    one of its methods sets it on ``self`` (an instance attribute)."""
    for klass in cls.__mro__:
        if name in getattr(klass, "__annotations__", {}) or name in getattr(klass, "__slots__", ()):
            return True
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
                and node.attr == name
            ):
                return True
    return False


def documented() -> list[tuple[str, str]]:
    """Every reference of the package's docstrings and comments, the README and docs/."""
    found = []
    for path in sorted((REPO / "tflms").rglob("*.py")):
        where = str(path.relative_to(REPO))
        for line, text in texts_of_module(path):
            found += references(text, where, line)
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        found += references(path.read_text(), str(path.relative_to(REPO)))
    return found


def stale(found: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``(reference, where)`` for every reference of ``found`` that does not resolve."""
    known: dict[str, bool] = {}
    for reference, _ in found:
        if reference not in known:
            known[reference] = resolves(reference)
    return [(reference, where) for reference, where in found if not known[reference]]


def test_collector_finds_paths_and_names_and_skips_urls_and_punctuation():
    text = (
        "See tests/plan/test_recompute.py and tflms.ir.graph.GraphModel.\n"
        "https://github.com/org/tflms.git, pip install tflms.\n"
        "(tflms.function), `tflms.testbed`\n"
    )
    assert [ref for ref, _ in references(text, "x")] == [
        "tests/plan/test_recompute.py",
        "tflms.ir.graph.GraphModel",
        "tflms.function",
        "tflms.testbed",
    ]
    assert references(text, "x")[0][1] == "x:1"


def test_resolver_names_an_injected_stale_reference():
    text = (
        '"""Checked in tests/test_no_such_file.py; see tflms.ir.graph.no_such_helper and\n'
        'tflms.plan.no_such_module; tflms.ir.graph.GraphModel and tests/conftest.py exist."""\n'
        "# tflms.function is real\n"
    )
    found = []
    for line, body in ast_texts(text):
        found += references(body, "probe.py", line)
    assert stale(found) == [
        ("tests/test_no_such_file.py", "probe.py:1"),
        ("tflms.ir.graph.no_such_helper", "probe.py:1"),
        ("tflms.plan.no_such_module", "probe.py:2"),
    ]


def ast_texts(source: str) -> list[tuple[int, str]]:
    """:func:`texts_of_module` on a source string."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "probe.py"
        path.write_text(source)
        return texts_of_module(path)


def test_every_documented_reference_resolves():
    missing = [f"{where}: {reference}" for reference, where in stale(documented())]
    assert not missing, "stale references:\n" + "\n".join(missing)
