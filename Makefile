# Two commands do everything on a fresh machine:
#   make demo   the main job (CPU demo on the tiny model, local Ray cluster)
#   make test   the test suite
# Both create .venv and install pdserve with what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# A CPU build of torch (pip's plain `torch` would pull a multi-GB CUDA build).
TORCH ?= torch==2.13.0

.PHONY: demo test install clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)" || $(BIN)/pip install -q torch --index-url https://download.pytorch.org/whl/cpu
	$(BIN)/pip install -q -e ".[dev,gpu]"
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/pdserve generate --model tiny --prompt "Hello, pdserve" --max-tokens 32 --temperature 0

test: install
	RAY_AUTH_MODE=disabled $(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) .pytest_cache
