"""Batches with fewer rows than replicas: every replica gets rows, padding weighs nothing.

What: the batches Keras hands the strategy (`fit`, `evaluate`, `predict` on arrays,
generators, datasets) are split by `input_pipeline` into `PaddedBatch` elements:
each replica's slice of the batch (as before: contiguous, in order, differing by
at most one row), the number of real rows in it, and the batch's total. A slice
that would be empty (a batch with fewer rows than replicas: `predict` on one
example, a last batch of 2 rows on 4 replicas) gets one padding row instead, a
copy of the batch's last row, with 0 real rows. `ReplicatorStrategy.run` takes the
slice out again (`unwrap`), so the step (Keras's or a user's) sees a plain batch,
and keeps the counts for the replica while the step is traced, for:

* gradients: `keras_losses` weighs each replica's loss by its real rows'
  share of the batch (`current()`; a loss it computed is marked with
  `mark_weighted`); for a loss it did not compute (a `train_step` of the
  model's own that calls `Optimizer.scale_loss` on a loss of its making),
  `Optimizer.scale_loss` (and `LossScaleOptimizer.scale_loss`) multiplies the
  replica's loss by ``rows * replicas / total``: 1 for even slices (the loss
  unchanged, bit for bit), 0 for padding, and for uneven slices the weight that
  makes the summed gradient one device's (each replica's mean loss counts by its
  rows, as on one device);
* metrics: `Mean` and `Sum` (the loss tracker and every `MeanMetricWrapper`
  metric) give a padding replica's update weight 0, and `CompileMetrics`
  (the metrics of `compile`) gives every metric, weighted or not, a per-row
  sample weight that is 0 on a padding replica (`Precision`, `AUC` and the
  other confusion-matrix metrics count their rows themselves);
* plain `BatchNormalization`'s moving statistics: `keras_batch_norm` weighs
  each replica's update by its rows;
* `GlobalBatchNormalization`: a padding replica counts no rows (`padding_mask`);
* `predict`: a padding replica's output rows are dropped (`predicting`).

The elements of datasets Keras distributes are wrapped (`keras_distributing`,
entered by `TFEpochIterator.__init__`'s patch in `keras_trainer`), and those of
`distribute_dataset(..., padding=True)` (a custom loop passes the element to
`strategy.run`, which takes it apart as for Keras; `kr.real_rows` and
`kr.global_real_rows` give the step its counts). Any other custom loop gets plain
batches, and a batch that would leave a replica without rows is refused by the
input pipeline (`input_pipeline.split`).

Why padding rather than empty slices: on an empty slice, TensorFlow and Keras
ops take other branches (`ops.add` treats a `(0, n)` operand as a bias, the LSTM
cell's shapes, oneDNN's convolution fails), and a mean over 0 rows is NaN
(issue 50). Why not re-cut the batches (merging a short last batch with the one
before, as `input_pipeline.recut_tail` does for custom loops): that changes which
rows form a step, so training is no longer one device's, and it cannot help a
dataset with fewer rows than replicas.

Checked on Keras 3.15 (`BaseOptimizer.scale_loss`, `LossScaleOptimizer.scale_loss`,
`reduction_metrics.Mean.update_state` / `Sum.update_state`,
`compile_utils.CompileMetrics.update_state`).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf
from keras.src.metrics import reduction_metrics
from keras.src.optimizers import base_optimizer, loss_scale_optimizer
from keras.src.trainers import compile_utils

from keras_replicator._compat import patching
from keras_replicator._compat.patching import ScopedPatch

__all__ = [
    "PATCHES", "LocalPaddedBatch", "PaddedBatch", "current", "keras_distributing",
    "mark_weighted", "padding_mask", "predicting", "replica_loss_scale", "unwrap", "wanted",
]

#: A replica's slice of a batch: ``batch`` (the slice), ``rows`` (its real rows,
#: int32; 0: one padding row) and ``total`` (the real rows of the global batch).
PaddedBatch = collections.namedtuple("PaddedBatch", ["batch", "rows", "total"])
#: As `PaddedBatch`, with ``total`` this input pipeline's only (several pipelines
#: sharding by file): the global total is the sum of every replica's ``rows``.
LocalPaddedBatch = collections.namedtuple("LocalPaddedBatch", ["batch", "rows", "total"])

#: False: Keras's batches re-cut and split without row counts, as before (to measure the difference).
enabled = True

_distributing: contextvars.ContextVar[bool] = contextvars.ContextVar("kr_keras_distributing", default=False)
_predicting: contextvars.ContextVar[bool] = contextvars.ContextVar("kr_predicting", default=False)
_local = threading.local()


@contextlib.contextmanager
def keras_distributing() -> Iterator[None]:
    """While Keras's epoch iterator distributes its dataset: its elements are `PaddedBatch`es."""
    token = _distributing.set(True)
    try:
        yield
    finally:
        _distributing.reset(token)


def wanted() -> bool:
    """Whether the dataset being distributed is Keras's (its slices are wrapped)."""
    return enabled and _distributing.get()


@contextlib.contextmanager
def predicting(active: bool = True) -> Iterator[None]:
    """While `predict` runs: padding rows are dropped from the step's outputs."""
    token = _predicting.set(active)
    try:
        yield
    finally:
        _predicting.reset(token)


class _Rows:
    __slots__ = ("rows", "total", "replicas")

    def __init__(self, rows, total, replicas: int):
        self.rows, self.total, self.replicas = rows, total, replicas


def _stack() -> list:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def current() -> _Rows | None:
    """The replica's row counts while its step is traced from a `PaddedBatch`, else None."""
    stack = _stack()
    return stack[-1] if stack else None


def replica_loss_scale(dtype=tf.float32) -> tf.Tensor | None:
    """``rows * replicas / total`` of the replica being traced (None outside a padded step).

    1 for even slices, 0 for a padding replica: the factor on the replica's loss
    that makes the gradients summed over replicas one device's.
    """
    state = current()
    if state is None:
        return None
    scaled = tf.cast(state.rows * state.replicas, tf.float64) / tf.cast(tf.maximum(state.total, 1), tf.float64)
    return tf.cast(scaled, dtype)


def padding_mask(x: tf.Tensor, axis: int) -> tf.Tensor | None:
    """A boolean mask of ``x``'s shape without ``axis``, False on padding (None outside a padded step)."""
    state = current()
    if state is None:
        return None
    shape = tf.shape(x)
    axis = axis % x.shape.rank
    return tf.fill(tf.concat([shape[:axis], shape[axis + 1:]], 0), state.rows > 0)


def _keep(dtype) -> tf.Tensor | None:
    state = current()
    return None if state is None else tf.cast(state.rows > 0, dtype)


def _trim(outputs, rows):
    """A padding replica's output rows dropped (its outputs are all padding)."""
    def cut(t):
        if isinstance(t, tf.Tensor) and t.shape.rank:
            return t[: tf.where(rows > 0, tf.shape(t)[0], 0)]
        return t

    return tf.nest.map_structure(cut, outputs)


def unwrap(strategy, fn: Callable, args, kwargs) -> tuple[Callable, tuple, Any]:
    """``strategy.run``'s arguments with a `PaddedBatch` taken apart for the step (see the module)."""
    splat = isinstance(args, (PaddedBatch, LocalPaddedBatch))  # strategy.run(step, args=batch)
    if splat:
        args = (args,)
    if not args or not isinstance(args[0], (PaddedBatch, LocalPaddedBatch)):
        return fn, args, kwargs
    padded = args[0]
    local = isinstance(padded, LocalPaddedBatch)
    replicas = int(strategy.num_replicas_in_sync)
    trims = _predicting.get()

    def step(padded, *rest, **kw):
        rows = tf.convert_to_tensor(padded.rows)
        total = padded.total
        if local:
            total = tf.distribute.get_replica_context().all_reduce("SUM", rows)
        stack = _stack()
        stack.append(_Rows(rows, total, replicas))
        try:
            outputs = fn(*padded.batch, *rest, **kw) if splat else fn(padded.batch, *rest, **kw)
        finally:
            stack.pop()
        return _trim(outputs, rows) if trims else outputs

    step.__name__ = getattr(fn, "__name__", "step")
    return step, (PaddedBatch(*padded), *args[1:]), kwargs


def mark_weighted(loss) -> None:
    """Marks ``loss`` as already weighted by the replica's rows (`keras_losses` computed it)."""
    _local.weighted = loss


def _weighted(loss) -> bool:
    return loss is getattr(_local, "weighted", None)


def _scaled_loss(original):
    """`scale_loss`. Why: see the module (gradients); Keras calls it before `tape.gradient`."""

    def scale_loss(self, loss):
        weighted = _weighted(loss)
        loss = original(self, loss)
        scale = replica_loss_scale(loss.dtype) if hasattr(loss, "dtype") and not weighted else None
        return loss if scale is None else loss * scale

    return scale_loss


def _masked_update(original):
    """`update_state` of `Mean` / `Sum`. Why: a padding replica's update must count nothing."""

    def update_state(self, values, sample_weight=None):
        keep = _keep(self.dtype or "float32")
        if keep is not None and sample_weight is not None:
            sample_weight = tf.cast(sample_weight, keep.dtype) * keep
        elif keep is not None:
            values = tf.convert_to_tensor(values)
            # Per row, not a scalar: a scalar weight would make Mean average the rows first.
            sample_weight = tf.fill(tf.shape(values)[:1], keep) if values.shape.rank else keep
        return original(self, values, sample_weight=sample_weight)

    return update_state


def _row_weights(y_pred, sample_weight):
    """``sample_weight`` (None: one per row of ``y_pred``) times 0 on a padding replica."""
    keep = _keep(sample_weight.dtype if hasattr(sample_weight, "dtype") else "float32")
    if sample_weight is not None:
        return tf.cast(sample_weight, keep.dtype) * keep
    y_pred = tf.convert_to_tensor(y_pred)
    return tf.fill(tf.shape(y_pred)[:1], keep) if y_pred.shape.rank else keep


def _takes_weights(metric) -> bool:
    parameters = inspect.signature(metric.update_state).parameters
    return "sample_weight" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def _masked_compile_metrics(original):
    """`CompileMetrics.update_state`. Why: a metric that is not a `Mean` counts its rows itself.

    In a padded step every compiled metric, weighted or not, gets a per-row weight
    (the sample weight, if any, times 0 on a padding replica, 1 elsewhere): the
    loop of Keras's method, with that weight. Outside a padded step: Keras's.
    """

    def update_state(self, y_true, y_pred, sample_weight=None):
        if current() is None:
            return original(self, y_true, y_pred, sample_weight)
        if not self.built:
            self.build(y_true, y_pred)
        y_true, y_pred = self._flatten_y(y_true), self._flatten_y(y_pred)
        if sample_weight is not None:
            sample_weight = self._flatten_y(sample_weight)
            if len(sample_weight) < len(y_true):  # one weight for every output, as Keras does
                sample_weight = [sample_weight[0]] * len(y_true)
        else:
            sample_weight = [None] * len(y_true)
        for m, y_t, y_p in zip(self._flat_metrics, y_true, y_pred):
            if m and _takes_weights(m):
                m.update_state(y_t, y_p, sample_weight=_row_weights(y_p, None))
            elif m:  # a custom metric without sample_weight masks its rows itself (kr.real_rows)
                m.update_state(y_t, y_p)
        for m, y_t, y_p, s_w in zip(self._flat_weighted_metrics, y_true, y_pred, sample_weight):
            if m:
                m.update_state(y_t, y_p, _row_weights(y_p, s_w))

    return update_state


#: What `_masked_compile_metrics` relies on: Keras's method loops over these two lists.
COMPILE_METRICS_LOOP = patching.calls(
    "keras CompileMetrics.update_state (loops over _flat_metrics and _flat_weighted_metrics)",
    lambda: compile_utils.CompileMetrics.update_state, "_flatten_y", "_flat_metrics", "_flat_weighted_metrics")

PATCHES = (
    ScopedPatch(base_optimizer.BaseOptimizer, "scale_loss", _scaled_loss),
    ScopedPatch(loss_scale_optimizer.LossScaleOptimizer, "scale_loss", _scaled_loss),
    ScopedPatch(reduction_metrics.Mean, "update_state", _masked_update),
    ScopedPatch(reduction_metrics.Sum, "update_state", _masked_update),
    ScopedPatch(compile_utils.CompileMetrics, "update_state", _masked_compile_metrics,
                guards=[COMPILE_METRICS_LOOP]),
)


def unwrap_spec(spec):
    """A `PaddedBatch`'s element spec: the slice's (what the model is built from)."""
    return spec.batch if isinstance(spec, (PaddedBatch, LocalPaddedBatch)) else spec
