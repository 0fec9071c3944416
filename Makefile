# Two entry points that work on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0

.PHONY: demo test setup clean-venv

$(STAMP): setup.py constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# CPU torch first and alone, so that no dependency pulls a CUDA build.
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -c constraints.txt -e '.[test,hf]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	bash examples/layout_parity_cpu.sh
	bash examples/tiny_mixtral_cpu.sh

test: $(STAMP)
	$(PY) -m pytest tests

clean-venv:
	rm -rf $(VENV)
