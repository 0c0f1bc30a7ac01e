# The two commands a newcomer needs: `make run` and `make test`. Both set up .venv first when needed.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# The stamp is newer than pyproject.toml once the install for it is done, so a second `make` is instant.
STAMP := $(VENV)/.installed

.PHONY: install run test bench regression lint format clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,lint]'
	touch $(STAMP)

run: install
	$(PY) recipes/finetune.py  # a new outputs/llama/DATE_TIME each time: twice in a row just works

test: install
	$(PY) -m pytest -q

bench: install
	$(PY) bench/run_all.py

# Every regression recipe (conf/experiment/regression/) against its golden curve and its tp=1 twin; plots in
# outputs/regression/. Refresh the golden files with: $(PY) tests/regression/regress.py --update-golden
regression: install
	$(PY) tests/regression/regress.py

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
