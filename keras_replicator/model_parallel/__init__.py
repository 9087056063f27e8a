"""Model parallelism: a replica that spans several devices (TF-Replicator's logical devices).

One engine, in layers that build on each other:

* `mesh`: the device grid, M replicas x k logical devices (`ReplicaMesh`).
* `logical_device`: ops placed on a logical device of the running replica
  (`kr.logical_device(i)`); the variables' side is the strategy's
  `logical_device_for_variables(i)` (its engine: `keras_replicator._compat.engines`).

* `layout`: a Keras `LayoutMap`'s rules, matched as Keras does, with clear errors
  (`LayoutRules`).
* `sharded_variable`: a variable stored as k shards, used as one tensor (`ShardedVariable`).
* `sharding`: the layouts in force while a model is built (`ModelSharding`; the strategy's
  `ReplicatorStrategy(layout_map=...)` makes one).
* `parallel_layers`: the layers computed on shards (column/row-parallel, embeddings, attention
  by heads); their Keras side is `keras_replicator._compat.keras_layouts`.
* `memory`: bytes per device, from where each variable lives.
"""

from keras_replicator._compat import model_parallel_hooks as _hooks
from keras_replicator.model_parallel import fsdp as _fsdp
from keras_replicator.model_parallel import parallel_layers as _parallel_layers
from keras_replicator.model_parallel import sharding as _sharding
from keras_replicator.model_parallel import whole_state as _whole_state
from keras_replicator.model_parallel.layout import LayoutRules
from keras_replicator.model_parallel.logical_device import logical_device
from keras_replicator.model_parallel.memory import bytes_per_device, training_bytes_per_device
from keras_replicator.model_parallel.mesh import ReplicaMesh
from keras_replicator.model_parallel.sharded_variable import ShardedVariable
from keras_replicator.model_parallel.sharding import ModelSharding

# `_compat`'s layout and checkpoint patches call these: handed over here, so that `_compat`
# never imports the public side (no import cycle; `_compat.model_parallel_hooks`).
_hooks.register(sharding=_sharding, fsdp=_fsdp, parallel_layers=_parallel_layers,
                whole_state=_whole_state, sharded_variable=ShardedVariable)

__all__ = ["LayoutRules", "ModelSharding", "ReplicaMesh", "ShardedVariable", "bytes_per_device",
           "logical_device", "training_bytes_per_device"]
