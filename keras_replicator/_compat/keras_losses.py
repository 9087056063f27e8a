"""Every loss Keras accepts on one device trains under our strategies as there.

What it patches (Keras 3.15, TensorFlow backend; installed patches acting only
for keras_replicator's strategies, in a replica context of more than one
replica): `TensorFlowTrainer.train_step` / `test_step` (the default steps, not
a model's own), `Trainer._compute_loss` / `Trainer.compute_loss` (the base
methods), `keras.src.losses.loss.reduce_values`,
`keras.src.losses.loss.unscale_loss_for_distribution`,
`TensorFlowTrainer._aggregate_additional_loss` and (its activity-regularizer
calls only, where Keras does not divide the term by the batch) `Layer.add_loss`.

Why: Keras's TensorFlow trainer gets the replicas' share of the loss by
scaling at the leaves. `reduce_values` multiplies a `keras.losses` object's
mean by `1 / num_replicas` (`scale_loss_for_distribution`),
`_aggregate_additional_loss` multiplies every `add_loss` term by it, and the
default steps multiply the loss by `num_replicas` again before logging it
(`unscale_loss_for_distribution`; the per-output losses of a model with
several are logged the same way, each replica's value counting once). That is right only for a loss that Keras
reduces itself, as a mean, over equal shares:

* a loss function that returns a scalar (`ops.mean(...)`: every contrastive
  loss) is left unscaled, and the replicas' gradients are summed: N times too
  strong, logged N times too large;
* `add_loss(keras.losses.X()(y, p))` is scaled twice: N times too weak;
* `add_loss` of a per-sample tensor (one device sums it) is scaled as if it
  were a mean: N times too weak;
* a custom `compute_loss` that reduces with `ops.mean` is N times too strong;
* `reduction="mean_with_sample_weight"` divides by each replica's own sum of
  weights (wrong when the replicas' weights differ: `class_weight`, any
  `sample_weight`), and a short batch split unequally weighs its replicas'
  means equally.

What we do instead, one device's semantics: inside the default step (its
forward pass included) and inside `compute_loss`, every loss term is what one
device would compute on the replica's rows: a `keras.losses` object's mean
over the replica's rows; its `"sum"` reduction and an `add_loss` of per-sample
values, the replica's sum divided by its share of the global batch (an
estimate of the global sum); `"mean_with_sample_weight"`, the replica's sum
over the global sum of weights (an all-reduce), divided by the share; a scalar
`add_loss` (a mean over the batch, an activity regularizer, which Keras
divides by the batch size, or a term of the weights) as it is. The total the
root `compute_loss` returns keeps that value (what the step logs, as one
device does: each replica's value weighted by its rows), and its gradient is
multiplied by the replica's share `rows / global rows` (an all-reduce of the
row count; in an XLA-compiled step, where no collective can run, `1 / N`): the
summed gradients are one device's, for equal and unequal shares.

An activity regularizer's term (`Layer.__call__`'s `add_loss`): Keras 3.15 divides
it by the batch size (keras-team/keras#22021, fixing #22018), a mean this module
keeps as it is; Keras 3.8-3.14 adds the sum over the rows, which one device sums
over the whole batch. Which one this Keras does is feature-detected, by behaviour
(`activity_divided_by_batch`: a layer called on 4 rows, checked when the patches
are installed); where Keras sums, the term a replica's `Layer.__call__` adds (an
installed patch of `Layer.add_loss`, acting only on its calls from `Layer.__call__`
under our strategies) is counted as a sum over the replica's rows: divided by the
replica's share, as a per-sample `add_loss` is (before the fix: N times too weak,
measured on Keras 3.10: weights 1.4e-2 from one device after 2 epochs).

Checked on Keras 3.15 (the loss-form matrix, tests/test_loss_forms.py) and on
Keras 3.8-3.15 (the suite's core subset, its activity-regularizer cell included).

Not covered (they keep Keras's scaling): a loss object called in a model's own
`train_step` outside `compute_loss` (keras-io's GANs: right for equal shares)
and a `train_step` that reduces its loss by hand and applies the gradients
itself (it must scale its loss by the global batch, as in a TensorFlow custom
loop: `tf.nn.compute_average_loss`).
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading

import keras
import numpy as np
import tensorflow as tf
from keras import ops
from keras.src import tree
from keras.src.backend.tensorflow import trainer as tf_trainer
from keras.src.layers import layer as layer_module
from keras.src.losses import loss as loss_module
from keras.src.trainers import trainer as base_trainer
from keras.src.trainers.data_adapters import data_adapter_utils

from keras_replicator._compat import short_batches
from keras_replicator._compat.patching import ScopedPatch, behaves, calls, ours
from keras_replicator.versions import IncompatiblePatchError

_state = threading.local()


class _Step:
    """One replica's step: its rows (a tensor, and statically if known) and its share of the batch."""

    def __init__(self, rows, static_rows, share, compiled: bool):
        self.rows, self.static_rows, self.share, self.compiled = rows, static_rows, share, compiled


def _current() -> _Step | None:
    return getattr(_state, "step", None)


def _replica_context():
    """The replica context of one of our strategies' steps over more than one replica, else None."""
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync < 2 or not ours(tf.distribute.get_strategy()):
        return None
    return ctx


def _compiled() -> bool:
    """Whether we trace inside an XLA-compiled replica function (no collective can run there)."""
    from keras_replicator._compat import keras_xla

    return getattr(keras_xla._tracing, "deferred", None) is not None


def _first_rows(*structures):
    for structure in structures:
        for leaf in tree.flatten(structure):
            if leaf is not None and hasattr(leaf, "shape") and len(leaf.shape) > 0:
                return tf.shape(leaf)[0], leaf.shape[0]
    return None, None


def _make_step(ctx, *structures) -> _Step:
    """The replica's rows (the first tensor of `structures` with a batch axis) and its share."""
    rows, static_rows = _first_rows(*structures)
    compiled = _compiled()
    n = ctx.num_replicas_in_sync
    padded = short_batches.current()
    if padded is not None:
        # A step run from a `PaddedBatch`: its real rows (0 on a padding replica) and the
        # batch's, known without a collective.
        rows, total = (tf.cast(v, tf.float32) for v in (padded.rows, padded.total))
        return _Step(rows, static_rows, tf.stop_gradient(tf.math.divide_no_nan(rows, total)),
                     compiled)
    if rows is None:
        return _Step(None, None, tf.constant(1.0 / n), compiled)
    rows = tf.cast(rows, tf.float32)
    total = rows * n if compiled else ctx.all_reduce(tf.distribute.ReduceOp.SUM, rows)
    share = tf.stop_gradient(tf.math.divide_no_nan(rows, total))
    return _Step(rows, static_rows, share, compiled)


class _Region:
    """Sets the thread's current step (and the depth of nested `compute_loss` calls) for a block."""

    def __init__(self, step: _Step | None, depth: int):
        self.step, self.depth = step, depth

    def __enter__(self):
        self.saved = (_current(), getattr(_state, "depth", 0))
        _state.step, _state.depth = self.step, self.depth

    def __exit__(self, *exc):
        _state.step, _state.depth = self.saved


def _scale_gradient(value, share):
    """`value` itself, whose gradient is multiplied by `share`."""

    @tf.custom_gradient
    def scaled(v):
        def grad(dy):
            return dy * tf.cast(share, dy.dtype)

        return tf.identity(v), grad

    return scaled(value)


def _default_step(original):
    """`TensorFlowTrainer.train_step` / `test_step` (Keras's own, not a model's override).

    The whole step, its forward pass included, computes every loss term as one
    device would on the replica's rows (see the module docstring).
    """

    @functools.wraps(original)
    def step(self, data):
        ctx = _replica_context()
        if ctx is None or _current() is not None:
            return original(self, data)
        x, _, _ = data_adapter_utils.unpack_x_y_sample_weight(data)
        _state.activity = {}  # a new step's trace: the marks of earlier ones are done with
        with _Region(_make_step(ctx, x, data), 0):
            return original(self, data)

    return step


_COMPUTE_LOSS_ARGS = ("x", "y", "y_pred", "sample_weight")


def _root(original):
    """`Trainer._compute_loss` / `Trainer.compute_loss`: the outermost call is the loss's root.

    Its terms are one device's values on the replica's rows; the total keeps
    that value and its gradient is multiplied by the replica's share of the batch.
    """

    @functools.wraps(original)
    def compute_loss(self, *args, **kwargs):
        ctx = _replica_context()
        if ctx is None or getattr(_state, "depth", 0) > 0:
            return original(self, *args, **kwargs)
        given = dict(zip(_COMPUTE_LOSS_ARGS, args))
        given.update({k: v for k, v in kwargs.items() if k in _COMPUTE_LOSS_ARGS})
        step = _current() or _make_step(ctx, given.get("x"), given.get("y_pred"), given.get("y"))
        with _Region(step, 1):
            total = original(self, *args, **kwargs)
        if total is None or len(total.shape) > 0:
            # Per-sample values (reduction="none"): their gradient is the sum of the rows.
            return total
        result = _scale_gradient(total, step.share)
        _state.returned = result
        short_batches.mark_weighted(result)
        return result

    return compute_loss


def _global_sum(value, step: _Step):
    ctx = tf.distribute.get_replica_context()
    if step.compiled or ctx is None:
        return None
    return ctx.all_reduce(tf.distribute.ReduceOp.SUM, value)


def _one_device_reduce_values(original):
    """`loss.reduce_values`: in a step, the value one device computes on the replica's rows."""

    @functools.wraps(original)
    def reduce_values(values, sample_weight=None, reduction="sum_over_batch_size"):
        step = _current()
        if step is None or _replica_context() is None:
            return original(values, sample_weight, reduction)
        if reduction is None or reduction == "none" or tuple(values.shape) in ((), (0,)):
            return values
        loss = ops.sum(values)
        if reduction == "sum":
            return tf.math.divide_no_nan(loss, tf.cast(step.share, loss.dtype))
        if reduction == "mean_with_sample_weight" and sample_weight is not None:
            weights = ops.cast(ops.sum(sample_weight), loss.dtype)
            total = _global_sum(weights, step)
            divisor = weights if total is None else total * tf.cast(step.share, loss.dtype)
        else:
            divisor = ops.cast(ops.prod(ops.convert_to_tensor(ops.shape(values), dtype="int32")),
                               loss.dtype)
        return ops.divide_no_nan(loss, divisor)

    return reduce_values


def _per_row(loss, step: _Step) -> bool:
    """Whether a non-scalar `add_loss` term has one value per row of the batch (else: of the weights)."""
    first = loss.shape[0]
    return first is None or first == step.static_rows


def _one_device_additional_loss(original):
    """`TensorFlowTrainer._aggregate_additional_loss`: an `add_loss` term as one device counts it.

    Keras's own sum of the term, unscaled; a term of per-sample values (one device
    sums its rows) divided by the replica's share: an estimate of the global sum.
    """

    @functools.wraps(original)
    def aggregate(self, loss):
        step = _current()
        if step is None or _replica_context() is None:
            return original(self, loss)
        total = base_trainer.Trainer._aggregate_additional_loss(self, loss)  # cast, summed
        if (len(loss.shape) > 0 and _per_row(loss, step)) or _activity_sum(loss):
            total = tf.math.divide_no_nan(total, tf.cast(step.share, total.dtype))
        return total

    return aggregate


# The code of Keras's `Layer.__call__` (the one caller of `add_loss` whose terms are activity
# regularizers'), under Keras's traceback-filtering decorator.
_LAYER_CALL_CODE = inspect.unwrap(layer_module.Layer.__call__).__code__


@functools.cache
def activity_divided_by_batch() -> bool:
    """Whether this Keras divides an activity regularizer's term by the batch size (Keras 3.15+).

    Feature-detected by behaviour: an `Identity` layer whose regularizer sums its
    output, called on 4 rows of ones, adds 1.0 (divided: keras#22021) or 4.0 (the sum).
    """
    _state.probing = True  # (the probe's own add_loss is Keras's)
    try:
        with tf.init_scope():
            # (named: an automatic name would take "identity" from the user's next Identity)
            layer = keras.layers.Identity(name="kr_activity_probe", activity_regularizer=ops.sum)
            layer(np.ones((4, 1), "float32"))
            values = [float(v) for v in layer.losses]
    finally:
        _state.probing = False
    if values == [1.0]:
        return True
    if values == [4.0]:
        return False
    raise IncompatiblePatchError(
        "keras_replicator._compat.keras_losses: an activity regularizer summing 4 rows of ones "
        f"added {values} through Layer.__call__, neither the sum (4.0, Keras 3.8-3.14) nor the "
        "mean (1.0, Keras 3.15): this Keras counts activity terms in a way keras_losses does "
        "not know, so it cannot give the replicas one device's term. Use a supported pair "
        "(keras_replicator.versions).")


def _activity_probe() -> str | None:
    activity_divided_by_batch()  # raises IncompatiblePatchError where it is neither
    return None


def _activity_sum(loss) -> bool:
    """Whether `loss` is an activity regularizer's sum over the replica's rows (marked by `add_loss`)."""
    return getattr(_state, "activity", {}).get(id(loss)) is loss


def _marks_activity_sums(original):
    """`Layer.add_loss`: an activity regularizer's term is marked as a sum over the replica's rows.

    Only its calls from `Layer.__call__` (the activity regularizer) under our strategies, and
    only where this Keras does not divide the term by the batch (Keras 3.8-3.14).
    """

    @functools.wraps(original)
    def add_loss(self, loss):
        if (sys._getframe(1).f_code is _LAYER_CALL_CODE and not getattr(_state, "probing", False)
                and _replica_context() is not None and not activity_divided_by_batch()):
            marks = _state.__dict__.setdefault("activity", {})
            for term in tree.flatten(loss):
                marks[id(term)] = term  # held: its id stays unique while marked
        return original(self, loss)

    return add_loss


def _unscale(original):
    """`loss.unscale_loss_for_distribution`: our roots' totals are logged as they are."""

    @functools.wraps(original)
    def unscale(value):
        ctx = _replica_context()
        if ctx is None:
            return original(value)
        if value is getattr(_state, "returned", None):
            return value
        step = _current()
        if step is None:
            return original(value)
        if step.static_rows is None and step.rows is not None:
            # A per-output loss's `Mean`, weighted by a static batch size that is not
            # known: each replica's value counts once. One device counts the step's
            # value once: each replica's value, times its share of the batch, N times.
            n = ctx.num_replicas_in_sync
            return value * tf.cast(step.share * n, value.dtype)
        return value

    return unscale


# Installed by keras_replicator._compat.install(), undone by uninstall().
PATCHES = (
    ScopedPatch(tf_trainer.TensorFlowTrainer, "train_step", _default_step),
    ScopedPatch(tf_trainer.TensorFlowTrainer, "test_step", _default_step),
    ScopedPatch(base_trainer.Trainer, "_compute_loss", _root),
    ScopedPatch(base_trainer.Trainer, "compute_loss", _root),
    ScopedPatch(loss_module, "reduce_values", _one_device_reduce_values),
    ScopedPatch(loss_module, "unscale_loss_for_distribution", _unscale),
    ScopedPatch(tf_trainer.TensorFlowTrainer, "_aggregate_additional_loss", _one_device_additional_loss),
    ScopedPatch(layer_module.Layer, "add_loss", _marks_activity_sums, guards=(
        calls("keras Layer.__call__", lambda: layer_module.Layer.__call__, "activity_regularizer",
              "add_loss"),
        behaves("keras Layer.__call__'s activity-regularizer term", _activity_probe))),
)
