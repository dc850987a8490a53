# Two commands do all the set-up on a fresh machine:
#   make demo   creates .venv, installs, fetches the default embedded models, runs the main job
#   make test   creates .venv if missing, installs with test extras, runs pytest
# Torch is installed pinned first (a CPU wheel on these machines), so no multi-GB CUDA build is pulled.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: demo test install venv clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# a stamp of its own: a torch install that failed (say, the network dropped) is retried by the next make, never
# skipped, so the project's install below cannot pull an unpinned torch
$(VENV)/.torch: $(PY)
	$(PY) -m pip install --quiet $(TORCH)
	touch $@

# order-only (|): a .venv from before the stamp existed is not reinstalled for want of it
$(VENV)/.installed: pyproject.toml | $(VENV)/.torch
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

venv: $(VENV)/.torch
install: $(VENV)/.installed

demo: install
	$(VENV)/bin/cachecert demo

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
