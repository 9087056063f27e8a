"""Plain Keras `BatchNormalization` under keras_replicator: identical moving statistics.

Patches `keras.layers.BatchNormalization.add_weight` (checked on Keras 3.15),
scoped: active only while a keras_replicator strategy's `scope()` is entered
(where models are built, and around every `strategy.run`, where lazily built
layers create their weights), restored when the last such scope exits.

Why: Keras 3 creates `BatchNormalization`'s moving statistics (and its renorm
statistics) with `add_weight(trainable=False)`, i.e. `aggregation="none"`,
and updates them in each replica with that replica's local batch statistics, so
under a strategy every replica ends with its own moving statistics and the
checkpoint keeps replica 0's. Created under a keras_replicator strategy with 2+
replicas, these weights instead get `aggregation="mean"`: each update is
averaged across replicas (TensorFlow all-reduces the assigned value), so the
moving statistics track the average of the replicas' local statistics and are
the same everywhere. Training-time normalization is untouched (local
statistics, as Keras documents). Layers with `synchronized=True` need no help
(their statistics are all-reduced) and are left alone.

In a step run from a `short_batches.PaddedBatch` (a batch with fewer rows than
replicas, or split unevenly), each replica's update of these statistics is
weighted by its real rows: `KerasVariable.assign` (scoped too) turns a marked
statistic's new value ``v`` into ``old + (v - old) * rows * N / total``, so the
mean over the N replicas is the average of the replicas' values weighted by
``rows / total``: a padding replica (0 rows) contributes nothing, and a replica
with k of the batch's n rows counts k / n, as its rows would on one device.
Even slices (weight 1) keep ``v`` itself, bit for bit.

In a step traced once the assignment's all-reduce is deferred to the step's end,
together with the step's other statistics (`deferred_statistics`).
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras.src.backend.common import variables as keras_variables

from keras_replicator._compat import deferred_statistics, patching, short_batches
from keras_replicator._compat.patching import ScopedPatch, ours

#: Set on the moving statistics this module made mean-aggregated (weighted by rows in padded steps).
_MARK = "_keras_replicator_row_weighted"


def _replicating() -> bool:
    """True under a keras_replicator strategy scope with more than one replica."""
    if not tf.distribute.has_strategy():
        return False
    strategy = tf.distribute.get_strategy()
    return ours(strategy) and strategy.num_replicas_in_sync > 1


def _mean_aggregated_statistics(original):
    def add_weight(self, *args, **kwargs):
        if (
            kwargs.get("trainable", True) is False
            and kwargs.get("aggregation", "none") in (None, "none")
            and not getattr(self, "synchronized", False)
            and _replicating()
        ):
            kwargs["aggregation"] = "mean"
            variable = original(self, *args, **kwargs)
            setattr(variable, _MARK, True)
            return variable
        return original(self, *args, **kwargs)

    return add_weight


# What the patch relies on: `build` makes the moving statistics through `self.add_weight`.
BUILD_ADDS_STATISTICS = patching.calls(
    "keras BatchNormalization.build (makes moving_mean, moving_variance with self.add_weight)",
    lambda: keras.layers.BatchNormalization.build, "add_weight", "moving_mean", "moving_variance")

PATCH = ScopedPatch(keras.layers.BatchNormalization, "add_weight", _mean_aggregated_statistics,
                    guards=[BUILD_ADDS_STATISTICS])


def _row_weighted_assign(original):
    """`KerasVariable.assign`. Why: see the module (a padded step's statistics weighted by rows)."""

    def assign(self, value):
        if not getattr(self, _MARK, False):
            return original(self, value)
        scale = replica_weight()
        if scale is not None:
            old = tf.convert_to_tensor(self.value)
            value = tf.convert_to_tensor(value, dtype=old.dtype)
            scale = tf.cast(scale, old.dtype)
            value = tf.where(tf.equal(scale, 1), value, old + (value - old) * scale)
        # In a step traced once, all-reduced with the step's other statistics at its end.
        with deferred_statistics.deferrable_write():
            return original(self, value)

    return assign


def replica_weight():
    """``rows * N / total`` of the replica in a padded step of more than one replica, else None."""
    if not _replicating() or tf.distribute.get_replica_context() is None:
        return None
    return short_batches.replica_loss_scale(tf.float64)


ROW_WEIGHTED_ASSIGN = ScopedPatch(keras_variables.Variable, "assign", _row_weighted_assign,
                                  guards=[patching.calls("keras BatchNormalization.call (assigns moving_mean)",
                                                         lambda: keras.layers.BatchNormalization.call,
                                                         "assign", "moving_mean", "moving_variance")])
