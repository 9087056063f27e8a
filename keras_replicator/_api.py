"""The public surface of `keras_replicator`, imported by the package's `__init__`."""

from keras_replicator import (
    applications,
    callbacks,
    cluster,
    cross_device_ops,
    data,
    errors,
    keras_distribution,
    layers,
    model_parallel,
    optimizers,
    resume,
    schedules,
    testing,
)
from keras_replicator.async_strategy import AsyncReplicatorStrategy
from keras_replicator.cluster import local_devices, simulate_devices
from keras_replicator.collectives import (
    all_gather,
    all_reduce,
    broadcast,
    global_real_rows,
    num_replicas,
    real_rows,
    replica_id,
)
from keras_replicator.cross_device_ops import PackedReductionToOneDevice
from keras_replicator.errors import (
    ClusterConfigError,
    ClusterStartupError,
    DeviceConfigurationError,
    WorkerLostError,
)
from keras_replicator.model_parallel import logical_device
from keras_replicator.optimizers import CrossReplicaOptimizer, wrap_optimizer
from keras_replicator.saving import save_model
from keras_replicator.strategy import ReplicatorStrategy
from keras_replicator.xla import compile_layers, replica_jit

# Sorted; the exceptions users catch most are also here (the rest are in `kr.errors`),
# and `wrap_optimizer` is TF-Replicator's name for `CrossReplicaOptimizer`.
__all__ = [
    "AsyncReplicatorStrategy",
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
    "compile_layers",
    "cross_device_ops",
    "data",
    "errors",
    "global_real_rows",
    "keras_distribution",
    "layers",
    "local_devices",
    "logical_device",
    "model_parallel",
    "num_replicas",
    "optimizers",
    "real_rows",
    "replica_id",
    "replica_jit",
    "resume",
    "save_model",
    "schedules",
    "simulate_devices",
    "testing",
    "wrap_optimizer",
]
