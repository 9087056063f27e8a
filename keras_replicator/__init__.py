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

from keras_replicator import testing
from keras_replicator.cluster import DeviceConfigurationError, local_devices, simulate_devices
from keras_replicator.collectives import (
    all_gather,
    all_reduce,
    broadcast,
    num_replicas,
    replica_id,
)
from keras_replicator.strategy import ReplicatorStrategy

__version__ = "0.1.0"

__all__ = [
    "DeviceConfigurationError",
    "ReplicatorStrategy",
    "all_gather",
    "all_reduce",
    "broadcast",
    "local_devices",
    "num_replicas",
    "replica_id",
    "simulate_devices",
    "testing",
]
