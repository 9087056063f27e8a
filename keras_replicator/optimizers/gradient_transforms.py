"""Small pieces that transform gradients across replicas, each with its own state.

`CrossReplicaOptimizer` composes them, in the order of optax's chains:

* `GradientAccumulator`: sums the gradients of `k` micro-batches on each
  replica and hands out their mean every `k`-th step (optax's `MultiSteps`);
* `compress` / `decompress`: the dtype gradients travel in;
* `clip_by_global_norm`: one clipping factor for every replica (optax's
  `clip_by_global_norm`), bit-identical across replicas;
* `NonFiniteSkip`: applies an update only if the gradient is finite and counts
  the skipped ones (optax's `apply_if_finite`).

Each is usable on its own in a custom step.

Example:
    ```python
    import tensorflow as tf
    from keras_replicator.optimizers import clip_by_global_norm

    grads = [tf.constant([3.0, 4.0])]            # global norm 5
    clipped = clip_by_global_norm(grads, 1.0)   # [[0.6, 0.8]]
    ```
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import keras
import tensorflow as tf

from keras_replicator._compat import keras_backports
from keras_replicator._validation import check_int

__all__ = [
    "COMPRESSIONS",
    "GradientAccumulator",
    "NonFiniteSkip",
    "all_finite",
    "clip_by_global_norm",
    "compress",
    "decompress",
]

COMPRESSIONS = {"float16": tf.float16, "bfloat16": tf.bfloat16}


def _cast(g, dtype):
    """Casts a gradient (tensor or `IndexedSlices`) to `dtype`."""
    if g is None or g.dtype == dtype:
        return g
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(tf.cast(g.values, dtype), g.indices, g.dense_shape)
    return tf.cast(g, dtype)


def compress(grads: Sequence, compression: str | None) -> list:
    """Casts the floating-point gradients to `compression` ("float16" or "bfloat16").

    Example:
        ```python
        import tensorflow as tf
        from keras_replicator.optimizers.gradient_transforms import compress, decompress

        grads = [tf.constant([1.0, 2.0]), tf.constant([3], tf.int32)]
        wire = compress(grads, "bfloat16")       # floats in half the bytes to all-reduce; ints as they are
        back = decompress(wire, [g.dtype for g in grads])   # float32 and int32 again
        ```
    """
    if compression is None:
        return list(grads)
    wire = COMPRESSIONS[compression]
    return [_cast(g, wire) if g is not None and g.dtype.is_floating else g for g in grads]


def decompress(grads: Sequence, dtypes: Sequence[tf.DType]) -> list:
    """Casts gradients back to their own `dtypes` (after an all-reduce)."""
    return [_cast(g, d) for g, d in zip(grads, dtypes)]


def clip_by_global_norm(grads: Sequence, clip_norm) -> list:
    """`tf.clip_by_global_norm`, bit-identical on every replica.

    `tf.clip_by_global_norm` multiplies with `*`; Grappler's arithmetic
    optimizer (TF 2.21) then re-associates the chain `g * scale * learning_rate`
    of the update differently on different replicas, leaving their weights one
    float32 ulp apart. `multiply_no_nan` is not re-associated, and equals `*`
    here since the scale is never 0 (it is NaN for a non-finite norm, as in TF).

    Example:
        ```python
        clipped = clip_by_global_norm([tf.constant([3.0, 4.0])], 1.0)   # [[0.6, 0.8]]
        ```
    """
    norm = tf.linalg.global_norm(list(grads))
    scale = clip_norm * tf.minimum(1.0 / norm, 1.0 / clip_norm) + (norm - norm)

    def one(g):
        if g is None:
            return None
        if isinstance(g, tf.IndexedSlices):
            values = tf.math.multiply_no_nan(g.values, tf.cast(scale, g.dtype))
            return tf.IndexedSlices(values, g.indices, g.dense_shape)
        return tf.math.multiply_no_nan(g, tf.cast(scale, g.dtype))

    return [one(g) for g in grads]


def all_finite(grads: Sequence) -> tf.Tensor:
    """A scalar boolean: True if no gradient has a NaN or an Inf.

    Example:
        ```python
        all_finite([tf.constant([1.0, float("nan")])])   # False
        ```
    """
    checks = [
        tf.reduce_all(tf.math.is_finite(g.values if isinstance(g, tf.IndexedSlices) else g))
        for g in grads
        if g is not None
    ]
    return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)


class GradientAccumulator:
    """Sums `steps` micro-batch gradients on each replica; hands out their mean.

    One accumulator per variable, synchronised on read: each replica sums its
    own micro-batch gradients. Read across replicas (saving), the value is the
    sum; restoring divides it evenly, so a run resumed on another number of
    replicas all-reduces the same sum.

    Example:
        ```python
        import keras
        import tensorflow as tf
        from keras_replicator.optimizers.gradient_transforms import GradientAccumulator

        w = keras.Variable([0.0, 0.0])
        acc = GradientAccumulator(2)
        tracked = []
        acc.build([w], track=tracked.append)             # one zeroed accumulator per variable
        acc.add([tf.constant([1.0, 2.0])], [0])          # on every micro-batch
        acc.add([tf.constant([3.0, 4.0])], [0])
        mean = acc.take([0], [True])                     # [[2., 3.]] on every 2nd; zeroed again
        ```

    Args:
        steps: number of micro-batches per update, >= 1.
    """

    def __init__(self, steps: int):
        self.steps = check_int("accumulation_steps", steps, minimum=1)
        self.accumulators: list = []

    def build(self, var_list: Sequence, track: Callable[[keras.Variable], None]) -> None:
        """Creates one zeroed accumulator per variable, each given to `track`."""
        self.accumulators = []
        for v in var_list:
            acc = keras_backports.variable(  # keras.Variable, synchronization on Keras 3.8+
                initializer="zeros",
                shape=v.shape,
                dtype=v.dtype,
                trainable=False,
                aggregation="sum",
                synchronization="on_read",
                name=f"{getattr(v, 'path', v.name).replace('/', '_')}_accumulator",
            )
            track(acc)
            self.accumulators.append(acc)

    def is_update_step(self, micro_step: tf.Tensor) -> tf.Tensor:
        """True on the micro-step (0-based count before this one) that completes an update."""
        return tf.equal((micro_step + 1) % self.steps, 0)

    def add(self, grads: Sequence, indices: Sequence[int]) -> None:
        """Adds this replica's gradients to the accumulators at `indices`."""
        for g, i in zip(grads, indices):
            if g is not None:
                acc = self.accumulators[i]
                acc.assign_add(tf.cast(tf.convert_to_tensor(g), acc.dtype))

    def take(self, indices: Sequence[int], present: Sequence[bool]) -> list:
        """The mean gradients at `indices` (None where not `present`), then zeroes them."""
        out = []
        for i, p in zip(indices, present):
            if not p:
                out.append(None)
                continue
            acc = self.accumulators[i]
            total = tf.identity(acc.value)
            # Reset only after the read (automatic control dependencies order them).
            with tf.control_dependencies([total]):
                acc.assign(tf.zeros_like(total))
            out.append(total / self.steps)
        return out


class NonFiniteSkip:
    """Applies an update only when its gradient is finite; counts the skipped ones.

    Example:
        ```python
        import keras
        import tensorflow as tf
        from keras_replicator.optimizers.gradient_transforms import NonFiniteSkip, all_finite

        w = keras.Variable([1.0, 1.0])
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build([w])
        skip = NonFiniteSkip()
        skip.build(lambda **kw: optimizer.add_variable(**kw))
        for grads in ([tf.constant([1.0, 1.0])], [tf.constant([1.0, float("nan")])]):
            skip.apply_if_finite(all_finite(grads), lambda: optimizer.apply(grads, [w]))
        w.numpy(), int(skip.skipped_steps.numpy())       # ([0.9, 0.9], 1): the NaN step was skipped
        ```
    """

    def __init__(self):
        self.skipped_steps = None

    def build(self, add_variable: Callable[..., keras.Variable]) -> None:
        """Creates the `skipped_steps` counter with `add_variable(**spec)`."""
        self.skipped_steps = add_variable(
            shape=(), dtype="int", initializer="zeros", aggregation="only_first_replica",
            name="skipped_steps",
        )

    def count(self, finite: tf.Tensor) -> None:
        """Counts a step whose gradient was not `finite`."""
        self.skipped_steps.assign_add(tf.cast(tf.logical_not(finite), self.skipped_steps.dtype))

    def apply_if_finite(self, finite: tf.Tensor, apply: Callable[[], None]) -> None:
        """Counts the step, and runs `apply()` only if `finite`."""
        self.count(finite)
        tf.cond(finite, apply, lambda: None)
