"""Test set-up: this pytest process simulates KR_TEST_DEVICES CPU devices (default 4).

Logical devices must be configured before TensorFlow initialises, so each device
count runs in its own pytest process (see tests/run_suite.py). A test module that
needs another count says so with ``pytestmark = pytest.mark.devices(n)``; it is
deselected (not skipped) in processes with a different count and runs in the
process for its own count.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

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
