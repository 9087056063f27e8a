"""The data axis of a layout: a variable sharded over the M replicas (FSDP / ZeRO-3).

A layout naming the data axis (`batch`) on dimension d, alone (`("batch", None)`)
or with the model axis (`("model", "batch", None)`, KerasHub's Q/K/V kernels),
stores the variable as slices over the replicas: each of its Keras (shard)
variables is mirrored, but copy i holds slice i along d, so the shard (i, j)
lives on logical device j of replica i and a device holds 1/(M k) of it.

* Use: inside a replica, each shard is gathered whole along d for that use
  (`ReplicaContext.all_gather`), on the shard's logical device; outside one
  (Keras's symbolic build, `numpy`, saving) its copies are concatenated.
* Gradient: the gather's gradient is an all-reduce of the whole gradient followed
  by the replica's slice: a reduce-scatter built from an all-reduce, as TensorFlow
  has no reduce-scatter on CPUs (DESIGN.md). A lookup's sparse gradient
  (`IndexedSlices`: `Embedding`, `tf.gather`, `keras.ops.take`) stays sparse: the
  replicas' looked-up rows, duplicates kept, cut to the replica's slice, the form
  one device's optimizer gets (Keras's Adam on `IndexedSlices` squares each
  looked-up row before duplicates add up, so a densified gradient trains
  differently: 2e-2 off one device after 2 AdamW steps). It is
  already summed over the replicas, so the optimizer must not sum it again
  (`_compat/keras_fsdp.py` skips its all-reduce for these variables); each copy's
  update then runs unchanged on its own slice, and so do the optimizer's slots
  (made with the shard's shape, beside each copy): weights, gradients at rest and
  slots are all 1/M per device.
* Saving: `numpy`, `assign`, `get_weights` and Keras's files see the whole tensor
  (`ShardedVariable`'s facade): the checkpoint format is unsharded.
* A step traced once: these copies differ across replicas, so the trace's
  invariance analysis is told so (`replica_slices`).

Not supported (a clear error when the model is built): the data axis without a
`ReplicatorStrategy` of several replicas, a multi-worker strategy (copies on
other workers), a variable both split over the replicas and read by a layer rule
that needs its shards (the layer then uses the gathered tensor: correct, not
computed on shards).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from keras_replicator.errors import LayoutError
from keras_replicator.model_parallel.sharded_variable import ShardedVariable

__all__ = ["ReplicaShardedVariable", "check_optimizer", "copies", "data_dim", "mark_like",
           "mark_replica_slices", "replica_axis", "replica_slices"]

# id(TensorFlow variable) -> (weak reference to it, the dimension its replica copies split).
_split: dict[int, tuple[weakref.ref, int]] = {}


def _tf_variable(variable):
    """The TensorFlow variable of a Keras one (`.value`); a TensorFlow variable itself
    (whose `.value` is a method)."""
    return variable if isinstance(variable, tf.Variable) else getattr(variable, "value", variable)


def copies(variable) -> list[tf.Variable]:
    """The per-replica copies (components) of a Keras or TensorFlow mirrored variable."""
    value = _tf_variable(variable)
    values = getattr(value, "values", None)
    if isinstance(values, tuple) and values and isinstance(values[0], tf.Variable):
        return list(values)
    return [value]


def mark_replica_slices(variable, axis: int) -> None:
    """Marks `variable` (Keras or TensorFlow): its replica copies hold slices along `axis`."""
    tf_variable = _tf_variable(variable)
    _split[id(tf_variable)] = (weakref.ref(tf_variable), int(axis))


def mark_like(slot, reference) -> None:
    """Marks an optimizer's `slot` as its `reference` variable is marked (same shape, same slices)."""
    axis = replica_axis(reference)
    if axis is not None:
        mark_replica_slices(slot, axis)


def replica_slices(variable) -> bool:
    """Whether `variable`'s copies hold different slices (its gradient is already summed)."""
    return replica_axis(variable) is not None


def replica_axis(variable) -> int | None:
    """The dimension `variable`'s copies split, or `None` (Keras or TensorFlow variable)."""
    tf_variable = _tf_variable(variable)
    entry = _split.get(id(tf_variable))
    return entry[1] if entry is not None and entry[0]() is tf_variable else None


def check_optimizer(model) -> None:
    """Raises `LayoutError` when `model`'s optimizer would update split variables wrongly."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not any(replica_slices(v) for v in model.trainable_variables):
        return
    problem = None
    if getattr(model.distribute_strategy, "shard_optimizer_state", False):
        problem = "shard_optimizer_state=True (its update and all-gather would overwrite the slices)"
    elif getattr(type(optimizer), "reduces_gradients", False):
        problem = "a CrossReplicaOptimizer (it would sum their already reduced gradients again)"
    elif getattr(optimizer, "clipnorm", None) or getattr(optimizer, "global_clipnorm", None):
        problem = "clipnorm / global_clipnorm (each replica would see its slice's norm)"
    if problem is not None:
        raise LayoutError(
            "the layout splits variables over the data axis (FSDP), which keras_replicator does "
            f"not train with {problem}; remove it, or the data axis from the layouts."
        )


def data_dim(layout, rules, placement) -> int | None:
    """The dimension `layout` splits over the replicas, or `None` (not split, or M = 1).

    Raises `LayoutError` when the data axis splits a variable where it cannot be:
    without a strategy, or over the replicas of several workers.
    """
    if layout is None or rules.data_axis not in layout.axes or rules.data_size == 1:
        return None
    dim = layout.axes.index(rules.data_axis)
    strategy = getattr(placement, "strategy", None)
    if strategy is None:
        raise LayoutError(
            f"LayoutMap rule {layout.rule!r} -> {layout.axes} splits {layout.path!r} over the data "
            f"axis {rules.data_axis!r}: that needs the replicas of a ReplicatorStrategy(layout_map=...)."
        )
    if getattr(strategy, "num_workers", 1) > 1:
        raise LayoutError(
            f"LayoutMap rule {layout.rule!r} splits {layout.path!r} over the data axis: FSDP over "
            "the replicas of several workers is not supported (a worker holds only its replicas' copies)."
        )
    return dim


def split_over_replicas(whole, dim: int, num_replicas: int) -> list:
    """`whole` cut into the M replicas' slices along `dim`."""
    return tf.split(whole, num_replicas, axis=dim)


def assign_replica_slices(variable, whole, dim: int) -> None:
    """Copy i of `variable` gets slice i of `whole` along `dim` (eagerly)."""
    parts = copies(variable)
    if len(parts) < 2:
        raise LayoutError(f"{variable.path!r}: a variable split over the replicas needs mirrored copies.")
    for copy, part in zip(parts, np.split(np.asarray(whole), len(parts), axis=dim)):
        copy.assign(part)


def _replica_index(context) -> tf.Tensor:
    """The running replica's index (one worker: FSDP refuses several), a Python int or a tensor."""
    rid = context.replica_id_in_sync_group
    return tf.cast(rid, tf.int32) if isinstance(rid, tf.Tensor) else tf.constant(rid, tf.int32)


def _sparse_reduce_scatter(context, dy: tf.IndexedSlices, x: tf.Tensor, axis: int) -> tf.IndexedSlices:
    """This replica's slice (along `axis`) of the sum over the replicas of the sparse `dy`.

    The sum of `IndexedSlices` is their concatenation (TensorFlow's all-reduce of
    them): the rows every replica looked up, duplicates kept, as one device's lookup
    of the whole batch gives them. The slice keeps that form, so the optimizer sees
    the gradient one device would give it, restricted to the replica's part:

    * `axis` 0 (rows split over the replicas): the rows in this replica's range,
      re-indexed from 0;
    * another axis: every row, its values cut to this replica's columns.

    Densifying instead changes what Keras's optimizers compute: on `IndexedSlices`
    their elementwise terms (Adam's `square(gradient)`) apply to each looked-up row
    before duplicates are added up, on a dense gradient after.
    """
    total = context.all_reduce(tf.distribute.ReduceOp.SUM, dy)
    size = int(x.shape[axis])
    start = _replica_index(context) * size
    dense_shape = tf.shape(x, out_type=total.dense_shape.dtype) if total.dense_shape is not None else None
    if axis == 0:
        local = total.indices - tf.cast(start, total.indices.dtype)
        inside = tf.where((local >= 0) & (local < size))[:, 0]
        return tf.IndexedSlices(tf.gather(total.values, inside), tf.gather(local, inside), dense_shape)
    return tf.IndexedSlices(tf.gather(total.values, tf.range(start, start + size), axis=axis),
                            total.indices, dense_shape)


def _dense_reduce_scatter(context, dy: tf.Tensor, x: tf.Tensor, axis: int) -> tf.Tensor:
    """This replica's slice (along `axis`) of the sum over the replicas of `dy`."""
    total = context.all_reduce(tf.distribute.ReduceOp.SUM, dy)
    size = int(x.shape[axis])
    return tf.gather(total, tf.range(size) + _replica_index(context) * size, axis=axis)


def gather_over_replicas(context, x: tf.Tensor, axis: int, shape) -> tf.Tensor:
    """`x` (this replica's slice) gathered whole along `axis`; its gradient the reduce-scatter.

    The gradient is written here rather than taken from the replica context's
    `all_gather`, whose gradient slices a dense tensor: an embedding lookup's
    gradient is `IndexedSlices`, and stays so (`_sparse_reduce_scatter`).
    """

    @tf.custom_gradient
    def gather(x):
        # all_gather's static shape leaves the gathered dimension unknown: later layers
        # (LayerNormalization's broadcast) need it.
        y = tf.ensure_shape(context.all_gather(tf.stop_gradient(x), axis=axis), shape)

        def grad(dy):
            if isinstance(dy, tf.IndexedSlices):
                return _sparse_reduce_scatter(context, dy, x, axis)
            return _dense_reduce_scatter(context, dy, x, axis)

        return y, grad

    return gather(x)


class ReplicaShardedVariable(ShardedVariable):
    """A `ShardedVariable` whose shards are also split over the M replicas along `data_axis`.

    Each shard is a mirrored Keras variable whose copy i holds slice i along
    `data_axis` (so the facade's whole tensor is M x the shards' shapes there). A
    use in a replica gathers each shard over the replicas (`all_gather`, whose
    gradient is the reduce-scatter); `numpy` and `assign` work on the whole tensor.

    Args:
        shards: the k shard variables (k = 1 without a model axis).
        axis: the dimension the shards split (the model axis), or `None`.
        data_axis: the dimension the replicas split.
        path: the whole variable's Keras path.
        placement: where shard j's ops run (`ops(j)`).

    Example:
        ```python
        import keras
        from keras_replicator.model_parallel.fsdp import ReplicaShardedVariable

        mesh = keras.distribution.DeviceMesh((2, 1), ["batch", "model"])     # 2 replicas
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map["dense/kernel"] = ("batch", None)       # rows over the replicas
        strategy = kr.ReplicatorStrategy(layout_map=layout_map)
        with strategy.scope():
            layer = keras.layers.Dense(2, name="dense")
            layer.build((None, 8))
        isinstance(layer.kernel, ReplicaShardedVariable)   # True
        layer.kernel.shape                                 # (8, 2): used whole
        [tuple(c.shape) for c in layer.trainable_weights[0].value.values]  # [(4, 2), (4, 2)]: a copy per replica
        layer.kernel.numpy()[:, 0].shape                   # (8,): the copies put together
        ```
    """

    def __init__(self, shards: Sequence, axis: int | None, data_axis: int, path: str, placement):
        self.shards = tuple(shards)
        self.axis = int(axis) if axis is not None else None
        self.data_axis = int(data_axis)
        self.path = path
        self.name = path.rsplit("/", 1)[-1]
        self.placement = placement
        self.num_replicas = len(copies(self.shards[0]))
        shape = list(self.shards[0].shape)
        if self.axis is not None:
            shape[self.axis] *= len(self.shards)
        shape[self.data_axis] *= self.num_replicas
        self.shape = tuple(shape)

    def _gathered(self, j: int) -> tf.Tensor:
        shard = self.shards[j]
        context = tf.distribute.get_replica_context()
        if context is not None and tf.distribute.has_strategy():
            shape = list(shard.shape)
            shape[self.data_axis] *= self.num_replicas
            with self.placement.ops(j):
                return gather_over_replicas(context, tf.convert_to_tensor(shard.value), self.data_axis, shape)
        # Outside a replica (Keras's symbolic build, eager reads): the copies, concatenated.
        return tf.concat([tf.convert_to_tensor(c) for c in copies(shard)], axis=self.data_axis)

    def shard_values(self) -> list[tf.Tensor]:
        """Each model-axis shard gathered whole over the replicas."""
        return [self._gathered(j) for j in range(len(self.shards))]

    @property
    def value(self) -> tf.Tensor:
        values = self.shard_values()
        return values[0] if self.axis is None else tf.concat(values, axis=self.axis)

    def _shard_numpy(self, shard) -> np.ndarray:
        return np.concatenate([np.asarray(c.numpy()) for c in copies(shard)], axis=self.data_axis)

    def numpy(self) -> np.ndarray:
        parts = [self._shard_numpy(s) for s in self.shards]
        return parts[0] if self.axis is None else np.concatenate(parts, axis=self.axis)

    def assign(self, value) -> None:
        """Assigns the whole tensor: shard j's copy i gets its slice (loading, `set_weights`)."""
        value = np.asarray(value)
        if tuple(value.shape) != self.shape:
            raise LayoutError(
                f"cannot assign a value of shape {tuple(value.shape)} to {self.path!r} of shape {self.shape}."
            )
        parts = [value] if self.axis is None else np.split(value, len(self.shards), axis=self.axis)
        for shard, part in zip(self.shards, parts):
            assign_replica_slices(shard, part, self.data_axis)

    def __repr__(self) -> str:
        return (f"<ReplicaShardedVariable path={self.path} shape={self.shape} dtype={self.dtype} "
                f"shards={len(self.shards)} on axis {self.axis}, {self.num_replicas} replicas on "
                f"axis {self.data_axis}>")
