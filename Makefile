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
LOCK := requirements.lock
STAMP := $(VENV)/.installed
LATEST_VENV ?= .venv-latest

.PHONY: venv serve test test-all test-latest lock bench clean

# torch first with pip (it finds the CPU wheel where pip is configured for one), then the
# locked set with uv (--no-deps: the lock is the whole closure), then the project itself.
$(STAMP): pyproject.toml $(LOCK)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q uv==$(UV_VERSION)
	$(if $(TORCH),$(BIN)/pip install -q $(TORCH))
	$(BIN)/uv pip install -q --python $(BIN)/python --no-deps -r $(LOCK)
	$(BIN)/uv pip install -q --python $(BIN)/python --no-deps -e .
	$(BIN)/python -m pip check
	touch $(STAMP)

venv: $(STAMP)

serve: $(STAMP)
	@mkdir -p $(STATE_DIR)
	@if [ -z "$(MODEL)" ] && [ ! -f $(STATE_DIR)/models/tiny-moe/config.json ]; then \
		$(BIN)/planaria demo-model $(STATE_DIR)/models/tiny-moe --preset tiny-moe; fi
	$(BIN)/planaria serve --model $(if $(MODEL),$(MODEL),$(STATE_DIR)/models/tiny-moe) \
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
	$(BIN)/uv pip compile pyproject.toml --extra test --python $(BIN)/python --upgrade \
		$(LOCK_TORCH) --no-emit-package torch --no-annotate \
		--custom-compile-command 'make lock' -o $(LOCK)
	@! grep -i '^nvidia-' $(LOCK) || { echo 'make lock: the CUDA build of torch was resolved'; exit 1; }

# The suite against the newest releases (not in CI): a venv of its own, resolved afresh.
test-latest:
	test -x $(LATEST_VENV)/bin/python || $(PY) -m venv $(LATEST_VENV)
	$(if $(TORCH),$(LATEST_VENV)/bin/pip install -q $(TORCH))
	$(LATEST_VENV)/bin/pip install -q --upgrade --upgrade-strategy eager -e '.[test]'
	$(LATEST_VENV)/bin/pip freeze --exclude-editable | diff $(LOCK) - | grep '^[<>]' || true
	$(LATEST_VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m bench.engine_vs_transformers

clean:
	rm -rf $(VENV) $(LATEST_VENV) $(STATE_DIR)
