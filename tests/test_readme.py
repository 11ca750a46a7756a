"""The README against what it describes: its benchmark tables are the ones the benchmark
JSON produces, its two commands are Makefile targets that CI runs and that run every test
tier, and the tflms names its code examples use exist."""

import ast
import importlib
import importlib.util
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
spec = importlib.util.spec_from_file_location("report", ROOT / "benchmarks" / "report.py")
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)


def _blocks(lang):
    return re.findall(rf"^```{lang}\n(.*?)^```", README, flags=re.S | re.M)


def _readme_commands():
    """The commands of the README's bash block (``make run``, ``make test``), comments dropped."""
    (block,) = _blocks("bash")
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def _make_dry_run(target):
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    out = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [line.strip() for line in out.stdout.splitlines()]


@pytest.mark.parametrize("name", sorted(report.TABLES))
def test_readme_table_matches_the_benchmark_json(name):
    table = report.table(name)
    assert table is not None, f"benchmarks/results/{name}.json is missing: run the benchmark"
    assert table in README, f"README's {name} table differs from the JSON: paste report.py's"


def test_accuracy_table_gives_the_figures_within_10_percent_of_every_step():
    mib = 2**20

    def row(step_peaks, predicted=100 * mib):
        runs = [max(run) for run in step_peaks]
        return {
            "model": "cnn",
            "batch": 32,
            "mode": "plain",
            "runs": runs,
            "first_peaks": runs,
            "predicted": predicted,
            "step_peaks": step_peaks,
        }

    data = {
        "date": "2026-11-27",
        "machine": "x86_64, 2 CPUs",
        "tensorflow": "2.21.0",
        "tflms": "0.1.0",
        "steps": 2,
        "warmup": 1,
        # 99-108 MiB: from 108 / 1.1 = 98.2 up to 99 * 1.1 = 108.9, whole MiB rounded inwards;
        # 80-100 MiB: none (100 / 1.1 = 90.9 > 80 * 1.1 = 88.0); 83.2-100.4 MiB: 91.27-91.52, no
        # whole MiB in it, so one decimal, rounded inwards.
        "rows": [
            row([[100 * mib, 108 * mib], [99 * mib, 104 * mib]]),
            row([[80 * mib, 100 * mib]]),
            row([[int(83.2 * mib), int(100.4 * mib)]]),
        ],
    }
    lines = [line for line in report.simulator_accuracy(data).splitlines() if line.startswith("| cnn")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert [c[7:] for c in cells] == [
        ["99-108 MiB", "102 MiB", "1.02", "99-108 MiB"],
        ["80-100 MiB", "90 MiB", "0.90", "none"],
        ["83-100 MiB", "92 MiB", "0.92", "91.3-91.5 MiB"],
    ]


def test_readme_commands_are_the_makefile_targets_ci_runs():
    commands = _readme_commands()
    assert commands == ["make run", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, flags=re.M))
    phony = set(re.search(r"^\.PHONY:(.*)$", makefile, flags=re.M).group(1).split())
    for command in commands:
        target = command.split()[1]
        assert target in targets and target in phony, f"README's `{command}`: no phony Makefile target {target!r}"
    # CI runs the README's test command itself, as a command (not in a comment).
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines() if not line.lstrip().startswith("#")]
    assert "make test" in ci


def test_make_test_runs_every_tier_unit_first():
    lines = _make_dry_run("test")
    pytest_runs = [line for line in lines if " -m pytest " in line]
    # The unit tier alone first (fails fast, needs no TensorFlow), before the Horovod build and lint.
    assert pytest_runs[0].endswith("-m pytest -q tests/unit")
    assert lines.index(pytest_runs[0]) < min(i for i, line in enumerate(lines) if "build_horovod" in line)
    # Then two runs over every other tier, all of tests/ but the unit tier, split by complementary
    # marker expressions: the first in parallel with the modules' doctests and the Horovod jobs,
    # each file in one process, then the measured tests alone.
    parallel, quiet = (shlex.split(run.split(" -m pytest ")[1]) for run in pytest_runs[1:])
    for args in (parallel, quiet):
        assert "tests" in args and "--ignore=tests/unit" in args and "-k" not in args
    assert "--doctest-modules" in parallel and "tflms/config.py" in parallel and "-n" in parallel
    expression = quiet[quiet.index("-m") + 1]
    assert parallel[parallel.index("-m") + 1] == f"not ({expression})" and "-n" not in quiet
    assert expression == "measured" and parallel[parallel.index("--dist") + 1] == "loadfile"
    assert "make test" in _readme_commands()


def test_make_run_runs_the_demo():
    assert any(line.endswith("-m tflms demo") for line in _make_dry_run("run"))


def test_every_module_with_doctests_is_in_the_makefiles_doctests():
    text = (ROOT / "Makefile").read_text()
    listed = re.search(r"^DOCTESTS :=((?:.*\\\n)*.*)$", text, re.MULTILINE).group(1).replace("\\\n", " ").split()
    for path in sorted((ROOT / "tflms").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        if ">>> " in path.read_text() and not any(name == e or name.startswith(e + "/") for e in listed):
            raise AssertionError(f"{name} has doctests but is not in the Makefile's DOCTESTS: {listed}")


def _tflms_names(code):
    """(module, name) for every tflms name a code example imports or uses as ``alias.name``."""
    aliases, used = {}, []
    tree = ast.parse(code)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "tflms":
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else "tflms"
                    used.append((a.name, None))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tflms":
            used += [(node.module, a.name) for a in node.names]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            used.append((aliases[node.value.id], node.attr))
    return used


def test_readme_code_examples_use_names_that_exist():
    used = [pair for block in _blocks("python") for pair in _tflms_names(block)]
    assert ("tflms", "function") in used and ("tflms", "LMSCallback") in used  # the parser found the examples
    for module, name in used:
        mod = importlib.import_module(module)
        if name is not None:
            exists = hasattr(mod, name) or importlib.util.find_spec(f"{module}.{name}") is not None  # or a submodule
            assert exists, f"the README uses {module}.{name}, which does not exist"
