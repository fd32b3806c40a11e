# Both entry points build (or reuse) .venv, then run.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PROTOS := $(wildcard protos/speculation/v1/*.proto)

.PHONY: demo test proto bench-controller clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# The CPU build of torch first: a bare `torch` requirement would pull the CUDA one.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/specctl demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

# Regenerate the Python code of the speculation.v1 protos (a test fails when it is stale).
proto: $(STAMP)
	$(BIN)/python -m protos.generate

bench-controller: $(STAMP)
	$(BIN)/specctl bench controller --out bench/results

clean:
	rm -rf $(VENV)
