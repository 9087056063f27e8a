# The README's two commands are `make demo` and `make test`; each creates .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of TensorFlow unless an NVIDIA driver is present.
TF_EXTRA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
STAMP := $(VENV)/.installed-$(TF_EXTRA)

.PHONY: demo test lint docs notebooks bench bench-quick bench-d4pg clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[$(TF_EXTRA),test,docs,rl]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP) lint
	$(PY) -m tests.run_suite

lint: $(STAMP)
	$(VENV)/bin/ruff check keras_replicator tests examples $(wildcard benchmarks)

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# Executes every tutorial (SMOKE=1) and writes it with its outputs to docs/tutorials/.
notebooks: $(STAMP)
	$(PY) -m tests.notebooks publish

bench: $(STAMP)
	$(PY) -m benchmarks

bench-quick: $(STAMP)
	$(PY) -m benchmarks --quick

bench-d4pg: $(STAMP)
	$(PY) -m benchmarks.d4pg

clean:
	rm -rf $(VENV) site .pytest_cache
