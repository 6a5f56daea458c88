# Quick start: `make demo` (set up + a short real GRPO run on CPU) and `make test` (set up + the test suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo demo-tools test lint docs mutants clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
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

# Mutation testing (mutmut; not part of `make test`): plants small bugs in the modules listed under
# [tool.mutmut] in pyproject.toml, runs their fast tests against each, prints the score and the survivors
# that tests/mutants_equivalent.md does not explain. See docs/development/testing.md.
MUTANT_WORKERS ?= 2

mutants: $(STAMP)
	rm -rf mutants
	$(PY) -m vlm_grpo.testing.tiny --family all --out mutants/tiny
	VLM_GRPO_TINY_MODELS=$(CURDIR)/mutants/tiny OMP_NUM_THREADS=1 $(VENV)/bin/mutmut run --max-children $(MUTANT_WORKERS)
	$(PY) tests/mutation_score.py

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks docs
	$(VENV)/bin/ruff format --check src tests benchmarks docs

# The docs site (docs/, mkdocs.yml) into build/site, offline; warnings are errors. Reference pages are generated.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

clean:
	rm -rf $(VENV) runs mutants
