"""Test tiers, and the CPU split into two logical devices before TensorFlow starts.

Tiers: every test module names its tier with ``pytestmark = pytest.mark.<tier>`` (a test
may name its own instead); select one with ``-m``. ``tests/`` mirrors the package
(``tests/plan`` tests ``tflms.plan``, and so on).

- ``unit``: hand-built graphs, no TensorFlow (checked: a unit-only session fails if
  anything imports ``tensorflow``); ``pytest -m unit tests``.
- ``integration``: the one-process CPU device pair and the two-process test bed; the
  long cases are also ``slow`` (``-m "integration and not slow"``).
- ``distributed``: Horovod jobs launched with ``horovodrun``.
- ``docs``: the README, the notebook, the command line as documented, the doctests.
- ``gpu``: needs a GPU; skipped without one, failed instead when ``TFLMS_TEST_GPU=1``.

Across tiers, ``slow`` marks the tests that take minutes on 2 CPU cores, and ``measured``
the tests whose outcome depends on a quiet machine: they measure device memory on the
two-process test bed (a swapped tensor stays on the device until the host worker has
received it, so a busy CPU raises the measured peak) or on a GPU. ``make test`` runs them in
a second pytest run of their own, after the other tests (the Horovod jobs included) ran in
two processes at once (``pytest -n 2 --dist loadfile``: their outcome is numbers and graphs,
not time; each file's tests run in one process, so that its module-scoped fixtures, e.g. a
2-rank Horovod job, and ``zoo.shared`` steps are made once).

For every tier but ``unit``, ``/device:CPU:1`` plays the GPU (the compute device) and
``/device:CPU:0`` the host: the split is made the first time pytest collects a module
that is not of the unit tier, before that file (or anything it imports) runs a TensorFlow op.
This module imports no TensorFlow itself, so ``from conftest import DEVICE, HOST`` and
a unit-only session stay free of it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# One kernel library on every x86 machine: TensorFlow turns oneDNN on by default only on CPUs with
# AVX-512 VNNI and newer. TF_ENABLE_ONEDNN_OPTS=0 runs the suite on Eigen's kernels instead.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

DEVICE = "/device:CPU:1"
# The test models are small: many of their activations are under the default min_bytes
# (256 KiB), so the tests that need swaps lower it to the former default, 4 KiB.
from tflms.config import Knobs  # noqa: E402 (imports no TensorFlow: after the environment above)

SMALL_KNOBS = Knobs(min_bytes=4096)
SMALL = {"knobs": SMALL_KNOBS}
HOST = "/device:CPU:0"


TIERS = {
    "unit": "hand-built graphs, no TensorFlow",
    "integration": "TensorFlow on the one-process CPU device pair or the two-process test bed",
    "distributed": "Horovod jobs launched with horovodrun",
    "docs": "README, notebook, the documented command line, doctests",
    "gpu": "needs a GPU: skipped without one, failed when TFLMS_TEST_GPU=1",
}
TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def load_benchmark(name: str) -> ModuleType:
    """The script ``benchmarks/<name>.py`` loaded as a module named ``name`` (the benchmarks are
    scripts, not a package): what the tests of a benchmark call."""
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_tf_configured = False


def configure_tensorflow() -> None:
    """Split the CPU into two logical devices and turn op determinism on (once)."""
    global _tf_configured
    if _tf_configured:
        return
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    tf.config.experimental.enable_op_determinism()
    _tf_configured = True


def _declares_unit(path: Path) -> bool:
    """Whether the test module at ``path`` declares the unit tier (read before it is imported)."""
    return path.name.startswith("test_") and "\npytestmark = pytest.mark.unit\n" in path.read_text()


def pytest_configure(config: pytest.Config) -> None:
    for name, text in TIERS.items():
        config.addinivalue_line("markers", f"{name}: tier: {text}")
    config.addinivalue_line("markers", "slow: takes minutes on 2 CPU cores (deselect with -m 'not slow')")
    config.addinivalue_line("markers", "measured: measures memory on the test bed; run it on a quiet machine")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    # ``-m unit`` alone: the other tiers' modules are not even imported (they import TensorFlow,
    # which a unit-only session must not).
    if config.getoption("markexpr") == "unit" and collection_path.suffix == ".py":
        return not _declares_unit(collection_path)
    return None


def pytest_collectstart(collector: pytest.Collector) -> None:
    # A module collector starts before pytest imports its module: set TensorFlow up before
    # the first module that is not of the unit tier (a test module, or a doctest module of
    # tflms/) or anything it imports can use it.
    if isinstance(collector, pytest.Module) and not _declares_unit(Path(str(collector.path)).resolve()):
        configure_tensorflow()


def tier_of(item: pytest.Item) -> str | None:
    """The item's tier: its closest tier marker (a test's own, else its module's ``pytestmark``)."""
    return next((m.name for m in item.iter_markers() if m.name in TIERS), None)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    untiered = []
    for item in items:
        if TESTS not in Path(str(item.path)).resolve().parents:
            item.add_marker("docs")  # --doctest-modules tflms/...
        elif tier_of(item) is None:
            untiered.append(item.nodeid)
    if untiered:
        raise pytest.UsageError(
            "every test names its tier with a marker (pytestmark = pytest.mark.<tier> in its module, or on "
            f"the test): one of {', '.join(TIERS)}. Without one: {', '.join(untiered[:5])}"
        )


def _unit_only(session: pytest.Session) -> bool:
    items = getattr(session, "items", None)
    return bool(items) and all(item.get_closest_marker("unit") for item in items)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu"):
        import tensorflow as tf

        if not tf.config.list_physical_devices("GPU"):
            if os.environ.get("TFLMS_TEST_GPU") == "1":
                pytest.fail("TFLMS_TEST_GPU=1 but TensorFlow finds no GPU (tf.config.list_physical_devices('GPU'))")
            pytest.skip("no GPU (TFLMS_TEST_GPU=1 turns this skip into a failure)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    # The unit tier's promise, checked after every unit test of a unit-only session: the
    # test that first imports TensorFlow (or every test, if collection did) fails.
    report = yield
    if report.when == "call" and report.passed and "tensorflow" in sys.modules and _unit_only(item.session):
        report.outcome = "failed"
        report.longrepr = (
            "tensorflow was imported in a unit-only session (by this test, or before it at collection): "
            "a unit test must not need TensorFlow; mark it integration instead"
        )
    return report


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _unit_only(session) and "tensorflow" in sys.modules and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.write_line("ERROR: tensorflow was imported during a unit-only session", red=True)
