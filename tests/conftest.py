"""Test tiers, and the CPU split into two logical devices before TensorFlow starts.

Tiers (markers given by path below; select one with ``-m``):

- ``unit``: ``tests/unit/``, hand-built graphs, no TensorFlow (checked: a unit-only
  session fails if anything imports ``tensorflow``); ``pytest tests/unit``.
- ``integration``: the one-process CPU device pair and the two-process test bed; the
  long cases are also ``slow`` (``-m "integration and not slow"``).
- ``distributed``: Horovod jobs launched with ``horovodrun``.
- ``docs``: the README, the notebook, the command line as documented, the doctests.
- ``gpu``: needs a GPU; skipped without one, failed instead when ``TFLMS_TEST_GPU=1``.

Across tiers, ``measured`` marks the tests whose outcome depends on a quiet machine: they
measure device memory on the two-process test bed (a swapped tensor stays on the device
until the host worker has received it, so a busy CPU raises the measured peak) or on a
GPU. ``make test`` runs them in a second pytest run of their own, after the other tests
(the Horovod jobs included) ran in two processes at once (``pytest -n 2 --dist loadfile``:
their outcome is numbers and graphs, not time; each file's tests run in one process, so that
its module-scoped fixtures, e.g. a 2-rank Horovod job, and ``zoo.shared`` steps are made once).

For every tier but ``unit``, ``/device:CPU:1`` plays the GPU (the compute device) and
``/device:CPU:0`` the host: the split is made the first time pytest collects a module
outside ``tests/unit``, before that file (or anything it imports) runs a TensorFlow op.
This module imports no TensorFlow itself, so ``from conftest import DEVICE, HOST`` and
a unit-only session stay free of it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# One kernel library on every x86 machine: TensorFlow turns oneDNN on by default only on CPUs with
# AVX-512 VNNI and newer. TF_ENABLE_ONEDNN_OPTS=0 runs the suite on Eigen's kernels instead.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

DEVICE = "/device:CPU:1"
# The test models are small: many of their activations are under the default min_bytes
# (256 KiB), so the tests that need swaps lower it to the former default, 4 KiB.
SMALL = {"min_bytes": 4096}
HOST = "/device:CPU:0"

TESTS = Path(__file__).resolve().parent
UNIT = TESTS / "unit"

TIERS = {
    "unit": "hand-built graphs, no TensorFlow (tests/unit)",
    "integration": "TensorFlow on the one-process CPU device pair or the two-process test bed",
    "distributed": "Horovod jobs launched with horovodrun",
    "docs": "README, notebook, the documented command line, doctests",
    "gpu": "needs a GPU: skipped without one, failed when TFLMS_TEST_GPU=1",
}
DISTRIBUTED_FILES = {"test_horovod.py", "test_horovod_keras.py"}
DOCS_FILES = {"test_readme.py", "test_notebook.py"}
# test_cli.py: the demo (`make run`) and the console script as the README shows them.
DOCS_TESTS = ("test_cli.py::test_demo_", "test_cli.py::test_console_script_")
GPU_FILES = {"test_gpu.py"}
# Real device memory on the two-process test bed: run on a quiet machine (not with -n 2).
MEASURED_TESTS = ("test_testbed.py::", "test_keras_memory.py::", "test_cli.py::test_demo_", "test_gpu.py::")
# Minutes rather than seconds on 2 CPU cores (real-memory measurements in fresh processes,
# ResNet50 steps, the notebook, the demo): matched against "file.py::test_name[params]".
SLOW_TESTS = (
    "resnet50",
    "test_testbed.py::test_rewritten_step_measures_less_than_plain",
    "test_testbed.py::test_tflms_function_frees_memory",
    "test_testbed.py::test_recompute_frees",
    "test_keras_memory.py::test_measured_and_predicted_peaks",
    "test_keras_memory.py::test_no_measured_entry_without_the_bfc_allocator",
    "test_notebook.py::test_notebook_runs",
    "test_cli.py::test_demo_",
)

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


def _is_unit(path: Path) -> bool:
    return UNIT == path or UNIT in path.parents


def pytest_configure(config: pytest.Config) -> None:
    for name, text in TIERS.items():
        config.addinivalue_line("markers", f"{name}: tier: {text}")
    config.addinivalue_line("markers", "slow: takes minutes on 2 CPU cores (deselect with -m 'not slow')")
    config.addinivalue_line("markers", "measured: measures memory on the test bed; run it on a quiet machine")


def pytest_collectstart(collector: pytest.Collector) -> None:
    # A module collector starts before pytest imports its module: set TensorFlow up before
    # the first module outside tests/unit (a test module, or a doctest module of tflms/)
    # or anything it imports can use it. (pytest_collect_file would be too early: it is
    # called for every file of a directory, also those a unit-only session then skips.)
    if isinstance(collector, pytest.Module) and not _is_unit(Path(str(collector.path)).resolve()):
        configure_tensorflow()


def tier_of(item: pytest.Item) -> str:
    path = Path(str(item.path)).resolve()
    nodeid = item.nodeid.split("/")[-1]
    if _is_unit(path):
        return "unit"
    if TESTS not in path.parents:
        return "docs"  # --doctest-modules tflms/...
    if path.name in GPU_FILES:
        return "gpu"
    if path.name in DISTRIBUTED_FILES:
        return "distributed"
    if path.name in DOCS_FILES or nodeid.startswith(DOCS_TESTS):
        return "docs"
    return "integration"


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(tier_of(item))
        nodeid = item.nodeid.split("/")[-1]
        if any(part in nodeid for part in SLOW_TESTS):
            item.add_marker("slow")
        if nodeid.startswith(MEASURED_TESTS):
            item.add_marker("measured")


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
            "tests/unit must not need TensorFlow; move the test out of tests/unit"
        )
    return report


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _unit_only(session) and "tensorflow" in sys.modules and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.write_line("ERROR: tensorflow was imported during a unit-only session (tests/unit)", red=True)
