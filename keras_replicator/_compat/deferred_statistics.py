"""Moving statistics all-reduced together at the end of a step traced once.

Under a keras_replicator strategy plain `BatchNormalization`'s moving
statistics are mean-aggregated (`keras_batch_norm`), so each of their updates
all-reduces the assigned value in the forward pass: one collective per
statistic, 106 in a ResNet-50 step, each a point where every replica waits for
the others before its forward pass goes on. Here, in a step traced once
(`replica_trace`), Keras's `assign` of such a statistic writes the replica's own
value to its own copy and records it; at the end of the step every recorded
value is all-reduced in one packed collective and assigned again, so that all
replicas end the step with the mean, as before. A read of a statistic whose
reduction is pending (a layer called twice in one step) first completes every
pending reduction, so every read sees what it saw before; the values differ
from one collective per statistic at most by the order of the sum.

Not deferred: a write inside a nested graph (a `tf.cond` branch, a loop body),
which all-reduces at once as before. A read of a pending statistic inside a
nested graph raises `Undeferrable`, and the step is traced again without
deferring (a collective cannot run in a branch that not every replica takes).

What it patches, scoped to the one trace (checked on TensorFlow 2.16-2.21):
`BaseResourceVariable._read_variable_op` and `_UnreadVariable._read_variable_op`
(every dense read of a variable's copy, `value()`, `read_value()`), and
`BaseResourceVariable.sparse_read`; each acts only on a pending statistic's copy.
It reads a mirrored variable's `_get_on_device_or_primary()` (the replica's copy).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import tensorflow as tf
from tensorflow.python.framework import ops
from tensorflow.python.ops import resource_variable_ops

from keras_replicator._compat.patching import Patches, ScopedPatch


class Undeferrable(Exception):
    """A pending statistic is read where its reduction cannot run (a nested graph)."""


_state = threading.local()


@contextlib.contextmanager
def deferrable_write() -> Iterator[None]:
    """Marks the aggregation of the write made meanwhile as deferrable (Keras's `assign` of a statistic)."""
    previous = getattr(_state, "marked", False)
    _state.marked = True
    try:
        yield
    finally:
        _state.marked = previous


def take(value, aggregation, destinations):
    """The value to write now for a deferrable write in the trace (the replica's own), else None.

    Records `value` to be all-reduced by `aggregation` at the end of the step.
    """
    pending = getattr(_state, "pending", None)
    if (
        pending is None
        or not getattr(_state, "marked", False)
        or ops.get_default_graph() is not _state.graph
        or aggregation not in (tf.VariableAggregation.MEAN, tf.VariableAggregation.SUM)
        or not isinstance(value, tf.Tensor)
    ):
        return None
    copy = destinations._get_on_device_or_primary()
    pending[id(copy.handle)] = (copy, value, aggregation)
    return value


def flush() -> None:
    """All-reduces every pending statistic in one collective per aggregation, and assigns the results."""
    pending = getattr(_state, "pending", None)
    if not pending:
        return
    groups: dict = {}  # aggregation -> [(copy, value)]
    for copy, value, aggregation in pending.values():
        groups.setdefault(aggregation, []).append((copy, value))
    pending.clear()
    ctx = tf.distribute.get_replica_context()
    for aggregation, group in groups.items():
        op = tf.distribute.ReduceOp.from_variable_aggregation(aggregation)
        reduced = ctx.all_reduce(op, [value for _, value in group])
        for (copy, _), result in zip(group, reduced):
            copy.assign(tf.cast(result, copy.dtype), read_value=False)


def _flushing_first(original):
    def read(self, *args, **kwargs):
        pending = getattr(_state, "pending", None)
        if pending and id(self.handle) in pending:
            if ops.get_default_graph() is not _state.graph:
                raise Undeferrable("a moving statistic is read in a nested graph after its update")
            flush()
        return original(self, *args, **kwargs)

    return read


_READS = Patches([
    ScopedPatch(resource_variable_ops.BaseResourceVariable, "_read_variable_op", _flushing_first),
    ScopedPatch(resource_variable_ops._UnreadVariable, "_read_variable_op", _flushing_first),
    ScopedPatch(resource_variable_ops.BaseResourceVariable, "sparse_read", _flushing_first),
])


@contextlib.contextmanager
def deferring(graph, enabled: bool = True) -> Iterator[None]:
    """While the one trace's step is built in `graph`: deferrable writes are recorded (if `enabled`).

    The caller calls `flush()` in `graph` once the step is built.
    """
    previous = (getattr(_state, "graph", None), getattr(_state, "pending", None))
    _state.graph, _state.pending = (graph, {}) if enabled else (None, None)
    try:
        with _READS.scope():
            yield
    finally:
        _state.graph, _state.pending = previous
