"""The README and the documentation site against what they describe: every Python example of
the README and of docs/getting-started.md runs, the README's two commands are Makefile targets
that CI runs and that run every test tier, the headline table and the benchmarks page are what
benchmarks/report.py renders from the JSON today, and the site builds with ``--strict``."""

import ast
import importlib
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, load_benchmark

pytestmark = pytest.mark.docs

ROOT = REPO
README = ROOT / "README.md"
DOCS = ROOT / "docs"
#: The pages whose Python examples are executed: what a new user copies first.
EXECUTED = (README, DOCS / "getting-started.md", DOCS / "offload.md")
#: The one marker that keeps a Python example from running, on the line before its fence.
NO_RUN = "<!-- no-run -->"
#: Seconds one example may take (a tiny model, a few steps, on CPU).
EXAMPLE_TIMEOUT = 120

report = load_benchmark("report")


def code_blocks(text: str) -> list[tuple[str, str, bool]]:
    """``(language, code, no_run)`` for every fenced block of ``text``; ``no_run`` when the line
    before the fence is the ``<!-- no-run -->`` marker."""
    blocks = []
    for match in re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        blocks.append((match.group(1), match.group(2), before == NO_RUN))
    return blocks


def _python_examples() -> list[tuple[str, str]]:
    """``(id, code)`` of each distinct Python example of ``EXECUTED`` to run (a block that two
    pages share runs once)."""
    seen: dict[str, str] = {}
    for page in EXECUTED:
        for i, (lang, code, no_run) in enumerate(code_blocks(page.read_text())):
            if lang == "python" and not no_run and code not in seen:
                seen[code] = f"{page.relative_to(ROOT)}#{i}"
    return [(name, code) for code, name in seen.items()]


def _readme_commands() -> list[str]:
    """The commands of the README's block that holds ``make run``, comments dropped."""
    (block,) = [code for lang, code, _ in code_blocks(README.read_text()) if lang == "bash" and "make run" in code]
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def _make_dry_run(target: str) -> list[str]:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    out = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [line.strip() for line in out.stdout.splitlines()]


def test_code_blocks_finds_the_marker_only_on_the_line_before_the_fence():
    text = f"a\n{NO_RUN}\n```python\nx = 1\n```\n\n{NO_RUN}\n\ntext\n```python\ny = 2\n```\n"
    assert code_blocks(text) == [("python", "x = 1\n", True), ("python", "y = 2\n", False)]


@pytest.mark.parametrize(("name", "code"), _python_examples(), ids=[name for name, _ in _python_examples()])
def test_python_example_runs(name, code, tmp_path):
    # A fresh process per example, as a user runs it: no logical devices set up by the suite.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    (tmp_path / "example.py").write_text(code)
    out = subprocess.run(
        [sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT
    )
    assert out.returncode == 0, f"{name} failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"


def test_the_examples_show_the_callback_and_the_decorator():
    names = [pair for _, code in _python_examples() for pair in _tflms_names(code)]
    assert ("tflms", "LMSCallback") in names and ("tflms", "function") in names


def test_only_horovod_examples_are_not_run():
    for page in EXECUTED:
        for _lang, code, no_run in code_blocks(page.read_text()):
            if no_run:
                assert "horovod" in code, f"{page.name}: a block marked {NO_RUN} that is not a Horovod job:\n{code}"


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; the docs site holds the rest"


def test_headline_table_is_what_the_json_gives():
    table = report.headline()
    assert table in README.read_text(), "README's headline table differs from the JSON: paste report.py --headline"
    assert table in (DOCS / "index.md").read_text(), "docs/index.md's headline table differs from the JSON"
    rows = [line for line in table.splitlines()[2:]]
    assert rows and all(re.search(r"\| (measured \(test bed\)|measured \(H200\)|predicted) \|", row) for row in rows), (
        "every headline figure says how it was obtained"
    )


def test_benchmarks_page_is_what_the_json_gives():
    page = (DOCS / "benchmarks.md").read_text()
    assert page == report.page(), "docs/benchmarks.md is stale: python benchmarks/report.py --page docs/benchmarks.md"
    for name in report.TABLES:
        if (report.RESULTS / f"{report.SOURCES.get(name, name)}.json").exists():
            assert report.table(name) in page, f"{name}'s table is not on the benchmarks page"


def test_every_table_on_the_benchmarks_page_says_its_machine_date_and_versions():
    sections = report.page().split("\n## ")[1:]
    assert len(sections) == len(report.SECTIONS)
    for section in sections:
        source = r"^Source: `benchmarks/results/\w+\.json` · machine: .+ · date: \d{4}-\d\d-\d\d"
        assert re.search(source + r" · TensorFlow \S+ · tflms .+$", section, flags=re.M), section.splitlines()[0]


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
    assert pytest_runs[0].endswith("-m pytest -q tests -m unit")
    assert lines.index(pytest_runs[0]) < min(i for i, line in enumerate(lines) if "build_horovod" in line)
    # The docs site is built strictly before the other tiers run.
    assert any(line.endswith("-m mkdocs build --strict") for line in lines)
    # Then two runs over every other tier, all of tests/ but the unit tier, split by complementary
    # marker expressions: the first in parallel with the modules' doctests and the Horovod jobs,
    # each file in one process, then the measured tests alone.
    parallel, quiet = (shlex.split(run.split(" -m pytest ")[1]) for run in pytest_runs[1:])
    for args in (parallel, quiet):
        assert "tests" in args and "-k" not in args
    assert "--doctest-modules" in parallel and "tflms" in parallel and "-n" in parallel
    expression = parallel[parallel.index("-m") + 1]
    assert expression == "not unit and not (measured)" and "-n" not in quiet
    assert quiet[quiet.index("-m") + 1] == "not unit and (measured)"
    assert parallel[parallel.index("--dist") + 1] == "loadfile"
    assert "make test" in _readme_commands()


def test_make_run_runs_the_demo():
    assert any(line.endswith("-m tflms demo") for line in _make_dry_run("run"))


def test_make_docs_builds_the_site_strictly():
    assert any(line.endswith("-m mkdocs build --strict") for line in _make_dry_run("docs"))


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists():
    text = (ROOT / "mkdocs.yml").read_text()
    nav = set(re.findall(r":\s*([\w./-]+\.md)\s*$", text, flags=re.M))
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert nav == pages, f"in the nav only: {sorted(nav - pages)}; pages not in the nav: {sorted(pages - nav)}"


def test_docs_build_strict(tmp_path):
    # Broken links, anchors and API references that do not resolve fail a --strict build.
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings_handlers") is None:
        pytest.skip("the docs extra is not installed: pip install -e '.[docs]'")
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert out.returncode == 0, out.stderr[-5000:]
    assert (tmp_path / "site" / "api" / "index.html").exists()


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


def test_docs_code_examples_use_names_that_exist():
    # Every page's Python blocks, those that do not run included (the Horovod ones): their tflms
    # names must exist.
    pages = [README, *sorted(DOCS.rglob("*.md"))]
    used = []
    for page in pages:
        for lang, code, _ in code_blocks(page.read_text()):
            if lang == "python":
                used += [pair for pair in _tflms_names(code) if pair[0] != "tflms.horovod" or pair[1] is not None]
    assert ("tflms", "function") in used and ("tflms", "LMSCallback") in used  # the parser found the examples
    for module, name in used:
        mod = importlib.import_module(module)
        if name is not None:
            exists = hasattr(mod, name) or importlib.util.find_spec(f"{module}.{name}") is not None  # or a submodule
            assert exists, f"the docs use {module}.{name}, which does not exist"
