# Two commands do all set-up on a fresh machine: `make distill` and `make test`.
# torch is pinned to the CPU wheel this machine carries; an unpinned torch would pull a multi-GB CUDA build.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0

$(VENV)/.installed: setup.cfg pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e .[dev]
	touch $@

.PHONY: distill test test-fast lint
distill: $(VENV)/.installed
	$(PY) scripts/distill.py $(ARGS)

# Two pytest workers, one per core (pytest-xdist), each test file whole on one worker (its module fixtures built once).
test: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n 2 --dist loadfile tests

# The in-process tests only: no torchrun ranks, no CLI or script subprocess (those are marked slow at collection).
test-fast: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow" tests

lint: $(VENV)/.installed
	$(PY) -m ruff check .
