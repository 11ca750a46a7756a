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

.PHONY: run test install horovod lint bench

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(STAMP)

horovod: install
	$(PY) -m tflms.build_horovod

run: install
	$(PY) -m tflms demo

lint: install
	$(PY) -m ruff check tflms tests benchmarks
	$(PY) -m ruff format --check tflms tests benchmarks

test: horovod lint
	$(PY) -m pytest -q tests --doctest-modules tflms/config.py tflms/devices.py tflms/graph.py tflms/simulator.py tflms/testbed.py

bench: install
	$(PY) benchmarks/pass_speed.py
