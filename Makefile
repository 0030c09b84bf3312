# Two commands on a fresh machine: `make train` and `make test`.
# Each bootstraps .venv (the pinned pair: torch 2.13 + the fbgemm 1.8 build for this machine)
# once; later runs skip the installs (the stamp tracks pyproject.toml). The library itself
# runs on torch >= 2.11 with or without fbgemm: `make test-range` (docs/install.md).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# CUDA build of fbgemm when a GPU answers, the CPU build otherwise.
FBGEMM_EXTRA := torch213-$(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
STAMP  := $(VENV)/.installed-$(FBGEMM_EXTRA)
PYTEST_ARGS ?=

.PHONY: setup train test test-range test-scale lint docs clean gpu-check

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[$(FBGEMM_EXTRA),test,dev,docs]"
	rm -f $(VENV)/.installed-*
	touch $@

train: $(STAMP)
	$(VENV)/bin/shardrec fit --config examples/dlrm/config.yaml

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The supported range beyond the pinned pair: the newest torch pip reaches, with its fbgemm
# and without, and the oldest supported torch and Lightning (.ci/range.sh; venvs .venv-range-*).
test-range:
	bash .ci/range.sh

# Hundreds of ranks by simulation: the 16-24-rank cases (minutes each; not in `make test`).
test-scale: $(STAMP)
	$(PY) -m pytest -q -m scale $(PYTEST_ARGS)

docs: $(STAMP)
	$(PY) -m mkdocs build --strict

lint: $(STAMP)
	$(PY) -m ruff check lightning_shardrec tests examples benchmarks
	$(PY) -m mypy lightning_shardrec

# The benchmark suite (issue 10): each script rewrites its own section of docs/benchmarks.md.
# TorchRec (the peer) goes only into benchmarks/.venv-torchrec, never into $(VENV).
.PHONY: bench
bench: $(STAMP)
	bash benchmarks/setup_torchrec_venv.sh
	$(PY) benchmarks/data_bench.py --rows 200000 --repeats 5 --write-docs docs/benchmarks.md
	$(PY) benchmarks/planner_bench.py
	$(PY) benchmarks/kernel_bench.py --repeats 15 --write-docs docs/benchmarks.md
	$(PY) benchmarks/memory_bench.py --write-docs docs/benchmarks.md
	$(PY) benchmarks/quant_bench.py --steps 300 --repeats 7 --write-docs docs/benchmarks.md
	$(PY) benchmarks/e2e_bench.py --rounds 3 --plot docs/e2e_throughput.png --write-docs docs/benchmarks.md

# The device check (issue 33): CUDA mode when a GPU is visible, else the CPU mode (tiny sizes).
# Needs nothing installed: .venv's python when there is one, else the machine's own python3 and torch.
# Report: $$GPU_CHECK_OUT (default ./gpu_check_report)/report.{json,md}; exits 1 when a check fails.
GPU_CHECK_PY := $(if $(wildcard $(PY)),$(PY),$(PYTHON))
gpu-check:
	@$(GPU_CHECK_PY) -c "import torch" 2>/dev/null || { echo "gpu-check: $(GPU_CHECK_PY) has no torch: run 'make setup' (or install torch >= 2.11) first"; exit 1; }
	PYTHONPATH=. $(GPU_CHECK_PY) -m lightning_shardrec.gpu_check

clean:
	rm -rf $(VENV) .venv-range-* .pytest_cache .hypothesis
