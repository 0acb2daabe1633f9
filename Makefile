# make demo  : set up .venv (first time only) and run the main job
# make test  : set up .venv (first time only) and run the fast tests
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.moaspec-setup
PROMPT ?= Write a Python function that reverses a string.

.PHONY: setup demo test test-slow lint

setup: $(STAMP)

# Re-runs only when pyproject.toml changes; the model is converted once into ~/.cache/moaspec.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -e ".[dev]"
	$(BIN)/moaspec models install smollm2-135m
	touch $@

demo: setup
	$(BIN)/moaspec generate --prompt "$(PROMPT)" --max-new-tokens 128

test: setup
	$(BIN)/pytest -q

test-slow: setup
	$(BIN)/moaspec models install qwen2.5-coder-0.5b
	$(BIN)/pytest -q -m slow

lint: setup
	$(BIN)/ruff check src tests
