"""Model parallelism: a replica that spans several devices (TF-Replicator's logical devices).

One engine, in layers that build on each other:

* `mesh`: the device grid, M replicas x k logical devices (`ReplicaMesh`).
* `logical_device`: ops placed on a logical device of the running replica
  (`kr.logical_device(i)`); the variables' side is the strategy's
  `logical_device_for_variables(i)` (its engine: `keras_replicator._compat.engines`).

The strategy's side (`ReplicatorStrategy(devices_per_replica=k)`) and the layouts
(`LayoutMap` rules, sharded variables, the parallel layer rules) land on top of it.
"""

from keras_replicator.model_parallel.logical_device import logical_device
from keras_replicator.model_parallel.mesh import ReplicaMesh

__all__ = ["ReplicaMesh", "logical_device"]
