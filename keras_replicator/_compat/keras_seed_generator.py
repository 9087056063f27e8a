"""Keras random ops under keras_replicator: every replica draws its own numbers.

Patches `keras.random.SeedGenerator.next` (keras/src/random/seed_generator.py),
scoped: active while a keras_replicator strategy's `scope()` is entered (every
`strategy.run` enters it, so every traced replica step), restored when the last
such scope exits; it acts only in a replica context of a keras_replicator
strategy with 2+ replicas. Checked on Keras 3.15.

Why: Keras 3 draws every random number with a stateless op (TensorFlow's
`stateless_*`) whose seed is `SeedGenerator.next()`: the generator's state
variable, advanced by one at each draw. Under a `tf.distribute` strategy that
state is one mirrored variable, identical on every replica, so every replica
drew the same numbers: the same dropout mask for example i of every replica's
slice, the same `Random*` augmentation, the same `GaussianNoise`. Stock
`MirroredStrategy` does the same (left so: the patch does not act for it).

How: the state advances exactly as in Keras (one increment per draw, the same on
every replica, so the mirrored state stays in sync and saves and restores as
before); only the seed handed to the op changes. Replica `r > 0` (global index:
worker offset included) gets `tf.random.experimental.stateless_fold_in(seed, r)`;
replica 0 keeps Keras's seed, so replica 0 draws what one device draws and one
replica is one device. With `keras.utils.set_random_seed` a run is reproducible.
Every path goes through `next`: `keras.random.*(seed=SeedGenerator)`, layers'
own generators (`Dropout` and relatives, `GaussianNoise`, the `Random*`
preprocessing layers), unseeded generators. Integer seeds
(`keras.random.normal(..., seed=42)`) are stateless by contract and stay the
same everywhere. `tf.data` pipelines run outside any replica context: untouched.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_replicator._compat.patching import ScopedPatch


def replica_index() -> tf.Tensor | None:
    """The global replica index in a replica context of a keras_replicator strategy
    with 2+ replicas, else None (one device, stock strategies, cross-replica code)."""
    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return None
    ctx = tf.distribute.get_replica_context()
    strategy = ctx.strategy
    if not getattr(strategy, "_keras_replicator", False) or strategy.num_replicas_in_sync < 2:
        return None
    rid = ctx.replica_id_in_sync_group
    return tf.cast(rid, tf.int32) if isinstance(rid, tf.Tensor) else tf.constant(rid, tf.int32)


def fold_replica(seed: tf.Tensor, rid: tf.Tensor) -> tf.Tensor:
    """`seed` for replica 0, `stateless_fold_in(seed, rid)` (same dtype) for the others."""
    seed = tf.convert_to_tensor(seed)
    folded = tf.cast(tf.random.experimental.stateless_fold_in(seed, rid), seed.dtype)
    return tf.where(tf.equal(rid, 0), seed, folded)


def _per_replica_seed(original):
    def next(self, ordered=True):  # noqa: A001 - Keras's name
        seed = original(self, ordered=ordered)
        rid = replica_index()
        return seed if rid is None else fold_replica(seed, rid)

    return next


PATCH = ScopedPatch(keras.random.SeedGenerator, "next", _per_replica_seed)
