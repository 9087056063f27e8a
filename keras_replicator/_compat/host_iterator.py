"""One host iterator for all the CPU replicas of one worker (no per-device input pipelines).

What: TensorFlow's distributed iterator on one worker (`input_lib.
_SingleWorkerOwnedDatasetIterator`, private) reads the worker's dataset through an
`OwnedMultiDeviceIterator`: a host-side buffer and, for each replica's device, a
small pipeline of its own (a generator dataset whose function borrows the next
element from the host buffer, then `prefetch(1)`) with its own iterator. For the
datasets of keras_replicator's strategies whose replicas are all CPU devices of
one worker, we make it read the same dataset through one ordinary host iterator
instead, and give replica ``i`` of a step the step's element ``i``: the
`OwnedMultiDeviceIterator` hands the elements out round-robin in the same order,
so every replica gets the same slice as before. Patched: the iterator's
`_make_iterator`, its type spec's `_component_specs` (the iterator is then a plain
`IteratorSpec` component, a path TensorFlow already has for its `PER_REPLICA`
mode), and `get_next`, `get_next_as_list`, `get_next_as_optional_list` (one read
per local replica). The distributed dataset is marked by its `InputOptions`:
`HostIteratorOptions`, equal only to itself, so that the type specs (which hold
the options) tell the two kinds of iterator apart in a `tf.function`'s cache
(`DistributedDatasetAndIteratorSpec.sanity_check_type` is patched to compare
them: TensorFlow's ignores the options, so a trace made for one kind of
iterator would be reused for the other).

Why: for devices that share the host's memory there is nothing to prefetch "to" a
device, and the per-device pipelines cost most when the iterator is made, which
`fit` does at every epoch: building and tracing a generator dataset and a
prefetching pipeline per device and starting their iterators took 1.26-1.49 s
on 4 CPU replicas of a loaded 2-core machine, against 0.19-0.42 s for one host
iterator (dropping it: 18 ms against 1 ms); per step, the reads cost 2.5 ms
against 1.0 ms. `fit` of a small CNN, one 8-step epoch at a time, went from
0.83x to 1.04x the replica-work reference (measured by hand then; docs/design.md,
"The input side"). It also has no per-device tf.data autotuning
threads, whose join stalled every epoch (`multi_device_iterator`); the host
iterator is made without autotuning unless the dataset's options ask for it.

Not used (TensorFlow's own iterator): on GPUs or other accelerators (where
prefetching each slice to its device overlaps the copy with the step), across
several workers, and when `InputOptions` are given (the way to ask for them).

Checked on TF 2.21.
"""

from __future__ import annotations

import functools

import tensorflow as tf
from tensorflow.python.distribute import input_lib

from keras_replicator._compat.patching import ScopedPatch, ours

# False: TensorFlow's multi-device iterator for every dataset (to measure the difference).
enabled = True


class HostIteratorOptions(tf.distribute.InputOptions):
    """Default `tf.distribute.InputOptions` marking a dataset read through one host iterator."""

    __slots__ = ()

    def __eq__(self, other):
        return type(other) is HostIteratorOptions and tuple.__eq__(self, other)

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        return hash((HostIteratorOptions, tuple(self)))


def _cpu(device: str) -> bool:
    return (tf.DeviceSpec.from_string(device).device_type or "").upper() == "CPU"


def options_for(strategy, options):
    """The `InputOptions` to distribute a dataset with: ``HostIteratorOptions()`` where it applies."""
    if (not enabled or not ours(strategy) or getattr(strategy, "num_workers", 1) != 1
            or options is not None):
        return options
    devices = getattr(strategy.extended, "worker_devices", ())
    if len(devices) < 2 or not all(_cpu(d) for d in devices):
        return options
    return HostIteratorOptions()


def _host(options) -> bool:
    return type(options) is HostIteratorOptions


def reads_through_host(distributed_dataset) -> bool:
    """Whether a distributed dataset's iterators read through one host iterator."""
    return _host(getattr(distributed_dataset, "_options", None))


def _no_autotune(dataset: tf.data.Dataset) -> tf.data.Dataset:
    if dataset.options().autotune.enabled is not None:
        return dataset
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def _make_iterator(original):
    @functools.wraps(original)
    def _make_iterator(self):
        if not _host(self._options):
            return original(self)
        with tf.device(self._worker):
            self._iterator = iter(_no_autotune(self._dataset))
        return None

    return _make_iterator


def _component_specs(original):
    getter = original.fget

    @functools.wraps(getter)
    def _component_specs(self):
        if not _host(self._options):
            return getter(self)
        return [tf.data.IteratorSpec(self._element_spec)]

    return property(_component_specs)


def _on_device(value, device: str):
    with tf.device(device):
        return tf.nest.map_structure(tf.identity, value, expand_composites=True)


def _read_per_replica(iterator, read):
    """`read()` once per local replica on the worker, each result moved to its replica's device."""
    with tf.device(iterator._worker):
        values = [read() for _ in iterator._devices]
    # An optional's variant moves too: its value is then read on the replica's device.
    return [_on_device(v, d) for v, d in zip(values, iterator._devices, strict=True)]


def _get_next_as_list(original):
    @functools.wraps(original)
    def get_next_as_list(self, name=None):
        if not _host(self._options):
            return original(self, name)
        return _read_per_replica(self, self._iterator.get_next)

    return get_next_as_list


def _get_next_as_optional_list(original):
    @functools.wraps(original)
    def get_next_as_optional_list(self):
        if not _host(self._options):
            return original(self)
        return _read_per_replica(self, self._iterator.get_next_as_optional)

    return get_next_as_optional_list


def _get_next(original):
    @functools.wraps(original)
    def get_next(self, device, name=None):
        if not _host(self._options):
            return original(self, device, name)
        raise NotImplementedError(
            "One device's next element is not available from a keras_replicator CPU iterator; "
            "use next(iterator) (all replicas)."
        )

    return get_next


def _sanity_check_type(original):
    """TensorFlow's check ignores the options: a trace for one kind of iterator would take the other."""

    @functools.wraps(original)
    def sanity_check_type(self, other):
        original(self, other)
        if _host(getattr(self, "_options", None)) != _host(getattr(other, "_options", None)):
            raise ValueError(f"No TypeSpec is compatible with both {self} and {other}.")

    return sanity_check_type


_ITERATOR = input_lib._SingleWorkerOwnedDatasetIterator
PATCHES = (
    ScopedPatch(_ITERATOR, "_make_iterator", _make_iterator),
    ScopedPatch(input_lib._SingleWorkerDatasetIteratorSpec, "_component_specs", _component_specs),
    ScopedPatch(_ITERATOR, "get_next_as_list", _get_next_as_list),
    ScopedPatch(_ITERATOR, "get_next_as_optional_list", _get_next_as_optional_list),
    ScopedPatch(_ITERATOR, "get_next", _get_next),
    ScopedPatch(input_lib.DistributedDatasetAndIteratorSpec, "sanity_check_type", _sanity_check_type),
)
