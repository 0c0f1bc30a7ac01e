# The two commands a newcomer needs: `make run` and `make test`. Both set up .venv first when needed.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# The stamp is newer than pyproject.toml and constraints.txt once the install for them is done, so a
# second `make` is instant.
STAMP := $(VENV)/.installed
# `make run PY=python3` (any PY but the venv's) runs with an interpreter that already holds the
# dependencies, e.g. a GPU machine's image without network (docs/install.md): no .venv is made then.
DEPS := $(if $(filter $(VENV)/bin/python,$(PY)),$(STAMP))
# Bytecode caches on, even where the environment turns them off: every rank, zygote and fresh
# interpreter of the suite would otherwise recompile the project's modules (and pytest rewrite every
# test module) on each start.
export PYTHONDONTWRITEBYTECODE :=

.PHONY: help install run test test-fast test-sweeps bench regression lint format clean

help:  ## list the targets (the default)
	@awk -F ':.*## ' '/^[a-z-]+:.*## / {printf "  make %-11s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

install: $(DEPS)  ## create .venv and install the project with its test and lint extras

# The versions in constraints.txt (the tested ones, torch's CPU build here) within pyproject's ranges.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test,lint]'
	touch $(STAMP)

# ARGS: recipe overrides, e.g. make run ARGS=train.max_steps=20
run: install  ## fine-tune the tiny Llama (~1 minute on 2 CPU cores) into outputs/llama/DATE_TIME
	$(PY) recipes/finetune.py $(ARGS)  # a new outputs/llama/DATE_TIME each time: twice in a row just works

# Three pytest workers, a test file each at a time (--dist loadfile: a module's fixture runs once) on 2
# cores: with two, the cores were 94% busy (1,298 CPU-seconds in 11:30, 2026-12-04), idle while a
# worker waited (a hang being detected, a one-rank memory measurement); a third fills those waits:
# 1,150 CPU-seconds in 10:01, 1.91 cores busy. Recipe runs start from warm interpreters the workers
# share (tests/cli.py).
TEST_WORKERS ?= 3
test: install  ## the whole test suite, as CI runs it (about 10 minutes on 2 cores)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The developer's loop: unit and multi-process (gloo) tests; no recipe run through the command line.
test-fast: install  ## unit + distributed tests only (about 2 minutes)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests/unit tests/distributed

# The opt-in matrices make test samples: each parity test's further families and layouts (sweep), the
# memory model's measured peaks (memory) and the compiled blocks (compile).
test-sweeps: install  ## every parity matrix in full, beyond make test's representative cases
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m 'sweep or memory or compile'

bench: install  ## benchmarks (BENCHMARKS.md)
	$(PY) bench/run_all.py

# Every regression recipe (conf/experiment/regression/) against its golden curve and its tp=1 twin; plots in
# outputs/regression/. Refresh the golden files with: $(PY) tests/regression/regress.py --update-golden
regression: install  ## every regression recipe vs its golden curve and tp=1 twin (~1.5 minutes)
	$(PY) tests/regression/regress.py

lint: install  ## ruff check + ruff format --check + the import layers (lint-imports)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

format: install  ## apply ruff fixes and formatting
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:  ## remove .venv and caches
	rm -rf $(VENV) .pytest_cache .ruff_cache
