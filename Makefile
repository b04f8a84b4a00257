# Each target installs what it needs into .venv first; re-running is quick when nothing changed.
# Versions come from uv.lock only: `uv sync --locked` refuses a lock that disagrees with pyproject.toml.
PYTHON     ?= python3.11
VENV       := .venv
PY         := $(VENV)/bin/python
HOST       ?= 127.0.0.1
PORT       ?= 7860
UV_VERSION := 0.13.9
TOOLS      := .venv-tools
UV         := $(TOOLS)/bin/uv
# The machine's Python 3.11 is the interpreter; uv never downloads one.
export UV_PYTHON_DOWNLOADS := never
# --compile-bytecode: every process the studio starts (API, workers, each trainer, doctor and server) imports
# Paddle, and without .pyc files that is 3.8 s of compiling its 1,100 modules again, every time, wherever
# bytecode is not written at import (PYTHONDONTWRITEBYTECODE, a read-only venv): 1.6 s with them.
UV_SYNC    := $(UV) sync --locked --compile-bytecode --python $(PYTHON)
# The studio's own packages, compiled the same way (only what changed; the checkout is not a venv uv owns).
BYTECODE   := $(PY) -m compileall -q -j 0 studio engine workers migrations
# The engine's native CPU ops (engine/models/cpu_ops.c), compiled once per machine with its C compiler into
# ~/.cache/ernie-studio/native (ERNIE_STUDIO_NATIVE_HOME); a no-op when that build is there.
NATIVE     := $(PY) -m engine.models.native >/dev/null

.PHONY: run test deps lint format bench install install-dev lock lock-check clean llamacpp reference

# llama.cpp (GGUF serving on CPU nodes, `serve --backend llamacpp`): llama-server, llama-quantize and
# llama-perplexity built once from the llama.cpp source the pinned llama-cpp-python sdist vendors, cached
# under ~/.cache/ernie-studio/llama.cpp (ERNIE_STUDIO_LLAMACPP_HOME); skipped when already there.
LLAMACPP_PY_VERSION := 0.3.36
llamacpp: | $(UV)
	PYTHON=$(TOOLS)/bin/python tools/build_llamacpp.sh $(LLAMACPP_PY_VERSION)

# The transformers reference environment (torch CPU + transformers, never a project dependency): built once
# under ~/.cache/ernie-studio/reference (ERNIE_STUDIO_REFERENCE_HOME); the suite reads our exports with it.
reference:
	tools/build_reference_env.sh >/dev/null

# uv itself, pinned, in a small venv of its own (pip is the one tool every Python has).
$(UV):
	test -x $(TOOLS)/bin/python || $(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install -q --disable-pip-version-check uv==$(UV_VERSION)

# --inexact keeps the dev extras when `make run` follows `make test`.
$(VENV)/.base: pyproject.toml uv.lock | $(UV)
	$(UV_SYNC) --inexact
	touch $@

$(VENV)/.dev: $(VENV)/.base
	$(UV_SYNC) --extra dev
	touch $@

install: $(VENV)/.base
install-dev: $(VENV)/.dev

# After editing dependencies in pyproject.toml: re-resolve, then commit uv.lock with the change.
lock: | $(UV)
	$(UV) lock --python $(PYTHON)

lock-check: | $(UV)
	$(UV) lock --check --python $(PYTHON)

run: $(VENV)/.base
	$(BYTECODE)
	$(NATIVE)
	$(VENV)/bin/ernie-studio up --host $(HOST) --port $(PORT)

# What `make test` needs. `.ci/run` builds it with `make -j3 deps`: llama.cpp's build keeps both cores busy for
# minutes while the two virtualenvs mostly wait on downloads, so they go side by side.
deps: lock-check $(VENV)/.dev llamacpp reference

test: deps
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(BYTECODE)
	$(NATIVE)
	ERNIE_STUDIO_REFERENCE_PYTHON="$$(tools/build_reference_env.sh)" \
	  $(PY) -m pytest -q -ra -n 2 --durations=25 $(PYTEST_ARGS)

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

format: $(VENV)/.dev
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Benchmarks compare against PaddleFormers, whose pins clash with the studio's; the lock resolves its extra
# apart (see [tool.uv] conflicts) and it gets its own venv.
.venv-bench/.installed: pyproject.toml uv.lock | $(UV)
	UV_PROJECT_ENVIRONMENT=.venv-bench $(UV_SYNC) --extra bench
	touch $@

bench: .venv-bench/.installed llamacpp
	for b in bench/bench_*.py; do .venv-bench/bin/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .venv-bench $(TOOLS) .pytest_cache
