# Quick start: `make demo` (set up + a short real GRPO run on CPU) and `make test` (set up + the test suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TINY ?= runs/tiny/qwen2_5_vl

.PHONY: setup demo test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m vlm_grpo.testing.tiny --family qwen2_5_vl --out $(TINY)
	$(VENV)/bin/torchrun --nproc_per_node 1 src/vlm_grpo/grpo_jsonl.py --config configs/demo.yaml --model_name_or_path $(TINY)

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

clean:
	rm -rf $(VENV) runs
