# Quick start: `make demo` (set up + a short real GRPO run on CPU) and `make test` (set up + the test suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	touch $(STAMP)

# SFT (true, then weak labels) -> greedy held-out accuracy -> GRPO -> the same evaluation; runs/demo/curves.png.
demo: $(STAMP)
	$(PY) -m vlm_grpo.demo --out runs/demo

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

clean:
	rm -rf $(VENV) runs
