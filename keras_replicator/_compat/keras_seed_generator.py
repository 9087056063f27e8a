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
Keras's global generator (`seed=None`) is per thread and created on first use,
which a traced replica step (one thread per replica) cannot do, with or without
this patch: layers own a `SeedGenerator`, as Keras's do.

`AsyncReplicatorStrategy` (parameter servers): the state lives on a parameter
server, read and advanced by whichever worker runs a step; steps of two workers
that read it at the same moment drew the same numbers. While its step function
is traced (`folded_with_worker`, from `parameter_server`), each draw advances
the state with one atomic `AssignAddVariableOp` (reads `SeedGenerator.state`'s
TensorFlow variable, `_value`) and its seed is folded with a key of the worker
running the step (`experimental_get_current_worker_index`, as a replica index:
worker 0 keeps Keras's seed), so draws differ across workers, and within a
worker (whose steps run one at a time) the counter only grows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import keras
import tensorflow as tf
from keras.src.backend.tensorflow import random as tf_random
from keras.src.random import seed_generator

from keras_replicator._compat import patching
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
    # int32, as Keras's TensorFlow backend makes its seeds (XLA takes no int64 seed).
    seed32 = seed if seed.dtype == tf.int32 else tf.cast(tf.math.floormod(seed, tf.int32.max - 1), tf.int32)
    folded = tf.cast(tf.random.experimental.stateless_fold_in(seed32, rid), seed.dtype)
    return tf.where(tf.equal(rid, 0), seed, folded)


class _Worker:
    # Not thread-local: TensorFlow traces the step's replica function in a thread of its own
    # (mirrored_run), and the chief traces one step function at a time.
    key: tf.Tensor | None = None


_worker = _Worker()


@contextlib.contextmanager
def folded_with_worker(worker: tf.Tensor) -> Iterator[None]:
    """While a parameter-server step is traced: draws fold in `worker`, the index of the
    worker running the step (a value bound when the step runs)."""
    _worker.key = tf.cast(worker, tf.int32)
    applied = PATCH.applied
    PATCH.apply()
    try:
        yield
    finally:
        _worker.key = None
        if not applied:
            PATCH.restore()


def _atomic_next(self, ordered: bool) -> tf.Tensor:
    """Keras's `next`, with the ordered increment as one atomic add on the variable."""
    if not ordered:
        return None
    increment = tf.constant([0, 1], self.state.dtype)
    return self.state._value.assign_add(increment, read_value=True) - increment


def _per_replica_seed(original):
    def next(self, ordered=True):  # noqa: A001 - Keras's name
        key = _worker.key
        if key is not None:
            seed = _atomic_next(self, ordered)
            seed = original(self, ordered=ordered) if seed is None else seed
            return fold_replica(seed, key)
        seed = original(self, ordered=ordered)
        rid = replica_index()
        return seed if rid is None else fold_replica(seed, rid)

    return next


# What the patch relies on: every random op of the TensorFlow backend draws its seed with
# `draw_seed`, which calls the generator's `next` (patched). A draw that bypassed it would
# give every replica the same mask, without an error.
_DRAWS = [
    patching.calls("keras random.seed_generator.draw_seed (calls SeedGenerator.next)",
                   lambda: seed_generator.draw_seed, "next"),
    *(patching.calls(f"keras backend.tensorflow.random.{name} (calls draw_seed)",
                     lambda name=name: getattr(tf_random, name), "draw_seed")
      for name in ("dropout", "normal", "uniform", "truncated_normal", "randint")),
]

PATCH = ScopedPatch(keras.random.SeedGenerator, "next", _per_replica_seed, guards=_DRAWS)
