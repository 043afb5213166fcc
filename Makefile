# Two entry points on a fresh machine: `make run` (serve the embedded model) and `make test`.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
# The CPU build of torch comes without Triton: this one runs the GPU kernels' tests under its interpreter.
# With a CUDA build of torch (which brings its own Triton): make test TORCH=torch TRITON=
TRITON ?= triton==3.9.0
# The embedded model with its experts in host RAM behind a small cache, so the cache view has work to show.
RUN_ARGS ?= --cpu-moe --moe-cache-mib 8
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
LINT_STAMP := $(VENV)/.installed-lint

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(if $(TRITON),$(BIN)/python -m pip install --quiet "$(TRITON)")
	touch $(TEST_STAMP)

$(LINT_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[lint]'
	touch $(LINT_STAMP)

.PHONY: install run test lint
install: $(STAMP)

run: $(STAMP)
	$(BIN)/moecache serve $(RUN_ARGS)

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q

lint: $(LINT_STAMP)
	$(BIN)/ruff check engine ops service tools tests .ci
	$(BIN)/mypy engine ops service tools
