"""No stall when a distributed iterator is replaced (issue 21).

Keras makes a new iterator over the distributed dataset every epoch (every `fit`
call) and drops the previous one. Under TensorFlow's defaults, dropping it joins
one tf.data autotuning thread per replica, and a join could wait for the rest
of that thread's autotuning period, which doubles with the iterator's age
(0.3-20 s; docs/performance.md, "The stall at every epoch"). Each test lets its
iterators live `_LIFETIME` seconds, so that a stall, when it happens, costs up
to about that long, while dropping an iterator otherwise takes milliseconds
(10-20 ms measured with the machine's load average at 10-13). The bounds are
fractions of `_LIFETIME`: generous for a shared machine, far below a stall.

`KR_TEST_STALL_UNFIXED=1` turns keras_replicator's fix off in this process, to
see these tests fail (docs/performance.md says how they did).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from keras_replicator._compat import multi_device_iterator

pytestmark = pytest.mark.devices(4)

_LIFETIME = 1.5  # seconds each iterator lives before it is dropped
_ROUNDS = 6


@pytest.fixture(autouse=True)
def _fix_as_configured():
    multi_device_iterator.enabled = os.environ.get("KR_TEST_STALL_UNFIXED") != "1"
    yield
    multi_device_iterator.enabled = True


def _dataset(n: int = 256) -> tf.data.Dataset:
    x = np.arange(n * 8, dtype=np.float32).reshape(n, 8)
    y = np.arange(n, dtype=np.float32).reshape(n, 1)
    return tf.data.Dataset.from_tensor_slices((x, y))


def _drop_times(distributed) -> list[float]:
    """Seconds taken to drop each of `_ROUNDS` iterators, each used once and kept `_LIFETIME` s."""
    times = []
    for _ in range(_ROUNDS):
        iterator = iter(distributed)
        next(iterator)
        time.sleep(_LIFETIME)
        start = time.perf_counter()
        del iterator  # the last reference: TensorFlow destroys the iterator here
        times.append(time.perf_counter() - start)
    return times


@pytest.mark.parametrize("entry", ["experimental_distribute_dataset", "distribute_dataset"])
def test_dropping_an_iterator_does_not_stall(entry):
    strategy = kr.ReplicatorStrategy()
    assert strategy.num_replicas_in_sync == 4
    if entry == "experimental_distribute_dataset":  # what Keras's fit calls
        distributed = strategy.experimental_distribute_dataset(_dataset().batch(32).repeat())
    else:
        distributed = strategy.distribute_dataset(_dataset().repeat(), global_batch_size=32)
    times = _drop_times(distributed)
    # A stall costs up to ~_LIFETIME; at most one slow drop is tolerated (the machine is shared).
    slow = [t for t in times if t > 0.2 * _LIFETIME]
    assert len(slow) <= 1, f"dropping an iterator took {[round(t, 3) for t in times]} s"

