"""A variable stored as k shards on a replica's k logical devices, used as one tensor.

The representation follows from TensorFlow's tape and Keras's optimizer: both need
one resource variable per trained tensor, so each shard is a real Keras variable
tracked by its layer (`trainable_weights`, the tape and the optimizer see the
shards; an optimizer's slots are made with `colocate_vars_with(shard)` and so live
beside it). The layer's attribute (`layer.kernel`) is a `ShardedVariable`: the
parallel layer rules (`parallel_layers`) compute on its shards, every other use
converts it to a tensor, which concatenates the shards on the current device
(the "gather for that use" of TF-Replicator / Mesh-TensorFlow), so code that reads
`layer.kernel` stays correct and its gradient reaches each shard.

Shard j of a variable split on dimension d is the j-th of k equal slices along d
(`np.split`), on logical device j of every replica. `assign`, `numpy` and
conversion work with the full tensor, which is what Keras's saving and
`get_weights` see (`_compat/keras_layouts.py` shows them the full variables).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from keras_replicator._validation import ArgumentError

__all__ = ["DevicePlacement", "ShardedVariable"]


class DevicePlacement:
    """Where shard j's variables and ops go: logical device j (`devices[j]`).

    The strategy's placement (`strategy.logical_device_for_variables(j)` and
    `kr.logical_device(j)`) replaces it under a `ReplicatorStrategy`; this one
    places on fixed devices, for a model that spans k devices without replicas.

    Args:
        devices: the k devices, shard j on `devices[j]`.

    Example:
        ```python
        from keras_replicator.model_parallel.sharded_variable import DevicePlacement

        placement = DevicePlacement(["/cpu:0", "/cpu:1"])
        with placement.ops(1):
            x = tf.ones(3) * 2        # on /cpu:1
        ```
    """

    def __init__(self, devices: Sequence[str]):
        if isinstance(devices, str) or not devices:
            raise ArgumentError(f"devices must be a non-empty sequence of device names, got {devices!r}.")
        self.devices = tuple(devices)

    @property
    def num_shards(self) -> int:
        """k, the number of logical devices."""
        return len(self.devices)

    def variables(self, j: int) -> contextlib.AbstractContextManager:
        """Variables created inside live on logical device `j`."""
        return tf.device(self.devices[j])

    def ops(self, j: int) -> contextlib.AbstractContextManager:
        """Ops created inside run on logical device `j`."""
        return tf.device(self.devices[j])


class ShardedVariable:
    """A Keras variable stored as shards along one dimension; used, it is the whole tensor.

    Args:
        shards: the k shard variables (Keras variables), in order.
        axis: the dimension they split.
        path: the full variable's Keras path (`"dense/kernel"`).
        placement: where shard j's ops run (`ops(j)`).

    Example:
        ```python
        import keras
        from keras_replicator.model_parallel.sharded_variable import (
            DevicePlacement, ShardedVariable)

        placement = DevicePlacement(["/cpu:0", "/cpu:1"])
        shards = []
        for j, part in enumerate(np.split(np.arange(8.0).reshape(2, 4), 2, axis=1)):
            with placement.variables(j):
                shards.append(keras.Variable(part, name=f"w_shard{j}"))
        w = ShardedVariable(shards, axis=1, path="w", placement=placement)
        w.shape                                 # (2, 4)
        w.numpy()[1]                            # [4., 5., 6., 7.]
        w.assign(np.zeros((2, 4)))              # each shard gets its slice
        float(keras.ops.sum(w + 1.0))           # 8.0: any use sees the whole tensor
        ```
    """

    def __init__(self, shards: Sequence, axis: int, path: str, placement: DevicePlacement):
        if len(shards) < 2:
            raise ArgumentError(f"a ShardedVariable needs at least 2 shards, got {len(shards)}.")
        self.shards = tuple(shards)
        self.axis = int(axis)
        self.path = path
        self.name = path.rsplit("/", 1)[-1]
        self.placement = placement
        shape = list(self.shards[0].shape)
        shape[self.axis] = sum(int(s.shape[self.axis]) for s in self.shards)
        self.shape = tuple(shape)

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    @property
    def dtype(self):
        return self.shards[0].dtype

    @property
    def trainable(self) -> bool:
        return self.shards[0].trainable

    @trainable.setter
    def trainable(self, value: bool) -> None:
        for shard in self.shards:
            shard.trainable = value

    @property
    def regularizer(self):
        return self.shards[0].regularizer

    @property
    def constraint(self):
        return self.shards[0].constraint

    def shard_values(self) -> list[tf.Tensor]:
        """Each shard's value, read where it lives (autocast like any Keras variable)."""
        return [shard.value for shard in self.shards]

    @property
    def value(self) -> tf.Tensor:
        """The whole tensor, concatenated on the current device."""
        return tf.concat(self.shard_values(), axis=self.axis)

    def __tf_tensor__(self, dtype=None, name=None) -> tf.Tensor:
        value = self.value
        return value if dtype is None else tf.cast(value, dtype)

    def numpy(self) -> np.ndarray:
        return np.concatenate([np.asarray(shard.numpy()) for shard in self.shards], axis=self.axis)

    def __array__(self, dtype=None, copy=None):
        value = self.numpy()
        return value if dtype is None else value.astype(dtype)

    def split(self, value) -> list:
        """`value` (the whole tensor) cut into the shards' slices."""
        if tuple(value.shape) != self.shape:
            raise ArgumentError(
                f"cannot assign a value of shape {tuple(value.shape)} to {self.path!r} of shape {self.shape}."
            )
        if isinstance(value, np.ndarray):
            return np.split(value, self.num_shards, axis=self.axis)
        return tf.split(value, self.num_shards, axis=self.axis)

    def assign(self, value) -> None:
        """Assigns the whole tensor: shard j gets slice j (for loading and `set_weights`)."""
        if not isinstance(value, (np.ndarray, tf.Tensor)):
            value = np.asarray(value)
        for shard, part in zip(self.shards, self.split(value)):
            shard.assign(part)

    def __repr__(self) -> str:
        return (f"<ShardedVariable path={self.path} shape={self.shape} dtype={self.dtype} "
                f"shards={self.num_shards} on axis {self.axis}>")

    def __len__(self) -> int:
        return self.shape[0]


def _forward(name: str) -> Callable:
    def method(self, *args):
        return getattr(self.value, name)(*args)

    method.__name__ = name
    return method


# Arithmetic on `layer.kernel` works as on a Keras variable: on the whole tensor.
for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
              "__rtruediv__", "__matmul__", "__rmatmul__", "__neg__", "__pow__", "__getitem__"):
    setattr(ShardedVariable, _name, _forward(_name))
