"""The optimizer wrapper of TF-Replicator and Horovod, and the pieces it is made of.

* `CrossReplicaOptimizer` (alias `wrap_optimizer`): wraps a Keras optimizer
  and all-reduces gradients once per update, with accumulation, compression,
  clipping and skipping of non-finite steps.
* `state_sharding`: the optimizer state sharded over the replicas
  (``ReplicatorStrategy(shard_optimizer_state=True)``): `partition`,
  `state_bytes_per_device`, `gather_owned_values`.
* `gradient_transforms`: those pieces on their own (`GradientAccumulator`,
  `clip_by_global_norm`, `NonFiniteSkip`, `compress`), for custom steps.

Example:
    ```python
    import keras
    import keras_replicator as kr

    strategy = kr.ReplicatorStrategy()
    with strategy.scope():
        optimizer = kr.optimizers.CrossReplicaOptimizer(
            keras.optimizers.SGD(0.1, momentum=0.9), accumulation_steps=2)
    ```
"""

from keras_replicator.optimizers.cross_replica import CrossReplicaOptimizer, wrap_optimizer
from keras_replicator.optimizers.gradient_transforms import (
    GradientAccumulator,
    NonFiniteSkip,
    all_finite,
    clip_by_global_norm,
    compress,
    decompress,
)
from keras_replicator.optimizers.state_sharding import (
    gather_owned_values,
    partition,
    state_bytes_per_device,
)

__all__ = [
    "CrossReplicaOptimizer",
    "GradientAccumulator",
    "NonFiniteSkip",
    "all_finite",
    "clip_by_global_norm",
    "compress",
    "decompress",
    "gather_owned_values",
    "partition",
    "state_bytes_per_device",
    "wrap_optimizer",
]
