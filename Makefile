# Two entry points that work on a fresh machine: `make demo` and `make test`.
# `make test MCORE=0.19.2` (or `make demo MCORE=...`) does the same in .venv-mcore0.19.2 with that
# megatron-core release (built from its sdist where the running Python is older than it declares).
PYTHON ?= python3
MCORE  ?=
ifeq ($(MCORE),)
VENV   := .venv
else
VENV   := .venv-mcore$(MCORE)
endif
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test setup clean-venv

$(STAMP): setup.py constraints.txt tools/setup_venv.sh
	PYTHON=$(PYTHON) bash tools/setup_venv.sh $(VENV) $(MCORE)

setup: $(STAMP)

demo: $(STAMP)
	PY=$(PY) bash examples/layout_parity_cpu.sh
	PY=$(PY) bash examples/tiny_mixtral_cpu.sh

test: $(STAMP)
	$(PY) -m pytest tests

clean-venv:
	rm -rf $(VENV)
