"""The batch-norm kernels: cross-replica statistics and the normalization, in TensorFlow ops.

The layers in `keras_replicator.layers.batch_normalization` only wire these up
(as Keras's layers wire up math that lives in ``keras.ops``).

How the statistics are computed: each replica reduces its slice to
``[count, mean, M2]`` per channel (``M2`` = sum of squared deviations from the
*local* mean), the replicas exchange these in **one** collective (an
all-reduce of a ``[replicas, 3, channels]`` tensor in which each replica fills
its own row: an exact all-gather), and every replica combines them with the
parallel-variance formula of Chan, Golub and LeVeque (1979)::

    N = sum(n_r);  mean = sum(n_r * mean_r) / N
    M2 = sum(M2_r) + sum(n_r * (mean_r - mean)**2);  variance = M2 / N

No quantity of the size of ``E[x^2]`` is ever formed, so there is no
catastrophic cancellation. Statistics are computed in float32 when the
layer runs in float16 or bfloat16 (float64 for float64 inputs).

In training mode the gradient is batch norm's closed form (one more
collective, of ``[2, channels]``), and with the features axis last both passes
run TensorFlow's fused batch-norm kernels; a gradient that is itself
differentiated (a gradient penalty) falls back to automatic differentiation of
the plain computation, exact to every order.

Every replica combines the same gathered numbers in the same order, so the
moving statistics are bit-identical on every replica without a second
collective. Under grouped normalization (``group_size``) each group normalizes
with its own statistics, and the moving-statistics update is the count-weighted
average of the group statistics (the global mean and the pooled within-group
variance), the same on every replica.
"""

from __future__ import annotations

import math

import tensorflow as tf

from keras_replicator import collectives
from keras_replicator._compat.all_reduce_gradient import gradient_tape_recording


def _stats_dtype(dtype: tf.DType) -> tf.DType:
    """float32 for float16/bfloat16/float32 inputs, float64 for float64."""
    return tf.float64 if dtype == tf.float64 else tf.float32


def _staged_sum(t: tf.Tensor, axes: list[int]) -> tf.Tensor:
    """Sum over ``axes`` (the batch axis 0 and the other non-feature axes): ``[C]``.

    TensorFlow's CPU reductions over leading axes accumulate in one running sum
    per channel, whose float32 rounding error grows with the number of terms
    (a 1% error on a million terms of equal sign). Summing first over the
    non-batch axes and then over the batch bounds each run by the larger of
    the two sizes instead of their product.
    """
    inner = [a for a in axes if a != 0]
    if inner:
        t = tf.reduce_sum(t, inner)  # [batch, C]
    return tf.reduce_sum(t, 0)


def _local_moments(
    x: tf.Tensor, axis: int, mask: tf.Tensor | None
) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """This replica's ``(count, mean, M2)`` per channel.

    ``M2`` is the sum of squared deviations from the local mean; ``count`` is a
    scalar without a mask. Sums are taken of ``x - K`` with ``K`` the first
    example's mean (shifted data), so their size is set by the spread of
    ``x``, not by its mean. A replica with no (unmasked) example contributes
    count 0, mean 0 and M2 0.
    """
    axes = [a for a in range(x.shape.rank) if a != axis]
    inner = [a for a in axes if a != 0]
    first = x[:1]
    if mask is None:
        weights = None
        sizes = [x.shape[a] for a in inner]
        if None in sizes:
            per_example = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), inner)), x.dtype)
        else:
            per_example = tf.constant(float(math.prod(sizes)), x.dtype)
        count = tf.cast(tf.shape(x)[0], x.dtype) * per_example
        shift = tf.math.divide_no_nan(tf.reduce_sum(first, axes, keepdims=True), per_example)
    else:
        weights = tf.broadcast_to(tf.expand_dims(tf.cast(mask, x.dtype), axis), tf.shape(x))
        count = _staged_sum(weights, axes)
        first_weights = weights[:1]
        shift = tf.math.divide_no_nan(
            tf.reduce_sum(first_weights * first, axes, keepdims=True),
            tf.reduce_sum(first_weights, axes, keepdims=True),
        )
    # The result does not depend on the shift, so neither does its gradient.
    shift = tf.stop_gradient(shift)
    shifted = x - shift
    if weights is not None:
        shifted = weights * shifted
    total = _staged_sum(shifted, axes)
    squares = _staged_sum(tf.square(shifted), axes)
    mean_shift = tf.math.divide_no_nan(total, count)
    mean = tf.reshape(shift, [-1]) + mean_shift
    return count, mean, squares - total * mean_shift


def _weighted_mean(values: tf.Tensor, weights: tf.Tensor, axis: int) -> tf.Tensor:
    """``sum(weights * values) / sum(weights)`` along ``axis`` (0 if all weights are 0)."""
    return tf.math.divide_no_nan(
        tf.reduce_sum(weights * values, axis), tf.reduce_sum(weights, axis)
    )


def _combine(stats: tf.Tensor, axis: int) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Parallel-variance combination of ``[count, mean, M2]`` rows along ``axis``.

    ``stats`` has shape ``[..., 3, channels]`` with the parts to combine along
    ``axis``; returns ``(count, mean, variance)`` with that axis removed.
    """
    count, mean, m2 = tf.unstack(stats, num=3, axis=-2)
    total = tf.reduce_sum(count, axis)
    combined_mean = tf.math.divide_no_nan(tf.reduce_sum(count * mean, axis), total)
    spread = count * tf.square(mean - tf.expand_dims(combined_mean, axis))
    combined_m2 = tf.reduce_sum(m2 + spread, axis)
    return total, combined_mean, tf.math.divide_no_nan(combined_m2, total)


def _gather_rows(local: tf.Tensor, group_size: int | None) -> tf.Tensor:
    """Every replica's ``local``, bit for bit, as ``[groups, replicas per group, ...]``.

    One all-reduce: each replica contributes its own row and zeros elsewhere,
    and ``x + 0`` is exact (a TensorFlow all-gather would take two collectives).
    """
    num_replicas = collectives.replicas_in_step()
    rid = collectives.replica_id()
    padding = [[rid, num_replicas - 1 - rid]] + [[0, 0]] * local.shape.rank
    gathered = collectives.all_reduce(tf.pad(local[tf.newaxis], padding))
    size = group_size or num_replicas
    return tf.reshape(gathered, [num_replicas // size, size, *local.shape])


def _group_sum(local: tf.Tensor, group_size: int | None) -> tf.Tensor:
    """Sum of ``local`` over this replica's group (all replicas without groups)."""
    num_replicas = collectives.replicas_in_step()
    if num_replicas == 1:
        return local
    if group_size is None or group_size == num_replicas:
        return collectives.all_reduce(local)
    rows = _gather_rows(local, group_size)
    return tf.reduce_sum(rows, 1)[collectives.replica_id() // group_size]


def _group_statistics(
    count: tf.Tensor, mean: tf.Tensor, m2: tf.Tensor, group_size: int | None
) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
    """Combines every replica's ``(count, mean, M2)`` in one collective.

    Returns ``(group_count, mean, variance, moving_mean_update,
    moving_variance_update)``: the first three are this replica's group
    statistics (used to normalize), the last two the count-weighted average
    over groups (used for the moving averages; equal to the group statistics
    without groups). Every replica computes the last two from the same
    numbers in the same order, so they are bit-identical across replicas.
    """
    num_replicas = collectives.replicas_in_step()
    if num_replicas == 1:
        # max(0, .): rounding can take M2 of a constant channel a hair below 0.
        variance = tf.maximum(tf.math.divide_no_nan(m2, count), 0.0)
        return count, mean, variance, mean, variance
    collectives.check_group_size(group_size, num_replicas)
    local = tf.stack([tf.broadcast_to(count, tf.shape(m2)), mean, m2])  # [3, C]
    # [groups, replicas per group, (count, mean, M2), channels]
    grouped = _gather_rows(local, group_size)
    if grouped.shape[0] == 1:
        total, mean, variance = _combine(grouped[0], 0)
        variance = tf.maximum(variance, 0.0)
        return total, mean, variance, mean, variance
    counts, means, variances = _combine(grouped, 1)  # [groups, C] each
    variances = tf.maximum(variances, 0.0)
    own = collectives.replica_id() // (group_size or num_replicas)
    pooled_mean = _weighted_mean(means, counts, 0)
    pooled_variance = _weighted_mean(variances, counts, 0)
    return (tf.gather(counts, own), tf.gather(means, own), tf.gather(variances, own),
            pooled_mean, pooled_variance)


def _global_moments(
    x: tf.Tensor, axis: int, mask: tf.Tensor | None, group_size: int | None
) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
    """Normalization and moving-average statistics from one collective.

    Returns ``(mean, variance, moving_mean_update, moving_variance_update)``
    (see ``_group_statistics``); differentiable by automatic differentiation.
    """
    count, mean, m2 = _local_moments(x, axis, mask)
    return _group_statistics(count, mean, m2, group_size)[1:]


# Below this many elements per replica, separate ops beat the fused kernel, whose
# fixed cost is ~0.3 ms on CPU (measured, TF 2.21 oneDNN: [16, 1, 1, 2048] 0.40 ms
# fused vs 0.22 ms plain for forward and backward; [16, 4, 4, 512] 0.44 vs 0.54;
# [32, 32, 32, 32] 0.71 vs 2.31).
_FUSED_MIN_ELEMENTS = 2**17


def _use_fused_kernel(x: tf.Tensor, axis: int) -> bool:
    """Float32, features last, and large enough for the fused kernel to pay."""
    if x.dtype != tf.float32 or axis != x.shape.rank - 1:
        return False
    size = x.shape.num_elements()
    if size is None:  # batch size unknown when tracing: judge by one example
        size = 32 * (x.shape[1:].num_elements() or 0)
    return size >= _FUSED_MIN_ELEMENTS


def _affine_normalize(
    x: tf.Tensor,
    mean: tf.Tensor,
    variance: tf.Tensor,
    scale: tf.Tensor,
    offset: tf.Tensor,
    axis: int,
    epsilon: float,
) -> tf.Tensor:
    """``scale * (x - mean) / sqrt(variance + epsilon) + offset``, per channel.

    With the features axis last, float32 inputs and at least
    ``_FUSED_MIN_ELEMENTS`` elements this is TensorFlow's fused batch-norm
    kernel in inference mode (oneDNN or Eigen on CPU, its own kernel on GPU):
    one pass over ``x`` instead of three, measured up to three times as fast on
    CPU, and ``x - mean`` is formed first as in the plain expression, so it is
    as accurate on inputs whose mean is large against their spread.
    """
    rank = x.shape.rank
    if _use_fused_kernel(x, axis):
        channels = x.shape[axis]
        x4 = x if rank == 4 else tf.reshape(x, [-1, 1, 1, channels])
        y = tf.raw_ops.FusedBatchNormV3(
            x=x4, scale=scale, offset=offset, mean=mean, variance=variance,
            epsilon=epsilon, exponential_avg_factor=1.0, data_format="NHWC", is_training=False,
        )[0]
        return y if rank == 4 else tf.reshape(y, tf.shape(x))
    return _plain_affine_normalize(x, mean, variance, scale, offset, axis, epsilon)


def _plain_affine_normalize(x, mean, variance, scale, offset, axis, epsilon) -> tf.Tensor:
    """``_affine_normalize`` in plain ops: differentiable in every argument, to any order."""
    shape = _broadcast_shape(x.shape.rank, axis)
    inv = tf.math.rsqrt(variance + tf.cast(epsilon, x.dtype))
    return (x - tf.reshape(mean, shape)) * tf.reshape(scale * inv, shape) + tf.reshape(offset, shape)


def _affine_normalize_grad(
    dy: tf.Tensor,
    x: tf.Tensor,
    mean: tf.Tensor,
    variance: tf.Tensor,
    scale: tf.Tensor,
    axis: int,
    epsilon: float,
) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Gradient of ``_affine_normalize`` with ``mean`` and ``variance`` held fixed.

    Returns ``(scale * inv * dy, sum(dy * xhat), sum(dy))`` with
    ``inv = 1 / sqrt(variance + epsilon)`` and ``xhat = (x - mean) * inv``,
    the sums per channel over this replica's slice. Fused kernel where
    ``_affine_normalize`` uses one.
    """
    rank = x.shape.rank
    if _use_fused_kernel(x, axis):
        channels = x.shape[axis]
        dy4, x4 = (t if rank == 4 else tf.reshape(t, [-1, 1, 1, channels]) for t in (dy, x))
        dx, dscale, doffset = tf.raw_ops.FusedBatchNormGradV3(
            y_backprop=dy4, x=x4, scale=scale, reserve_space_1=mean, reserve_space_2=variance,
            reserve_space_3=tf.zeros([0], tf.float32), epsilon=epsilon, data_format="NHWC",
            is_training=False,
        )[:3]
        return (dx if rank == 4 else tf.reshape(dx, tf.shape(dy))), dscale, doffset
    axes = [a for a in range(rank) if a != axis]
    shape = _broadcast_shape(rank, axis)
    inv = tf.math.rsqrt(variance + tf.cast(epsilon, x.dtype))
    doffset = _staged_sum(dy, axes)
    dscale = inv * _staged_sum(dy * (x - tf.reshape(mean, shape)), axes)
    return dy * tf.reshape(scale * inv, shape), dscale, doffset


def _train_normalize(
    x: tf.Tensor,
    gamma: tf.Tensor,
    beta: tf.Tensor,
    axis: int,
    group_size: int | None,
    epsilon: float,
) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Training-mode ``gamma * (x - mean) / sqrt(variance + epsilon) + beta``.

    Returns ``(outputs, moving_mean_update, moving_variance_update)``. The
    gradient is the closed form of batch norm's (as in fused kernels and
    PyTorch's SyncBatchNorm) rather than automatic differentiation through the
    statistics: with ``xhat`` the normalized input, ``inv = 1 / sqrt(var +
    eps)`` and ``N`` the group's count,

        dx = gamma * inv * (dy - sum_g(dy) / N - xhat * sum_g(dy * xhat) / N)

    where ``sum_g`` sums over the group's replicas: one collective of
    ``[2, channels]`` in the backward pass (automatic differentiation would
    send gradients back through the ``[replicas, 3, channels]`` exchange and the
    local moments: several more passes over ``x``). The correction term is
    itself an affine normalization of ``x``, so forward and backward each take
    the fused kernel. ``dgamma`` and ``dbeta`` are this replica's sums, as for
    any weight: the strategy sums them across replicas with the other
    gradients. ``gamma`` and ``beta`` are per-channel vectors.
    """

    @tf.custom_gradient
    def normalize(x, gamma, beta):
        # No gradient path through the exchange: the closed form below replaces
        # it, and it keeps tf.custom_gradient's search for variables inside
        # this replica's graph (see keras_replicator._compat.all_reduce_gradient).
        moments = [tf.stop_gradient(m) for m in _local_moments(x, axis, None)]
        group_count, mean, variance, new_mean, new_variance = _group_statistics(
            *moments, group_size
        )
        outputs = _affine_normalize(x, mean, variance, gamma, beta, axis, epsilon)

        def grad(dy, unused_dmean, unused_dvariance):
            del unused_dmean, unused_dvariance  # moving statistics are not differentiated
            if gradient_tape_recording():
                # This gradient is itself being differentiated (a gradient
                # penalty): the closed form holds the statistics fixed, so take
                # the gradient of the plain computation instead, exact to any order.
                with tf.GradientTape() as tape:
                    tape.watch([x, gamma, beta])
                    stats = _global_moments(x, axis, None, group_size)
                    y = _plain_affine_normalize(x, *stats[:2], gamma, beta, axis, epsilon)
                return tape.gradient(y, [x, gamma, beta], output_gradients=dy)
            direct, dgamma, dbeta = _affine_normalize_grad(
                dy, x, mean, variance, gamma, axis, epsilon
            )
            per_example = tf.math.divide_no_nan(
                _group_sum(tf.stack([dbeta, dgamma]), group_size), group_count
            )
            # -gamma * inv * (mean_g(dy) + xhat * mean_g(dy * xhat)), in one pass.
            scaled = -gamma * tf.math.rsqrt(variance + tf.cast(epsilon, x.dtype)) * per_example
            correction = _affine_normalize(x, mean, variance, scaled[1], scaled[0], axis, epsilon)
            return direct + correction, dgamma, dbeta

        return (outputs, new_mean, new_variance), grad

    return normalize(x, gamma, beta)


def _broadcast_shape(rank: int, axis: int) -> list[int]:
    shape = [1] * rank
    shape[axis] = -1
    return shape
