"""The one place where keras_replicator touches private TensorFlow and Keras APIs.

Every name imported from ``tensorflow.python`` lives here, with the reason and
the versions it was checked on (TensorFlow 2.16 to 2.21, Keras 3.15). Other
modules import from here, never from ``tensorflow.python`` directly, so that a
TensorFlow upgrade is a change to one file.
"""

from __future__ import annotations

import tensorflow as tf

# MirroredExtended / CollectiveAllReduceExtended are the in-graph (one worker)
# and between-graph (many workers) replication engines behind the public
# strategies; ReplicatorStrategy reuses them instead of re-implementing replica
# threads, device placement and cross-device reductions.
from tensorflow.python.distribute import (  # noqa: F401  (re-exported)
    collective_all_reduce_strategy,
    cross_device_ops,
    cross_device_utils,
    distribute_lib,
    mirrored_strategy,
)
from tensorflow.python.eager import context as _context
from tensorflow.python.framework import ops as _ops
from tensorflow.python.ops import control_flow_util, resource_variable_ops

MirroredExtended = mirrored_strategy.MirroredExtended
CollectiveAllReduceExtended = collective_all_reduce_strategy.CollectiveAllReduceExtended
StrategyBase = distribute_lib.Strategy  # == tf.distribute.Strategy


def tensorflow_initialized() -> bool:
    """True once TensorFlow's runtime context (and so its device list) exists.

    ``tf.config.set_logical_device_configuration`` only works before this point.
    """
    return _context.context()._context_handle is not None  # TF 2.16-2.21


class _ExecutionOrderedLauncher(cross_device_utils.CollectiveReplicaLauncher):
    """A collective launcher whose instance keys follow execution, not tracing.

    Why (TF 2.16-2.21): inside TF2 functions, stock launchers feed each
    collective's instance key at call time through
    ``FuncGraph.capture_call_time_value``. That deferred capture is lost when
    the traced function is later called from a control-flow branch of an outer
    function, which Keras 3 does in two common cases: ``steps_per_execution > 1``
    (a ``tf.cond`` in a ``tf.while_loop`` around ``strategy.run``), and any step
    that creates variables on its first call (TensorFlow wraps the traced step in
    a ``tf.cond`` on "variables initialised"), e.g. a GAN's optimizers built
    lazily in ``train_step``. Both fail with "You must feed a value for
    placeholder tensor" (keras-team/keras#19246), on stock MirroredStrategy too.

    Here each launcher keeps an execution counter in a host variable and the key
    of a collective is ``base + counter.assign_add(1)``. Every replica (and every
    worker) runs the same sequence of collectives on its device, so the keys
    agree; they depend on what ran, not on when each process traced, so a worker
    that retraces alone does not fall out of step (the reason TF abandoned
    trace-time keys).
    """

    _KEY_BASE = 1 << 30  # above the keys TensorFlow hands out from Python

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        host = tf.DeviceSpec.from_string(self._device).replace(device_type="CPU", device_index=0)
        with _ops.init_scope(), _ops.device(host.to_string()):
            self._executions = resource_variable_ops.ResourceVariable(
                tf.constant(0, tf.int64), trainable=False, name="collective_executions"
            )

    def _next_instance_key(self):
        if (
            _context.executing_eagerly()
            or not self._use_unique_instance_key()
            or control_flow_util.GraphOrParentsInXlaContext(_ops.get_default_graph())
        ):
            return super()._next_instance_key()
        with _ops.device(self._executions.device):
            count = self._executions.assign_add(1, read_value=True)
            return tf.cast(self._KEY_BASE + count % self._KEY_BASE, tf.int32)


def make_control_flow_safe(ops_obj):
    """Gives a ``CollectiveAllReduce`` cross-device ops object execution-ordered keys.

    Replaces its launchers (``_launchers``, TF 2.16-2.21) in place; other cross
    device ops (reduction to one device, NCCL batch ops) need no fix.
    """
    if isinstance(ops_obj, cross_device_ops.CollectiveAllReduce):
        launchers = ops_obj._launchers
        for i, old in enumerate(launchers):
            if type(old) is cross_device_utils.CollectiveReplicaLauncher:
                launchers[i] = _ExecutionOrderedLauncher(
                    old._group_key, old._group_size, old._collective_keys, old._device, old._options
                )
    return ops_obj


def is_distributed_values(value) -> bool:
    return isinstance(value, tf.distribute.DistributedValues)


# --- Keras 3 (checked on 3.15) -------------------------------------------------


def _first_replica(strategy, value):
    if isinstance(value, tf.distribute.DistributedValues):
        return strategy.experimental_local_results(value)[0]
    return value


def install_keras_patches() -> None:
    """Makes Keras 3's TensorFlow trainer work with ``ReplicatorStrategy``.

    ``TensorFlowTrainer._maybe_symbolic_build`` (Keras 3.x) builds the model from
    one distributed batch by ``strategy.reduce("MEAN", batch, axis=None)``: an
    element-wise mean of every replica's slice. That fails when the slices
    differ in size (a short last batch: "Inputs to operation AddN must have the
    same size and shape") and, across workers, on structures of PerReplica
    values (tensorflow/tensorflow#72388). The build only needs the shapes and
    dtypes of one example batch, so for our strategies we take replica 0's slice.
    Other strategies keep Keras's behaviour. Idempotent.
    """
    from keras.src.backend.tensorflow import trainer as tf_trainer

    original = tf_trainer.TensorFlowTrainer._maybe_symbolic_build
    if getattr(original, "_keras_replicator_patch", False):
        return

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if iterator is None or not getattr(strategy, "_keras_replicator", False):
            return original(self, iterator=iterator, data_batch=data_batch)
        for _, _, it in iterator:
            batch = next(it)
            data_batch = tf.nest.map_structure(lambda v: _first_replica(strategy, v), batch)
            break
        with strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    _maybe_symbolic_build._keras_replicator_patch = True
    tf_trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
