"""No stall when a distributed iterator is replaced: its pipelines start no tf.data autotuning thread.

Keras makes a new iterator over the distributed dataset every epoch (every `fit`
call) and drops the previous one. Under TensorFlow's defaults every tf.data
iterator of the distributed iterator (one per replica's device, and the host
pipeline's) starts an autotuning thread, and dropping the iterator joins each of
them; a join could wait for the rest of that thread's autotuning period, which
doubles with the iterator's age (0.3-20 s; docs/design.md, "The stall at every
epoch"). Without the thread there is no join, so no stall, whatever the machine's
load.

So each test records the options of every dataset that TensorFlow makes a tf.data
iterator of (`Dataset._apply_debug_options`, which `OwnedIterator` and the
multi-device iterator call on the dataset they iterate) while the distributed
iterator is made, and asserts that each has autotuning off. This is the cause, read
where TensorFlow decides it, and not a wall-clock time: an earlier version timed the
drops (a stall: over half the iterator's 2 s lifetime, or 20 times the median drop)
and failed under load without any stall (one drop took 20 times the median at a
load average of 20); the times are still measured and printed, not asserted.

Over CPU replicas, ReplicatorStrategy reads through one host iterator made without
autotuning (`_compat/host_iterator.py`); elsewhere (GPUs, non-default input options)
through TensorFlow's per-device pipelines, made without it
(`_compat/multi_device_iterator.py`): one test each. `KR_TEST_STALL_UNFIXED=1`
turns keras_replicator's fixes off in this process (TensorFlow's own iterators), to
see these tests fail (docs/design.md, "The stall at every epoch").
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from keras_replicator._compat import host_iterator, multi_device_iterator

pytestmark = pytest.mark.devices(4)

_FIXED = os.environ.get("KR_TEST_STALL_UNFIXED") != "1"


@pytest.fixture(autouse=True)
def _fix_as_configured():
    multi_device_iterator.enabled = _FIXED
    yield
    multi_device_iterator.enabled = True
    host_iterator.enabled = True


def _dataset(n: int = 256) -> tf.data.Dataset:
    x = np.arange(n * 8, dtype=np.float32).reshape(n, 8)
    y = np.arange(n, dtype=np.float32).reshape(n, 1)
    return tf.data.Dataset.from_tensor_slices((x, y))


def _iterated_autotune(distributed, monkeypatch) -> list:
    """`autotune.enabled` of every dataset TensorFlow makes a tf.data iterator of in `iter(distributed)`
    (None: TensorFlow's default, on); the first batch is read, so the pipelines have started."""
    seen = []
    original = tf.data.Dataset._apply_debug_options

    def spy(dataset):
        seen.append(dataset.options().autotune.enabled)
        return original(dataset)

    with monkeypatch.context() as patch:
        patch.setattr(tf.data.Dataset, "_apply_debug_options", spy)
        iterator = iter(distributed)
    next(iterator)
    start = time.perf_counter()
    del iterator  # the last reference: TensorFlow destroys the iterator here
    print(f"dropping the iterator took {time.perf_counter() - start:.3f} s (not asserted: load-dependent)")
    return seen


@pytest.mark.parametrize(("entry", "iterator"), [("experimental_distribute_dataset", "host"),
                                                  ("distribute_dataset", "per_device")])
def test_no_iterator_of_a_distributed_iterator_autotunes(entry, iterator, monkeypatch):
    strategy = kr.ReplicatorStrategy()
    assert strategy.num_replicas_in_sync == 4
    host_iterator.enabled = _FIXED and iterator == "host"
    if entry == "experimental_distribute_dataset":  # what Keras's fit calls
        distributed = strategy.experimental_distribute_dataset(_dataset().batch(32).repeat())
    else:
        distributed = strategy.distribute_dataset(_dataset().repeat(), global_batch_size=32)
    assert host_iterator.reads_through_host(distributed) == host_iterator.enabled
    autotune = _iterated_autotune(distributed, monkeypatch)
    # One host iterator; or the multi-device iterator's host buffer and one per replica's device.
    assert len(autotune) == (1 if host_iterator.enabled else 1 + 4), autotune
    assert autotune == [False] * len(autotune), autotune


def test_a_dataset_that_asks_for_autotuning_keeps_it(monkeypatch):
    """The fix turns off only TensorFlow's default: a dataset whose options set autotuning keeps it
    on its host pipeline (and the check above sees an autotuned iterator when there is one)."""
    strategy = kr.ReplicatorStrategy()
    options = tf.data.Options()
    options.autotune.enabled = True
    distributed = strategy.experimental_distribute_dataset(_dataset().batch(32).repeat().with_options(options))
    assert _iterated_autotune(distributed, monkeypatch) == [True]
