"""Test set-up: this pytest process simulates KR_TEST_DEVICES CPU devices (default 4).

Logical devices must be configured before TensorFlow initialises, so each device
count runs in its own pytest process (see tests/run_suite.py). A test module that
needs another count says so with ``pytestmark = pytest.mark.devices(n)``; it is
deselected (not skipped) in processes with a different count and runs in the
process for its own count.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# TensorFlow's oneDNN CPU kernels, whatever this CPU's default: TensorFlow turns them on only on
# CPUs with AVX-512 or AMX, and its own kernels are several times slower on the suite's
# convolutional tests (2026-12-07, an AVX2 EPYC: two of them 462 s off, 243 s on; ResNet-50's step
# 3.44x, benchmarks/results/onednn.md). The same kernels on every CI machine, too. Read when
# TensorFlow starts, so set before it is imported; the processes the tests start inherit it.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
# Ray's object store defaults to 30% of the machine's memory (7 GB of 24), shared memory that
# the tests' Ray instances (a few MB of weights and transitions) never need; bounded so that Ray
# beside the rest of the suite and other jobs fits the machine. Ray reads it when imported, and
# the processes the tests start (jobs, notebook kernels) inherit it.
os.environ.setdefault("RAY_DEFAULT_OBJECT_STORE_MAX_MEMORY_BYTES", str(256 * 2**20))

import keras_replicator as kr  # noqa: E402

DEFAULT_DEVICES = 4
NUM_DEVICES = int(os.environ.get("KR_TEST_DEVICES", DEFAULT_DEVICES))
kr.simulate_devices(NUM_DEVICES)


def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        marker = item.get_closest_marker("devices")
        wanted = marker.args[0] if marker else DEFAULT_DEVICES
        (keep if wanted == NUM_DEVICES else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
