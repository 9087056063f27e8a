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
    cross_device_ops,
    data,
    errors,
    layers,
    optimizers,
    schedules,
    testing,
)
from keras_replicator.cluster import local_devices, simulate_devices
from keras_replicator.collectives import (
    all_gather,
    all_reduce,
    broadcast,
    num_replicas,
    replica_id,
)
from keras_replicator.cross_device_ops import PackedReductionToOneDevice
from keras_replicator.errors import (
    ClusterConfigError,
    ClusterStartupError,
    DeviceConfigurationError,
    WorkerLostError,
)
from keras_replicator.optimizers import CrossReplicaOptimizer, wrap_optimizer
from keras_replicator.strategy import ReplicatorStrategy

__version__ = "0.1.0"

# Sorted; the exceptions users catch most are also
# here (the rest are in `kr.errors`), and `wrap_optimizer` is TF-Replicator's name.
__all__ = [
    "ClusterConfigError",
    "ClusterStartupError",
    "CrossReplicaOptimizer",
    "DeviceConfigurationError",
    "PackedReductionToOneDevice",
    "ReplicatorStrategy",
    "WorkerLostError",
    "all_gather",
    "all_reduce",
    "applications",
    "broadcast",
    "callbacks",
    "cluster",
    "cross_device_ops",
    "data",
    "errors",
    "layers",
    "local_devices",
    "num_replicas",
    "optimizers",
    "replica_id",
    "schedules",
    "simulate_devices",
    "testing",
    "wrap_optimizer",
]
