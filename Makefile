# `make test` / `make demo` set everything up on a fresh machine (Python 3.11, CPU):
# they create .venv from requirements-cpu.txt when it is missing, then run.
# On a machine that already has the frameworks (e.g. the GPU box, python 3.12 with its own
# torch/triton/jax and no package index), skip the venv:  make test PY=python3
VENV ?= .venv
PY ?= $(VENV)/bin/python
BASE_PY ?= python3.11
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` when it is installed (the venv has it; a bare python3
# may not): the suite is mostly single-threaded interpreter work, so 2 cores take ~half the time.
# With xdist >= 3.2, --dist worksteal: an idle worker takes tests queued for the other, so
# the run does not end on one worker's backlog.
TEST_WORKERS ?= 2
# Seconds one test may take before pytest-timeout (when installed) fails it: a kernel loop that
# never ends would otherwise hold CI until its limit. The slowest test took 106 s on a busy
# 2-core machine (60 s on a quiet one).
TEST_TIMEOUT ?= 600
DEMO_ARGS ?=
# requirements-cpu.txt pins a bare torch==2.13.0: the dev/CI machines resolve it to a local CPU
# wheel (pip find-links); elsewhere PyPI serves the multi-GB CUDA build. On such a machine
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
# takes the CPU build from PyTorch's index instead. Empty by default (CI is unchanged).
TORCH_INDEX ?=

.PHONY: test demo bench env clean

ifeq ($(PY),$(VENV)/bin/python)
ENV_DEP := $(VENV)/.installed
else
ENV_DEP :=
endif

# pip byte-compiles what it installs on one core (~1 min here); compileall does it on every
# core. Not skipped: with PYTHONDONTWRITEBYTECODE=1 (set on the dev and CI machines) nothing
# would ever write the .pyc files, and every process would recompile its imports. `|| true`:
# a few packages ship files that are not Python 3 on purpose (pip skips them too).
$(VENV)/.installed: requirements-cpu.txt
	@command -v $(BASE_PY) >/dev/null || { echo "need $(BASE_PY) (or run with PY=python3 on a prepared machine)"; exit 1; }
	test -x $(PY) || $(BASE_PY) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile --no-cache-dir --disable-pip-version-check $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) -r requirements-cpu.txt
	$(PY) -m compileall -q -j 0 $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') > /dev/null || true
	touch $@

env: $(ENV_DEP)

test: $(ENV_DEP)
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PY) -m pytest -q \
	  $$($(PY) -c 'import xdist' 2>/dev/null && echo "-n $(TEST_WORKERS)") \
	  $$($(PY) -c 'import sys, xdist; sys.exit(tuple(map(int, xdist.__version__.split(".")[:2])) < (3, 2))' 2>/dev/null && echo "--dist worksteal") \
	  $$($(PY) -c 'import pytest_timeout' 2>/dev/null && echo "--timeout $(TEST_TIMEOUT)") $(PYTEST_ARGS)

demo: $(ENV_DEP)
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PY) benchmarks/demo.py $(DEMO_ARGS)

bench: $(ENV_DEP)
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PY) benchmarks/linear_cross_entropy.py

clean:
	rm -rf $(VENV) .pytest_cache
