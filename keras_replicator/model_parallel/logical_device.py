"""`logical_device(i)`: ops placed on logical device `i` of the replica running them.

TF-Replicator's ``ReplicaContext.logical_device(i)`` (tensorflow/community
`rfcs/20181016-replicator.md`): inside a replica that spans several devices
(`ReplicatorStrategy(devices_per_replica=k)`), the ops made under it run on that
replica's logical device `i`, so a replica's work is spread over its devices by
hand (pipeline-style model parallelism).
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from keras_replicator._compat.patching import ours
from keras_replicator._validation import check_int

__all__ = ["logical_device"]


def logical_device(index: int) -> contextlib.AbstractContextManager:
    """Ops made in it run on logical device `index` of the current replica.

    In a replica (``strategy.run``, or Keras's ``train_step``/``call`` under
    `ReplicatorStrategy(devices_per_replica=k)`), replica ``r``'s logical device
    ``index`` is its device ``r * k + index`` (`ReplicatorStrategy.mesh`); with
    ``k = 1``, index 0 is the replica's own device. Outside a replica (in the
    strategy's scope, as when Keras builds a model symbolically, or with no
    strategy) it places nothing: the code runs as on one device, so one model
    definition serves both.

    Example:
        ```python
        strategy = kr.ReplicatorStrategy(devices_per_replica=2)   # 1 replica of 2 devices

        @tf.function
        def step(x):
            def replica_step(x):
                with kr.logical_device(0):
                    h = x * 2.0
                with kr.logical_device(1):
                    y = h + 1.0          # runs on the replica's second device
                return y

            return strategy.run(replica_step, args=(x,))

        step(tf.ones([2]))               # [3., 3.]
        ```

    Args:
        index: the logical device, ``0 .. devices_per_replica - 1`` under a
            keras_replicator strategy.

    Raises:
        ArgumentError: `index` is not a logical device of the current strategy.
    """
    strategy = tf.distribute.get_strategy()
    if not ours(strategy):
        check_int("logical_device", index, minimum=0)
        return contextlib.nullcontext()
    extended = strategy.extended
    index = extended.check_logical_device(index)
    context = tf.distribute.get_replica_context()
    if context is None or extended.devices_per_replica == 1:
        return contextlib.nullcontext()
    device = extended.replica_device(context, index)
    return contextlib.nullcontext() if device is None else tf.device(device)
