"""Keras's optimizer on variables split over the replicas (FSDP, `model_parallel.fsdp`).

`TFOptimizer._all_reduce_sum_gradients` (keras.src.backend.tensorflow.optimizer;
checked on Keras 3.15), installed, acting only on the variables
`fsdp.replica_slices` marks: their gradient comes out of the gather's gradient
(`fsdp.gather_over_replicas`) already summed over the replicas and cut to the
replica's slice (the reduce-scatter; `IndexedSlices` for a lookup, as on one
device), so it is passed through; the other variables' gradients are
all-reduced by Keras's own method, as before. An optimizer whose instance
overrides the method (`CrossReplicaOptimizer`'s inner one) is not affected.

Their slots are saved and loaded whole by `_compat/sharded_checkpoints.py`.
"""

from __future__ import annotations

from keras.src.backend.tensorflow.optimizer import TFOptimizer

from keras_replicator._compat.keras_optimizer import UPDATE_STEP_REDUCES
from keras_replicator._compat.patching import ScopedPatch
from keras_replicator.model_parallel import fsdp


def _skip_replica_slices(original):
    def _all_reduce_sum_gradients(self, grads_and_vars):
        grads_and_vars = list(grads_and_vars)
        split = [fsdp.replica_slices(v) for _, v in grads_and_vars]
        if not any(split):
            return original(self, grads_and_vars)
        if all(split):
            return grads_and_vars
        reduced = iter(original(self, [gv for gv, s in zip(grads_and_vars, split) if not s]))
        return [gv if s else next(reduced) for gv, s in zip(grads_and_vars, split)]

    return _all_reduce_sum_gradients


PATCHES = (
    ScopedPatch(TFOptimizer, "_all_reduce_sum_gradients", _skip_replica_slices,
                guards=[UPDATE_STEP_REDUCES]),
)
