"""Per-device input iterators without tf.data autotuning (the epoch-start stall whose sleeps double).

What: TensorFlow's `OwnedMultiDeviceIterator` (private, `tensorflow.python.data.ops.
multi_device_iterator_ops`), which every `tf.distribute` strategy's distributed
iterator uses on one worker, builds for each replica's device a small dataset
(`_create_device_dataset`: a generator reading that device's shard from the
host-side buffer, then `prefetch(1)`) and an ordinary `tf.data` iterator over it.
Those datasets get tf.data's default options, so each of their iterators starts
an autotuning thread (`RootDataset::Iterator`'s "tf_data_model" thread running
`model::Model::OptimizeLoop`), though such a pipeline has no tunable parameter.
We give them `tf.data.Options()` with `autotune.enabled = False`, only for
iterators of keras_replicator's strategies.

Why: destroying an iterator (Keras drops the previous epoch's iterator when it
makes the next one; a custom loop that calls `iter()` each epoch does the same)
joins that thread, and the join can wait for the thread's whole current
autotuning period. `OptimizeLoop` sleeps on a condition variable for a period
that doubles after every round (10 ms, 20 ms, ... up to a minute), and checks
`CancellationManager::IsCancelled()` when woken; `CancellationManager::StartCancel`
runs the callback that wakes it *before* it sets the cancelled flag, so a
woken thread that runs at once (likely on 2 busy cores) sees "not cancelled"
and sleeps again for the rest of the period. With one such thread per replica,
every new epoch waited 0.3-20 s in modes that double (docs/design.md,
"The stall at every epoch": the cause and the fix).

Disabling autotuning for these datasets changes nothing else: they have nothing
to tune (TF's own log says "There are no tunable parameters"), the data, its
order and the prefetch depth are the same. The host-side pipeline (the user's
dataset) has the same thread; over CPU replicas it is turned off there too,
unless the dataset's options set `autotune.enabled` (kept as given).

Checked on TF 2.21 / Keras 3.15.
"""

from __future__ import annotations

import functools
import threading

import tensorflow as tf
from tensorflow.python.data.ops import multi_device_iterator_ops
from tensorflow.python.distribute import input_lib

from keras_replicator._compat.patching import ScopedPatch, ours

_state = threading.local()
# False brings back TensorFlow's behaviour (the stall), to measure it: tests and benchmarks only.
enabled = True


def _no_autotune(dataset: tf.data.Dataset) -> tf.data.Dataset:
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def _active() -> bool:
    return enabled and getattr(_state, "depth", 0) > 0


# `PATCHES`, installed by keras_replicator._compat.install() (undone by uninstall()):
# `_create_device_dataset` (and, over CPU devices, `OwnedMultiDeviceIterator` for the
# host pipeline) disables autotuning while a keras_replicator strategy's distributed
# dataset is creating its iterators; the `__iter__` of TensorFlow's two distributed
# dataset classes marks that time, for keras_replicator's strategies only (stock
# strategies keep TF's behaviour).


def _device_dataset_without_autotune(create):
    @functools.wraps(create)
    def _create_device_dataset(*args, **kwargs):
        dataset = create(*args, **kwargs)
        return _no_autotune(dataset) if _active() else dataset

    return _create_device_dataset


# The host pipeline's iterator has the same thread. Over CPU replicas, which share the
# host's cores, its tuning buys little (a parallel map at AUTOTUNE runs one call per core;
# prefetch(AUTOTUNE) still sizes its buffer), so it is off there unless the dataset's
# options choose (measured: with only the per-device fix, 2 of 6 drops still took ~1 s
# with the machine's load average at 15).
def _host_iterator_without_autotune(init):
    @functools.wraps(init)
    def __init__(self, dataset=None, devices=None, *args, **kwargs):
        if (_active() and dataset is not None and devices
                and all((tf.DeviceSpec.from_string(d).device_type or "").upper() == "CPU"
                        for d in devices)
                and dataset.options().autotune.enabled is None):
            dataset = _no_autotune(dataset)
        init(self, dataset, devices, *args, **kwargs)

    return __init__


def _marks_iterator_creation(original):
    def __iter__(self, _original=original):
        if not ours(getattr(self, "_strategy", None)):
            return _original(self)
        _state.depth = getattr(_state, "depth", 0) + 1
        try:
            return _original(self)
        finally:
            _state.depth -= 1

    functools.update_wrapper(__iter__, original)
    return __iter__


PATCHES = (
    ScopedPatch(multi_device_iterator_ops, "_create_device_dataset", _device_dataset_without_autotune),
    ScopedPatch(multi_device_iterator_ops.OwnedMultiDeviceIterator, "__init__",
                _host_iterator_without_autotune),
    ScopedPatch(input_lib.DistributedDataset, "__iter__", _marks_iterator_creation),
    ScopedPatch(input_lib.DistributedDatasetsFromFunction, "__iter__", _marks_iterator_creation),
)
