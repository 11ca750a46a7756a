# The two commands of the README: `make run` and `make test`. Both set up a fresh
# machine on their own: a virtualenv in .venv, TensorFlow 2.21 (CPU or CUDA build,
# see setup.py), tflms, and for tests the Horovod wheel (built once, cached in
# ~/.cache/tflms/wheels).
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tflms-installed
# horovodrun and the venv's python must be found on PATH by the Horovod tests.
export PATH := $(abspath $(VENV))/bin:$(PATH)
export TF_CPP_MIN_LOG_LEVEL ?= 2

DOCTESTS := tflms
PYTEST := $(PY) -m pytest -q

.PHONY: run test install horovod lint bench docs test-unit test-integration test-distributed test-docs test-gpu

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(STAMP)

horovod: install
	$(PY) -m tflms.tools.build_horovod

run: install
	$(PY) -m tflms demo

lint: install
	$(PY) -m ruff check tflms tests benchmarks
	$(PY) -m ruff format --check tflms tests benchmarks

# Test tiers: every test module names its tier with a marker (tests/conftest.py lists them).
# `make test` runs every tier: the unit tier first (seconds, no TensorFlow) so that it fails
# fast, before the Horovod build; then the docs site's strict build; then integration,
# distributed, docs and gpu (the gpu tier skips without a GPU) in two pytest runs: first the
# tests whose outcome is numbers and graphs (the Horovod jobs included), TEST_WORKERS processes
# at once (pytest-xdist; each file in one process, so that module-scoped fixtures and
# zoo.shared steps are made once); then, alone on the machine, the ones that measure memory
# (marker `measured`).
TEST_WORKERS ?= 2
QUIET := measured
test: test-unit horovod lint docs
	$(PYTEST) tests --doctest-modules $(DOCTESTS) -m "not unit and not ($(QUIET))" -n $(TEST_WORKERS) --dist loadfile --durations=15
	$(PYTEST) tests -m "not unit and ($(QUIET))" --durations=10

test-unit: install
	$(PYTEST) tests -m unit

test-integration: install
	$(PYTEST) tests -m integration

test-distributed: horovod
	$(PYTEST) tests -m distributed

test-docs: install
	$(PYTEST) tests -m docs --doctest-modules $(DOCTESTS)

# Here a missing GPU is a failure, not a skip.
test-gpu: install
	TFLMS_TEST_GPU=1 $(PYTEST) tests -m gpu

# The documentation site (mkdocs.yml, docs/) into build/site; --strict: a broken link or an
# API reference that does not resolve fails the build.
docs: install
	$(PY) -m pip install -q -e '.[docs]'
	$(PY) -m mkdocs build --strict

bench: install
	$(PY) benchmarks/pass_speed.py
