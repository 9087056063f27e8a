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

* column-parallel (the kernel split on an output dimension): shard j's output, its
  slice of the bias and an elementwise activation on logical device j, the parts
  concatenated on the current device for any other consumer;
* row-parallel (split on a contracted dimension): the input cut into k slices,
  shard j's partial product on device j, their `add_n`; the bias after the sum;
* a column-parallel layer's output read by a row-parallel layer split the same
  way (Megatron's MLP): the row layer takes the column layer's parts, each on its
  device, instead of cutting the concatenation, which nothing then reads and
  TensorFlow prunes from the traced step: one `add_n` forward ("g") and one sum
  of the input's gradients backward ("f") per pair, no gather between them;
* an embedding by vocabulary: ids outside shard j's rows masked to zero rows, the
  k lookups summed (Megatron's vocab-parallel embedding); by features: the k
  lookups concatenated;
* attention by heads: Q/K/V column-parallel over the heads, the attention of
  shard j's heads on device j, the output projection row-parallel (two `add_n`s
  forward per attention + MLP, as Megatron's two all-reduces).

Each function computes one layer from its `ShardedVariable` and returns `None`
when the split is one no rule covers; the caller then uses the whole tensor.

The pairing is keyed by the tensor itself: the column layer keeps its parts on
its output (an attribute, as Keras keeps a mask on a tensor), so a row layer that
reads that very tensor (the same values) takes them. In a traced step, a row
layer's input made from such outputs by elementwise ops and scalars (an
`Activation` layer, KerasHub Gemma's `gelu(gate) * up`) is made again from the
parts, op by op on each part's device (Mesh-TensorFlow's per-device ops), and
TensorFlow's autodiff differentiates those copies; anything else between the two
(dropout's mask, a normalization) and the row layer cuts the tensor as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import keras
import tensorflow as tf
from keras import ops

from keras_replicator.model_parallel.sharded_variable import ShardedVariable

__all__ = ["PAIRING", "column_parallel_einsum", "column_parts", "dense", "einsum_axis", "einsum_dense", "embedding",
           "row_parallel_einsum"]

# Whether a row-parallel layer takes the parts of the column-parallel output it reads
# (the benchmark turns it off to measure the gather it saves).
PAIRING = True
_PARTS = "_kr_column_parts"

# Activations that act on each element alone, so shard j can apply them to its part.
_ELEMENTWISE_ACTIVATIONS = frozenset(
    getattr(keras.activations, name) for name in (
        "linear", "relu", "relu6", "elu", "selu", "gelu", "silu", "swish", "sigmoid", "hard_sigmoid",
        "hard_silu", "hard_swish", "tanh", "softplus", "softsign", "exponential", "leaky_relu", "mish",
        "celu", "log_sigmoid", "squareplus", "sparse_plus", "tanh_shrink", "hard_tanh", "soft_shrink",
        "hard_shrink")
    if hasattr(keras.activations, name))


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


def _positive(axis: int, rank: int) -> int:
    return axis % rank


def _bias_parts(bias, axis: int, rank: int, k: int) -> list:
    """Part j of a bias broadcast onto an output of `rank` split in k on `axis` (the
    bias's dimensions are the output's last ones, as `Dense`'s and `EinsumDense`'s)."""
    if bias is None:
        return [None] * k
    bias_axis = len(bias.shape) - (rank - axis)
    if bias_axis < 0 or bias.shape[bias_axis] == 1:
        return [bias] * k
    if isinstance(bias, ShardedVariable) and bias.axis == bias_axis and bias.num_shards == k:
        return bias.shard_values()
    return tf.split(ops.convert_to_tensor(bias), k, axis=bias_axis)


def _column_output(parts: list, axis: int, kernel: ShardedVariable, bias, activation: Callable | None):
    """The column-parallel output: bias and activation per part on its device when the
    activation is elementwise, the parts concatenated, and kept on the result for pairing."""
    rank = parts[0].shape.rank
    if rank is None or (activation is not None and activation not in _ELEMENTWISE_ACTIVATIONS):
        return _finish(tf.concat(parts, axis=axis), bias, activation)
    axis = _positive(axis, rank)
    finished = []
    for j, (part, part_bias) in enumerate(zip(parts, _bias_parts(bias, axis, rank, kernel.num_shards))):
        with kernel.placement.ops(j):
            finished.append(_finish(part, part_bias, activation))
    y = tf.concat(finished, axis=axis)
    try:
        setattr(y, _PARTS, (tuple(finished), axis, kernel.placement))
    except AttributeError:   # a tensor type without attributes: the row layer cuts y instead
        pass
    return y


def column_parts(x, axis: int, k: int) -> list | None:
    """The k per-device parts of `x` split on `axis` as a column-parallel layer's output, or `None`.

    `x` is a column-parallel output, or (in a traced step) elementwise ops of such outputs
    split the same way and of scalars, as KerasHub Gemma's `gelu(gate) * up`: those ops are
    made again per part, on the part's device. `None` when `PAIRING` is off or anything else
    is on the way.
    """
    if not PAIRING or x.shape.rank is None:
        return None
    found = _parts(x, _positive(axis, x.shape.rank), k, x.shape.as_list(), {}, [_MAX_ELEMENTWISE_OPS])
    return None if found is None or found[1] is None else found[0]


# Elementwise ops made again per part between a column- and a row-parallel layer: each takes
# its tensors one by one (no list inputs) and, on operands of one shape, acts per element.
_ELEMENTWISE_OPS = frozenset((
    "Abs", "Add", "AddV2", "Cast", "Div", "Elu", "Erf", "Erfc", "Exp", "Identity", "LeakyRelu", "Log",
    "Log1p", "Maximum", "Minimum", "Mul", "Neg", "Pow", "RealDiv", "Relu", "Relu6", "Rsqrt", "Selu",
    "Sigmoid", "Sign", "Softplus", "Softsign", "Sqrt", "Square", "SquaredDifference", "Sub", "Tanh"))
_MAX_ELEMENTWISE_OPS = 64


def _parts(t, axis: int, k: int, shape: list, memo: dict, budget: list) -> tuple | None:
    """`(parts, placement)` of `t` (see `column_parts`), a scalar's placement `None`; `memo`
    keeps each tensor's answer (and the tensor, so its id stays its own)."""
    if id(t) not in memo:
        memo[id(t)] = (t, _find_parts(t, axis, k, shape, memo, budget))
    return memo[id(t)][1]


def _find_parts(t, axis, k, shape, memo, budget) -> tuple | None:
    entry = getattr(t, _PARTS, None)
    if entry is not None:
        parts, part_axis, placement = entry
        same_graph = all(getattr(p, "graph", None) is getattr(t, "graph", None) for p in parts)
        return (list(parts), placement) if len(parts) == k and part_axis == axis and same_graph else None
    if t.shape.rank is None:
        return None
    if t.shape.num_elements() == 1:
        return [t] * k, None                              # a scalar: read whole by every part
    if tf.executing_eagerly() or t.shape.as_list() != shape or t.op.type not in _ELEMENTWISE_OPS:
        return None
    op = t.op
    budget[0] -= 1
    if budget[0] < 0 or len(op.outputs) != 1 or any(a.number_attr or a.type_list_attr for a in op.op_def.input_arg):
        return None
    inputs = [_parts(i, axis, k, shape, memo, budget) for i in op.inputs]
    if any(i is None for i in inputs):
        return None
    placement = next((p for _, p in inputs if p is not None), None)
    if placement is None:
        return None
    inferred = {a.type_attr for a in op.op_def.input_arg}
    attrs = {a.name: op.get_attr(a.name) for a in op.op_def.attr if a.name not in inferred}
    names = [a.name for a in op.op_def.input_arg]
    parts = []
    for j in range(k):
        with placement.ops(j):
            parts.append(getattr(tf.raw_ops, op.type)(**dict(zip(names, (i[0][j] for i in inputs))), **attrs))
    return parts, placement


def _row_inputs(x, axis: int, k: int) -> list:
    """The row-parallel layer's k input slices: the column layer's parts when `x` is their
    concatenation (no gather between the pair), else `x` cut on `axis`."""
    parts = column_parts(x, axis, k)
    return parts if parts is not None else tf.split(x, k, axis=axis)


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
        return _column_output(parts, einsum_axis(out_spec, letter), kernel, bias, activation)
    if letter in x_spec:
        xs = _row_inputs(x, einsum_axis(x_spec, letter), kernel.num_shards)
        return _finish(row_parallel_einsum(equation, xs, kernel), bias, activation)
    return None


def dense(x, kernel: ShardedVariable, bias=None, activation: Callable | None = None):
    """`Dense` on a sharded kernel: column-parallel (axis 1) or row-parallel (axis 0).

    `ops.matmul`, as `Dense` itself: TensorFlow's einsum with an ellipsis made the
    step about 50 times slower than the matmul (measured on CPU).
    """
    parts = []
    xs = _row_inputs(x, -1, kernel.num_shards) if kernel.axis == 0 else [x] * kernel.num_shards
    for j, shard in enumerate(kernel.shards):
        with kernel.placement.ops(j):
            parts.append(ops.matmul(xs[j], shard.value))
    if kernel.axis == 1:
        return _column_output(parts, -1, kernel, bias, activation)
    return _finish(tf.add_n(parts), bias, activation)


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
