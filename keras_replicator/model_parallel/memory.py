"""Bytes per device of a model's training state, summed from where each variable lives.

A mirrored variable counts once on every device holding a copy; a sharded
variable's shards each on theirs. Gradients at rest are the trainable weights'
shapes on the trainable weights' devices (a shard's gradient is made by the ops
on its logical device, and the all-reduce among its copies keeps it there).
"""

from __future__ import annotations

from collections.abc import Iterable

import keras
import tensorflow as tf

from keras_replicator.optimizers.state_sharding import variable_components as _components

__all__ = ["bytes_per_device", "training_bytes_per_device"]


def bytes_per_device(variables: Iterable) -> dict[str, int]:
    """``{device: bytes}`` of `variables` (Keras or TensorFlow, mirrored or not).

    Example:
        ```python
        from keras_replicator.model_parallel.memory import bytes_per_device

        with tf.device("/cpu:1"):
            v = keras.Variable(np.zeros((4, 4), "float32"))
        bytes_per_device([v])      # {'/job:localhost/replica:0/task:0/device:CPU:1': 64}
        ```
    """
    out: dict[str, int] = {}
    for variable in variables:
        for component in _components(variable):
            device = tf.DeviceSpec.from_string(component.device).to_string()
            out[device] = out.get(device, 0) + int(component.shape.num_elements()) * component.dtype.size
    return out


def training_bytes_per_device(model: keras.Model) -> dict[str, dict[str, int]]:
    """Weights, gradients at rest and optimizer state of a compiled, built model, per device.

    Returns:
        ``{"weights": {...}, "gradients": {...}, "optimizer": {...}, "total": {...}}``,
        each ``{device: bytes}``; the optimizer's part is empty until it is built.

    Example:
        ```python
        from keras_replicator.model_parallel.memory import training_bytes_per_device

        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile("adam", "mse")
        model.optimizer.build(model.trainable_variables)
        parts = training_bytes_per_device(model)
        sum(parts["weights"].values())   # 40: a 4 x 2 kernel and 2 biases, float32
        ```
    """
    parts = {
        "weights": bytes_per_device(model.weights),
        "gradients": bytes_per_device(model.trainable_weights),
        "optimizer": bytes_per_device(model.optimizer.variables) if model.optimizer else {},
    }
    total: dict[str, int] = {}
    for part in parts.values():
        for device, size in part.items():
            total[device] = total.get(device, 0) + size
    parts["total"] = total
    return parts
