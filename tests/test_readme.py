"""The README's benchmark tables are the ones the benchmark JSON produces."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("report", ROOT / "benchmarks" / "report.py")
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)


@pytest.mark.parametrize("name", sorted(report.TABLES))
def test_readme_table_matches_the_benchmark_json(name):
    table = report.table(name)
    assert table is not None, f"benchmarks/results/{name}.json is missing: run the benchmark"
    assert table in (ROOT / "README.md").read_text(), f"README's {name} table differs from the JSON: paste report.py's"


def test_readme_commands_are_the_makefile_targets_ci_runs():
    readme = (ROOT / "README.md").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert "make run" in readme and "make test" in readme
    assert "\nrun:" in makefile and "\ntest:" in makefile
    assert "make test" in (ROOT / ".ci" / "run").read_text()
