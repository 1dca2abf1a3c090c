# Two commands on a fresh machine: `make demo` and `make test`. Both bootstrap .venv themselves.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.allocator-installed
# The CPU build of torch where no CUDA driver exists (a plain `torch` requirement would pull a multi-GB CUDA build).
TORCH_CPU ?= torch==2.13.0

.PHONY: demo test test-fast install clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if ! $(PY) -c "import torch" >/dev/null 2>&1; then \
	  if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch; \
	  else $(PY) -m pip install -q "$(TORCH_CPU)"; fi; \
	fi
	$(PY) -m pip install -q -e ".[hf,plot,diffusers,dev]"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m allocator demo

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n 2 --dist worksteal

# The in-process tests only: leaves out those marked slow (about 5 s or more each) or subprocess (they start another
# process: a CLI run, a notebook kernel, distributed ranks); markers registered in pyproject.toml.
test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 -m "not slow and not subprocess"

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
