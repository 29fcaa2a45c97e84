# The two commands a newcomer runs: `make demo` and `make test`. Both create or reuse .venv.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_WORKERS ?= 4
PACKAGES := contracts runtime service worker cli client

.PHONY: install demo test lint format services browser unit integration bench reference clean

# torch==2.13.0 first, so that the `worker` extra's range is already satisfied and pip never
# resolves a (multi-GB, CUDA) torch of its own.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[service,worker,dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/trainctl demo

services:
	bash scripts/services.sh

# Debian's chromium and chromium-driver for the dashboard's browser tests (tests/e2e).
browser:
	bash scripts/install_browser.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check $(PACKAGES) migrations tests bench examples scripts
	$(VENV)/bin/ruff format --check $(PACKAGES) migrations tests bench examples scripts
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy bench/*.py examples/*.py scripts/*.py

format: $(STAMP)
	$(VENV)/bin/ruff check --fix $(PACKAGES) migrations tests bench examples scripts
	$(VENV)/bin/ruff format $(PACKAGES) migrations tests bench examples scripts

unit: $(STAMP)
	$(VENV)/bin/pytest -q -n 2 tests/unit

integration: $(STAMP) services
	$(VENV)/bin/pytest -q -n $(PYTEST_WORKERS) tests/integration

test: $(STAMP) services browser lint
	$(VENV)/bin/pytest -q -n $(PYTEST_WORKERS) --durations=15 tests/unit tests/integration tests/e2e

bench: $(STAMP)
	$(PY) bench/train_throughput.py

# docs/reference/ (the workflow document, the settings, the CLI) from the code; a unit test
# fails when the committed files differ from what this writes.
reference: $(STAMP)
	PYTHONPATH=. $(PY) scripts/reference.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
