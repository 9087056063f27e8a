"""The parallel layer rules: Megatron's splits, in TF-Replicator / Mesh-TensorFlow's form.

Inside one replica, the k logical devices are all driven by the same replica
function, so a collective among a replica's shards is an op placed with
`tf.device` (Mesh-TensorFlow's `PlacementMeshImpl`): a concat is the all-gather, an
`add_n` the all-reduce. TensorFlow's autodiff then gives Megatron's gradients for
free: Megatron's "f" (identity forward, all-reduce backward) is one tensor read by
ops on k devices, whose gradients the tape sums; its "g" (all-reduce forward,
identity backward) is the `add_n` of the shards' partial results, whose gradient
is the identity to each part. (`kr.all_reduce` would be wrong there: its gradient
is an all-reduce, a k-fold over-count.)

* column-parallel (the kernel split on an output dimension): shard j's output on
  logical device j, concatenated on the current device; the bias after;
* row-parallel (split on a contracted dimension): the input cut into k slices,
  shard j's partial product on device j, their `add_n`; the bias after the sum;
* an embedding by vocabulary: ids outside shard j's rows masked to zero rows, the
  k lookups summed (Megatron's vocab-parallel embedding); by features: the k
  lookups concatenated;
* attention by heads: Q/K/V column-parallel over the heads, the attention of
  shard j's heads on device j, the output projection row-parallel (two `add_n`s
  forward per attention + MLP, as Megatron's two all-reduces).

Each function computes one layer from its `ShardedVariable` and returns `None`
when the split is one no rule covers; the caller then uses the whole tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tensorflow as tf
from keras import ops

from keras_replicator.model_parallel.sharded_variable import ShardedVariable

__all__ = ["column_parallel_einsum", "dense", "einsum_axis", "einsum_dense", "embedding",
           "row_parallel_einsum"]


def einsum_axis(spec: str, letter: str) -> int:
    """The axis of `letter` in an einsum operand `spec`, negative after an ellipsis."""
    if "..." in spec:
        before, after = spec.split("...")
        if letter in before:
            return before.index(letter)
        return after.index(letter) - len(after)
    return spec.index(letter)


def _parse(equation: str) -> tuple[str, str, str]:
    inputs, output = equation.replace(" ", "").split("->")
    x_spec, kernel_spec = inputs.split(",")
    return x_spec, kernel_spec, output


def column_parallel_einsum(equation: str, x, kernel: ShardedVariable) -> list:
    """Shard j's `einsum(equation, x, kernel_j)` on logical device j (x read by all: "f")."""
    parts = []
    for j, shard in enumerate(kernel.shards):
        with kernel.placement.ops(j):
            parts.append(ops.einsum(equation, x, shard.value))
    return parts


def row_parallel_einsum(equation: str, xs: Sequence, kernel: ShardedVariable):
    """The `add_n` ("g") of shard j's `einsum(equation, xs[j], kernel_j)`, each on device j."""
    parts = []
    for j, shard in enumerate(kernel.shards):
        with kernel.placement.ops(j):
            parts.append(ops.einsum(equation, xs[j], shard.value))
    return tf.add_n(parts)


def _finish(y, bias, activation: Callable | None):
    if bias is not None:
        y = ops.add(y, bias)
    return activation(y) if activation is not None else y


def einsum_dense(equation: str, x, kernel: ShardedVariable, bias=None,
                 activation: Callable | None = None):
    """`EinsumDense` on a sharded kernel: column- or row-parallel by the split letter.

    Returns `None` when the kernel's split dimension is in neither the input nor the
    output (no rule: use the whole kernel).
    """
    x_spec, kernel_spec, out_spec = _parse(equation)
    letter = kernel_spec[kernel.axis]
    if letter in out_spec:
        parts = column_parallel_einsum(equation, x, kernel)
        y = tf.concat(parts, axis=einsum_axis(out_spec, letter))
    elif letter in x_spec:
        xs = tf.split(x, kernel.num_shards, axis=einsum_axis(x_spec, letter))
        y = row_parallel_einsum(equation, xs, kernel)
    else:
        return None
    return _finish(y, bias, activation)


def dense(x, kernel: ShardedVariable, bias=None, activation: Callable | None = None):
    """`Dense` on a sharded kernel: column-parallel (axis 1) or row-parallel (axis 0).

    `ops.matmul`, as `Dense` itself: TensorFlow's einsum with an ellipsis made the
    step about 50 times slower than the matmul (measured on CPU).
    """
    parts = []
    xs = tf.split(x, kernel.num_shards, axis=-1) if kernel.axis == 0 else [x] * kernel.num_shards
    for j, shard in enumerate(kernel.shards):
        with kernel.placement.ops(j):
            parts.append(ops.matmul(xs[j], shard.value))
    y = tf.concat(parts, axis=-1) if kernel.axis == 1 else tf.add_n(parts)
    return _finish(y, bias, activation)


def embedding(ids, table: ShardedVariable, dtype: str):
    """`Embedding` on a sharded table: by vocabulary (axis 0) or by features (axis 1)."""
    if ids.dtype not in ("int32", "int64", tf.int32, tf.int64):
        ids = ops.cast(ids, "int32")
    parts = []
    if table.axis == 1:
        for j, shard in enumerate(table.shards):
            with table.placement.ops(j):
                parts.append(ops.take(shard.value, ids, axis=0))
        return ops.cast(ops.concatenate(parts, axis=-1), dtype)
    rows = table.shape[0] // table.num_shards
    for j, shard in enumerate(table.shards):
        with table.placement.ops(j):
            local = ops.subtract(ids, ops.cast(j * rows, ids.dtype))
            inside = ops.logical_and(ops.greater_equal(local, 0), ops.less(local, rows))
            found = ops.take(shard.value, ops.where(inside, local, ops.zeros_like(local)), axis=0)
            parts.append(ops.where(ops.expand_dims(inside, -1), found, ops.zeros_like(found)))
    return ops.cast(tf.add_n(parts), dtype)
