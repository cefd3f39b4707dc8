# Two commands: `make demo` (the main job) and `make test` (the whole suite).
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test bench clean

# Re-installs only when pyproject.toml changes; creating .venv twice is harmless.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/k3 info --preset paper

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python benchmarks/kda.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .hypothesis
