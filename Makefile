# Planaria: `make serve` and `make test` each work on a fresh machine.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STATE_DIR ?= $(CURDIR)/.state
MODEL ?=
HTTP ?= 127.0.0.1:8000
ENGINES ?= 2
PARALLEL ?= ep
STAMP := $(VENV)/.installed

.PHONY: venv serve test test-all bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
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

bench: $(STAMP)
	$(BIN)/python -m bench.engine_vs_transformers

clean:
	rm -rf $(VENV) $(STATE_DIR)
