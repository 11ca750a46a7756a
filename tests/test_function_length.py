"""No function of ``tflms/`` is longer than :data:`MAX_LINES` lines (issue 64, item 7).

A function's length is its lines from ``def`` to its last line, less its docstring (prose, not
logic). A function may be longer where a comment containing ``long:`` and the reason stands on the
line before its ``def`` (or before its first decorator) or among its first lines, from the ``def``
to its first statement after the docstring. Read with :mod:`ast`: nothing is imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

MAX_LINES = 80
PACKAGE = Path(__file__).resolve().parent.parent / "tflms"

_JUSTIFIED = re.compile(r"#.*\blong:")


def _has_docstring(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    first = node.body[0]
    return isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)


def _length(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from ``def`` to the function's last line, less its docstring's."""
    lines = node.end_lineno - node.lineno + 1
    if _has_docstring(node):
        lines -= node.body[0].end_lineno - node.body[0].lineno + 1
    return lines


def _justified(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> bool:
    """Whether a ``long:`` comment stands before the function or among its first lines."""
    top = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    body = node.body
    first = body[1] if _has_docstring(node) and len(body) > 1 else body[0]
    candidates = [top - 1, node.lineno - 1, *range(node.lineno, first.lineno + 1)]  # 1-based line numbers
    return any(1 <= k <= len(lines) and _JUSTIFIED.search(lines[k - 1]) for k in candidates)


def long_functions(source: str, limit: int = MAX_LINES) -> list[tuple[str, int, int]]:
    """``(qualified name, line, length)`` of each function of ``source`` longer than ``limit`` lines
    without a ``long:`` comment. A method is named ``Class.method``, a nested function ``outer.inner``.

    >>> long_functions("def f():\\n" + "    x = 1\\n" * 3, limit=3)
    [('f', 1, 4)]
    """
    lines = source.splitlines()
    found: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    length = _length(child)
                    if length > limit and not _justified(child, lines):
                        found.append((name, child.lineno, length))
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def _offenders() -> dict[str, tuple[int, int]]:
    """``path:name`` -> ``(line, length)`` of every long function of the package without a ``long:`` comment."""
    root = PACKAGE.parent
    return {
        f"{path.relative_to(root).as_posix()}:{name}": (line, length)
        for path in sorted(PACKAGE.rglob("*.py"))
        for name, line, length in long_functions(path.read_text())
    }


def test_no_function_of_the_package_is_longer_than_the_limit():
    found = _offenders()
    assert not found, (
        f"functions over {MAX_LINES} lines (docstring excluded), as path:name -> (line, length): {found}. "
        "Split them into named helpers, or put a comment '# long: <reason>' on the line before the def."
    )


SYNTHETIC = '''
class Step:
    def run(self):
        """A docstring does not count.

        Even a long one.
        """
{body}

def short():
    return 1
'''


def test_the_checker_reports_a_long_function_and_spares_a_justified_one():
    body = "\n".join(f"        x{k} = {k}" for k in range(MAX_LINES))  # with the def: one line too many
    source = SYNTHETIC.format(body=body)
    assert long_functions(source) == [("Step.run", 3, MAX_LINES + 1)]
    assert long_functions(SYNTHETIC.format(body="\n".join(body.splitlines()[1:]))) == []  # at the limit
    before = source.replace("    def run(self):", "    # long: one table, read top to bottom\n    def run(self):")
    assert long_functions(before) == []
    inside = source.replace("        x0 = 0", "        # long: one table, read top to bottom\n        x0 = 0")
    assert long_functions(inside) == []
    elsewhere = source.replace("        x5 = 5", "        x5 = 5  # long: too far down to count")
    assert [name for name, *_ in long_functions(elsewhere)] == ["Step.run"]


def test_a_nested_function_is_named_after_its_outer_one():
    inner = "\n".join(f"        y{k} = {k}" for k in range(MAX_LINES + 1))
    source = f"def outer():\n    def inner():\n{inner}\n    return inner\n"
    assert [name for name, *_ in long_functions(source)] == ["outer", "outer.inner"]
