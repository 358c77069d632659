# Two commands set up and run everything on a fresh machine:
#   make train   -- trains the default DLRM with its big tables on the SCM tiers
#   make test    -- lint, strict type check and the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
REQS ?= requirements/cpu.txt
TORCHREC ?= 1.8.0
# pytest-xdist workers: one per CPU; PYTEST_WORKERS=0 runs the suite in one process.
PYTEST_WORKERS ?= auto
STAMP := $(VENV)/.installed-stamp
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: install train test lint typecheck pytest bench clean

$(STAMP): pyproject.toml $(REQS) requirements/dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r $(REQS) -r requirements/dev.txt
	$(PY) -m pip install -q --no-deps torchrec==$(TORCHREC)
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	THP_MEM_ALLOC_ENABLE=1 $(PY) -m apps.dlrm.train $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

typecheck: $(STAMP)
	$(PY) -m mypy

pytest: $(STAMP)
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

test: lint typecheck pytest

clean:
	rm -rf $(VENV) runs .mypy_cache .ruff_cache .pytest_cache
