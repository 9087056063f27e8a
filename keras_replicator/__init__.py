"""keras_replicator: replicated training for Keras 3 on TensorFlow.

Example:
    ```python
    import keras
    import keras_replicator as kr

    kr.simulate_devices(4)            # CPU-only machine: 4 logical devices
    strategy = kr.ReplicatorStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(10)])
        model.compile("adam", "sparse_categorical_crossentropy")
    ```
"""

from keras_replicator import (
    applications,
    callbacks,
    cluster,
    data,
    errors,
    layers,
    optimizers,
    testing,
)
from keras_replicator.async_strategy import AsyncReplicatorStrategy
from keras_replicator.cluster import (
    ClusterConfigError,
    ClusterStartupError,
    DeviceConfigurationError,
    WorkerLostError,
    local_devices,
    simulate_devices,
)
from keras_replicator.collectives import (
    all_gather,
    all_reduce,
    broadcast,
    num_replicas,
    replica_id,
)
from keras_replicator.optimizers import CrossReplicaOptimizer, wrap_optimizer
from keras_replicator.strategy import ReplicatorStrategy

__version__ = "0.1.0"

__all__ = [
    "AsyncReplicatorStrategy",
    "ClusterConfigError",
    "ClusterStartupError",
    "CrossReplicaOptimizer",
    "DeviceConfigurationError",
    "ReplicatorStrategy",
    "all_gather",
    "applications",
    "all_reduce",
    "broadcast",
    "callbacks",
    "cluster",
    "data",
    "errors",
    "layers",
    "local_devices",
    "num_replicas",
    "optimizers",
    "replica_id",
    "simulate_devices",
    "testing",
    "WorkerLostError",
    "wrap_optimizer",
]
