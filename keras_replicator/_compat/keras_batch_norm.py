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
"""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_replicator._compat import patching
from keras_replicator._compat.patching import ScopedPatch, ours


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
        return original(self, *args, **kwargs)

    return add_weight


# What the patch relies on: `build` makes the moving statistics through `self.add_weight`.
BUILD_ADDS_STATISTICS = patching.calls(
    "keras BatchNormalization.build (makes moving_mean, moving_variance with self.add_weight)",
    lambda: keras.layers.BatchNormalization.build, "add_weight", "moving_mean", "moving_variance")

PATCH = ScopedPatch(keras.layers.BatchNormalization, "add_weight", _mean_aggregated_statistics,
                    guards=[BUILD_ADDS_STATISTICS])
