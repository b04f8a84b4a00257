# Each target installs what it needs into .venv first; re-running is quick when nothing changed.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
HOST   ?= 127.0.0.1
PORT   ?= 7860

.PHONY: run test lint format bench install install-dev clean

$(VENV)/.base: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.dev: $(VENV)/.base
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.base
install-dev: $(VENV)/.dev

run: $(VENV)/.base
	$(VENV)/bin/ernie-studio up --host $(HOST) --port $(PORT)

test: $(VENV)/.dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q -ra $(PYTEST_ARGS)

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.dev
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Benchmarks compare against PaddleFormers, whose pins clash with the studio's; it gets its own venv.
.venv-bench/.installed: pyproject.toml
	test -x .venv-bench/bin/python || $(PYTHON) -m venv .venv-bench
	.venv-bench/bin/python -m pip install -q -e '.[bench]'
	touch $@

bench: .venv-bench/.installed
	for b in bench/bench_*.py; do .venv-bench/bin/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .venv-bench .pytest_cache
