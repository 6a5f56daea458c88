# Quick start: `make demo` (set up + a short real GRPO run on CPU) and `make test` (set up + the test suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo demo-tools test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	touch $(STAMP)

# SFT (true, then weak labels) -> greedy held-out accuracy -> GRPO -> the same evaluation; runs/demo/curves.png.
demo: $(STAMP)
	$(PY) -m vlm_grpo.demo --out runs/demo

# Tool trajectories -> SFT -> agentic eval -> GRPO with --tools zoom_in -> agentic eval; a learning-rate-0 control.
demo-tools: $(STAMP)
	$(PY) -m vlm_grpo.demo_tools --out runs/demo_tools --control

# Two pytest-xdist workers (CI's two cores), each taking whole test files (module fixtures are built once).
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

clean:
	rm -rf $(VENV) runs
