"""Optimizer-state sharding (ZeRO stage 1): each slot lives on one replica only.

With ``kr.ReplicatorStrategy(shard_optimizer_state=True)`` every Keras
optimizer built under the strategy's scope stores the slots of each model
variable (Adam's ``m`` and ``v``, momentum, Adafactor's factored moments, ...)
on one replica, its *owner*, instead of on every replica. The step is:

1. the gradients are all-reduced, as without sharding (reduce-scatter would
   send less, but TensorFlow has it only over NCCL on GPUs);
2. each replica applies the optimizer's own ``update_step`` to the variables it
   owns, with their slots (weight decay included);
3. the new values reach every replica with one all-gather per dtype.

Whole variables are owned (not slices of them), so any Keras optimizer works,
element-wise or not (Adafactor), and checkpoints keep the unsharded format:
each slot is one whole variable, saved and restored as such, on any number of
replicas, sharded or not. The owners are chosen by sorted-greedy partition of
the variables' sizes (`partition`), as torch's ``ZeroRedundancyOptimizer``
does: each replica's share is within one variable of ``1/N`` of the total.

On several workers the owners are all the job's replicas; Keras's saving gathers
the whole state to write it.

This module holds the parts that need no private API: the partition, the
bytes per device and the all-gather of the owners' new values. What hooks
into Keras's optimizers is in ``keras_replicator._compat.keras_sharded_optimizer``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import keras
import tensorflow as tf

from keras_replicator._validation import ArgumentError
from keras_replicator.collectives import all_gather

# CollectiveGatherV2 takes these dtypes; other floats travel as float32 (exact for bfloat16).
_GATHER_DTYPES = (tf.float16, tf.float32, tf.float64, tf.int32, tf.int64)


def partition(sizes: Sequence[int], num_replicas: int) -> list[int]:
    """Owner replica of each item: sorted-greedy (largest first, to the least loaded).

    The most loaded replica holds at most ``sum(sizes) / num_replicas +
    max(sizes)``; ties go to the lowest replica index, so every process computes
    the same owners.

    Example:
        ```python
        import keras_replicator as kr

        owners = kr.optimizers.partition([100, 60, 50, 40, 10], num_replicas=2)
        print(owners)   # [0, 1, 1, 0, 1]: 140 and 120 elements
        ```

    Args:
        sizes: the number of elements of each variable.
        num_replicas: the number of replicas to share them over.

    Returns:
        One replica index per item, in the order of ``sizes``.
    """
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ArgumentError(f"num_replicas must be a positive integer, got {num_replicas!r}.")
    loads = [0] * num_replicas
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-int(sizes[i]), i)):
        r = min(range(num_replicas), key=lambda r: (loads[r], r))
        owners[i] = r
        loads[r] += int(sizes[i])
    return owners


def variable_components(variable) -> list:
    """The per-device TensorFlow variables behind a Keras or TensorFlow variable."""
    value = getattr(variable, "value", variable)
    values = getattr(value, "values", None)
    if isinstance(values, tuple) and values and isinstance(values[0], tf.Variable):
        return list(values)
    return [value]


def state_bytes_per_device(optimizer: keras.optimizers.Optimizer) -> dict[str, int]:
    """Bytes of an optimizer's variables on each device, summed from where they live.

    A mirrored variable counts once on every device it has a copy on; a
    sharded slot counts on its owner only. A wrapped optimizer's variables
    (``LossScaleOptimizer``, `CrossReplicaOptimizer`) are included.

    Example:
        ```python
        import keras, numpy as np
        import keras_replicator as kr

        strategy = kr.ReplicatorStrategy(shard_optimizer_state=True)
        with strategy.scope():
            model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(16),
                                      keras.layers.Dense(16)])
            model.compile(keras.optimizers.Adam(), "mse")
        model.optimizer.build(model.trainable_variables)
        per_device = kr.optimizers.state_bytes_per_device(model.optimizer)
        # Adam's m and v of 2 x (16 x 16 + 16) floats: 4,352 bytes, half on each replica
        # (plus the mirrored iteration count and learning rate on both)
        ```

    Args:
        optimizer: a built Keras optimizer.

    Returns:
        ``{device name: bytes}``, for every device holding some of its state.
    """
    out: dict[str, int] = {}
    for variable in optimizer.variables:
        for component in variable_components(variable):
            device = tf.DeviceSpec.from_string(component.device).to_string()
            size = int(component.shape.num_elements()) * component.dtype.size
            out[device] = out.get(device, 0) + size
    return out


def gather_owned_values(
    values: Sequence[tf.Tensor], owners: Sequence[int], me: int | tf.Tensor, num_replicas: int
) -> list[tf.Tensor]:
    """Every replica gets each item's value from its owner (in a replica context).

    ``values`` are this replica's values of every item (the weights, which every
    replica holds); the owner's are the up-to-date ones. The owned values are
    flattened into one buffer per dtype, padded to the largest share, and
    all-gathered: one collective per dtype, ``num_replicas`` times the largest
    share in volume. Values are passed through unchanged (bit for bit).

    Example:
        ```python
        import tensorflow as tf

        @tf.function
        def step():
            def replica_step():
                me = kr.replica_id()
                values = [tf.fill([3], tf.cast(me, tf.float32)), tf.fill([2], tf.cast(me, tf.float32))]
                return kr.optimizers.gather_owned_values(values, [0, 1], me, 2)
            return strategy.run(replica_step)

        first, second = strategy.experimental_local_results(step())[0]   # on replica 0
        print(first.numpy(), second.numpy())   # [0. 0. 0.] [1. 1.]: each from its owner
        ```

    Args:
        values: this replica's value of every item (same shapes and dtypes on
            every replica).
        owners: the owner (global replica index) of each item.
        me: this replica's global index: a Python int, or a scalar integer
            tensor (``kr.replica_id()`` in a step traced once).
        num_replicas: the number of replicas taking part.

    Returns:
        Each item's value on its owner, in the order of ``values``.
    """
    values = [tf.convert_to_tensor(v) for v in values]
    if len(values) != len(owners):
        raise ValueError(f"Got {len(values)} values for {len(owners)} owners.")
    static_me = me if isinstance(me, int) else tf.get_static_value(me)
    static_me = None if static_me is None else int(static_me)
    if static_me is None:
        me = tf.cast(me, tf.int32)
    out: list[tf.Tensor] = list(values)
    groups: dict[tf.DType, list[int]] = {}
    for i, value in enumerate(values):
        groups.setdefault(value.dtype, []).append(i)
    for dtype, items in groups.items():
        wire = dtype if dtype in _GATHER_DTYPES else tf.float32
        sizes = {i: int(values[i].shape.num_elements()) for i in items}
        offsets, loads = {}, [0] * num_replicas
        for i in items:
            offsets[i] = loads[owners[i]]
            loads[owners[i]] += sizes[i]
        width = max(loads)
        if width == 0:
            continue

        def pack(owner, items=items, wire=wire, width=width, loads=loads):
            mine = [tf.reshape(tf.cast(values[i], wire), [-1]) for i in items if owners[i] == owner]
            mine.append(tf.zeros([width - loads[owner]], wire))
            return tf.concat(mine, 0)

        if static_me is not None:
            buffer = pack(static_me)
        else:  # one branch per replica, each of the same width
            buffer = tf.switch_case(me, [functools.partial(pack, r) for r in range(num_replicas)])
        rows = tf.reshape(all_gather(buffer[tf.newaxis], axis=0), [-1])
        for i in items:
            start = owners[i] * width + offsets[i]
            out[i] = tf.cast(tf.reshape(rows[start : start + sizes[i]], values[i].shape), dtype)
    return out
