# The README's two commands are `make demo` and `make test`; each creates .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of TensorFlow unless an NVIDIA driver is present.
TF_EXTRA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
STAMP := $(VENV)/.installed-$(TF_EXTRA)

.PHONY: demo test test-versions test-versions-ci lint docs notebooks bench bench-quick bench-d4pg bench-sngan bench-peers clean

# A .venv made before the `cpu` extra installed `tensorflow` holds `tensorflow-cpu`: the same
# package under another name, sharing its files. Both names are removed first, so that the
# install leaves exactly one TensorFlow.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	if $(PY) -m pip show --quiet tensorflow-cpu >/dev/null 2>&1; then \
		$(PY) -m pip uninstall --yes --quiet tensorflow-cpu tensorflow; fi
	$(PY) -m pip install --quiet -e ".[$(TF_EXTRA),hub,test,docs,rl,ray,k8s]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP) lint
	$(PY) -m tests.run_suite

# The core subset (tests marked `core`) on every TensorFlow x Keras pair of the supported range
# (keras_replicator/versions.py PAIRS), each TensorFlow in its own venv under .venvs/ (pip's
# cache keeps a rerun fast); -ci: the oldest pair and TF 2.19.1 + Keras 3.10 only.
test-versions:
	$(PYTHON) -m tests.versions

test-versions-ci:
	$(PYTHON) -m tests.versions --ci

lint: $(STAMP)
	$(VENV)/bin/ruff check keras_replicator tests examples $(wildcard benchmarks)

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# Executes every tutorial (SMOKE=1) and writes it with its outputs to docs/tutorials/.
notebooks: $(STAMP)
	$(PY) -m tests.notebooks publish

# Speed against stock TensorFlow, one device and the replica-work reference (small CNN, ResNet-50,
# the small SN-GAN on 4 devices, all-reduce, batch norm, two workers); time to the first step
# against replicas (ResNet-50, SN-GAN on 1, 2, 4, 8); TensorFlow's CPU kernels with oneDNN off and on;
# then the asynchronous regime (2 workers + 1 ps against the synchronous strategy, with and
# without a straggler), D4PG's actors and learner, and the optimizer state sharded against
# unsharded (bytes per device, peak RSS, step time); peak RSS with and without keras.RematScope;
# model parallelism's levers (bytes per device; peak RSS, the largest model in 1 GiB per device
# and step time paired against replicated).
bench: $(STAMP)
	$(PY) -m benchmarks
	$(PY) -m benchmarks.first_step --rounds 3 --per-replica 8
	$(PY) -m benchmarks.onednn
	$(PY) benchmarks/async_throughput.py --steps 300 --json benchmarks/results/async_throughput.json
	$(PY) -m benchmarks.d4pg
	$(PY) -m benchmarks.memory
	$(PY) -m benchmarks.backup_soak --cost --json benchmarks/results/backup_cost.json
	$(PY) -m benchmarks.backup_soak --kills 50 --json benchmarks/results/backup_soak.json
	$(PY) -m benchmarks.remat_memory
	$(PY) -m benchmarks.model_parallel
	$(PY) -m benchmarks.model_parallel --pairing
	$(PY) -m benchmarks.model_parallel_budget
	$(PY) -m benchmarks.docs_tables --write

bench-quick: $(STAMP)
	$(PY) -m benchmarks --quick

# Ours against stock MirroredStrategy and Keras on JAX (benchmarks/results/peers.md): Keras on JAX
# runs from its own venv (ignored by git), with JAX and the same Keras version as .venv's.
JAX_VENV := .venvs/jax
$(JAX_VENV)/.installed-keras-%:
	test -x $(JAX_VENV)/bin/python || $(PYTHON) -m venv $(JAX_VENV)
	$(JAX_VENV)/bin/python -m pip install --quiet "jax[cpu]" "keras==$*" numpy
	touch $@

bench-peers: $(STAMP)
	$(MAKE) $(JAX_VENV)/.installed-keras-$$($(PY) -c "from importlib.metadata import version; print(version('keras'))")
	$(PY) -m benchmarks.peers

bench-d4pg: $(STAMP)
	$(PY) -m benchmarks.d4pg

# The SN-GAN large-batch study (docs/sngan_large_batch.md): global batch 32, 128, 256 on digits.
# Each run's wall time is in benchmarks/results/sngan_batch_size.md; rerunning reuses the finished
# runs in runs/sngan_batch_size.
bench-sngan: $(STAMP)
	$(PY) -m benchmarks.sngan_batch_size

clean:
	rm -rf $(VENV) .venvs site .pytest_cache
