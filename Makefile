# Two commands do everything on a fresh machine:
#   make demo   the main job: colocated vs chunked vs disaggregated serving of the tiny model on a
#               local Ray cluster (`pdserve bench compare`, a few minutes on 2 CPU cores)
#   make test   the checks (make lint), then the test suite
# Both create .venv and install pdserve with what it needs. Other targets: make lint, make format,
# make serve, make generate.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# A CPU build of torch on the dev/CI machines (plain `torch` would pull a multi-GB CUDA build);
# on a GPU machine: make TORCH=torch install
TORCH ?= torch==2.13.0
export RAY_AUTH_MODE ?= disabled

.PHONY: demo test lint format install serve generate clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev,gpu]"
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/pdserve bench compare

# ruff (lint + format check), the import contracts in pyproject.toml (layers, no cycles, no torch in
# the router process), and mypy over the packages listed under [tool.mypy]
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

test: lint
	$(BIN)/python -m pytest -q tests

serve: install
	$(BIN)/pdserve serve --mode disagg --model tiny --prefill 1 --decode 1

generate: install
	$(BIN)/pdserve generate --model tiny --prompt "Hello, pdserve" --max-tokens 32 --temperature 0

clean:
	rm -rf $(VENV) .pytest_cache
