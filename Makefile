# Two entry points: `make demo` (the main job) and `make test` (the suite CI runs).
# Both create the virtual environment on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench clean venv

venv: $(STAMP)

# torch is installed first and pinned to the CPU build that lies on disk, so
# resolving the project never pulls a CUDA build of several GB.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvpushd demo $(ARGS)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python -m bench.journal_bench
	$(BIN)/python -m bench.core_bench
	$(BIN)/python -m bench.nixl_bare
	$(BIN)/python -m bench.daemon_bench

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
