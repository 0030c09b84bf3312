# Two commands on a fresh machine: `make train` and `make test`.
# Each bootstraps .venv (torch 2.13 + the fbgemm build for this machine) once;
# later runs skip the installs (the stamp tracks pyproject.toml).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# CUDA build of fbgemm when a GPU answers, the CPU build otherwise.
FBGEMM_EXTRA := $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
STAMP  := $(VENV)/.installed-$(FBGEMM_EXTRA)
PYTEST_ARGS ?=

.PHONY: setup train test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[$(FBGEMM_EXTRA),test,dev]"
	rm -f $(VENV)/.installed-*
	touch $@

train: $(STAMP)
	$(PY) examples/quickstart.py

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check lightning_shardrec tests examples benchmarks
	$(PY) -m mypy lightning_shardrec

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
