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

import importlib
from typing import TYPE_CHECKING

# The public surface is imported on first use (PEP 562), all of it at once: so
# `keras-replicator --help`, `launch` and `k8s` (keras_replicator/__main__.py), which
# import this package, start without TensorFlow, and after the first `kr.<anything>`
# everything is loaded as with eager imports (Keras registrations included).
_SUBMODULES = ("applications", "callbacks", "cluster", "data", "layers", "optimizers", "testing")
_ATTRIBUTES = {
    "ClusterConfigError": "cluster",
    "ClusterStartupError": "cluster",
    "DeviceConfigurationError": "cluster",
    "WorkerLostError": "cluster",
    "local_devices": "cluster",
    "simulate_devices": "cluster",
    "all_gather": "collectives",
    "all_reduce": "collectives",
    "broadcast": "collectives",
    "num_replicas": "collectives",
    "replica_id": "collectives",
    "CrossReplicaOptimizer": "optimizers",
    "wrap_optimizer": "optimizers",
    "ReplicatorStrategy": "strategy",
    "save_model": "saving",
}


def _load() -> None:
    for name in _SUBMODULES:
        globals()[name] = importlib.import_module(f"{__name__}.{name}")
    for name, module in _ATTRIBUTES.items():
        globals()[name] = getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __getattr__(name: str):
    if name in _SUBMODULES or name in _ATTRIBUTES:
        _load()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from keras_replicator import (  # noqa: F401
        applications,
        callbacks,
        cluster,
        data,
        layers,
        optimizers,
        testing,
    )
    from keras_replicator.cluster import (  # noqa: F401
        ClusterConfigError,
        ClusterStartupError,
        DeviceConfigurationError,
        WorkerLostError,
        local_devices,
        simulate_devices,
    )
    from keras_replicator.collectives import (  # noqa: F401
        all_gather,
        all_reduce,
        broadcast,
        num_replicas,
        replica_id,
    )
    from keras_replicator.optimizers import CrossReplicaOptimizer, wrap_optimizer  # noqa: F401
    from keras_replicator.saving import save_model  # noqa: F401
    from keras_replicator.strategy import ReplicatorStrategy  # noqa: F401

__version__ = "0.1.0"

__all__ = [
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
    "layers",
    "local_devices",
    "num_replicas",
    "optimizers",
    "replica_id",
    "save_model",
    "simulate_devices",
    "testing",
    "WorkerLostError",
    "wrap_optimizer",
]
