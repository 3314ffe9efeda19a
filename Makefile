# The two commands of the README: `make demo` (the main job) and `make test` (the suite).
# Each creates .venv on first use and installs what it needs; later runs reuse it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# On these CPU machines this is a local wheel; GPU users install their own torch before `pip install -e .`
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/fourfold demo

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
