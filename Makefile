# Two entry points that work on a fresh machine: `make demo` and `make test` (the full suite).
# `make test MCORE=0.19.2` (or `make demo MCORE=...`) does the same in .venv-mcore0.19.2 with that
# megatron-core release (built from its sdist where the running Python is older than it declares).
# `make test TESTS=versioned` runs only the tests that exercise a difference between megatron-core
# releases (tests/runtime/versioned.py). CI (.ci/run): `make test TESTS=versioned` in .venv
# (0.16.1 on Python 3.11), then the full `make test MCORE=0.19.2`. Each prints its ten slowest tests.
PYTHON ?= python3
MCORE  ?=
TESTS  ?=
ifeq ($(TESTS),)
SELECT :=
else ifeq ($(TESTS),versioned)
SELECT := -m versioned
else
$(error TESTS must be empty (the full suite) or versioned, not '$(TESTS)')
endif
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
	$(PY) -m pytest tests $(SELECT)

clean-venv:
	rm -rf $(VENV)
