"""Keras's optimizers with their state sharded over the replicas (ZeRO stage 1).

Patches, installed (`keras_replicator._compat.install()`), acting only for an
optimizer made under a keras_replicator strategy with
``shard_optimizer_state=True`` (`sharding`); checked on Keras 3.15:

* `TFOptimizer.build`: chooses each trainable variable's owner replica
  (`keras_replicator.optimizers.state_sharding.partition`) before the
  optimizer creates its slots.
* `TFOptimizer.add_variable_from_reference` and `add_variable`: a slot of a
  model variable (found by reference, or by the model variable's name as
  Adafactor's factored moments are) is created on its owner's device only, as
  one whole variable (TensorFlow's `MirroredExtended._create_variable` places a
  variable on one device when its ``colocate_with`` is a `SingleDevice`). A
  non-scalar variable that belongs to no model variable is refused, naming it.
* `TFOptimizer._apply_weight_decay`: deferred to the owner (below).
* `TFOptimizer._backend_update_step` (the TensorFlow backend's all-reduce then
  ``extended.update`` on every replica): all-reduce as before (or not, under a
  `CrossReplicaOptimizer`, which reduced already), then the owner runs weight
  decay and the optimizer's own ``update_step`` on its copy of the variable,
  with the slots, and `gather_owned_values` sends the new values to every
  replica. Reads the replica-local copy of a mirrored variable and the local
  replica index (``values_util``), both private.

Why: tf.distribute mirrors every variable, slots included, so the optimizer
state is stored once per replica; nothing in TensorFlow or Keras shards it.
Whole variables are owned, so ``update_step`` sees a variable of its own shape
(any optimizer works) and every slot is saved whole, in the unsharded format.
Owners are local replicas: on several workers each worker holds the whole
state, shared over its own devices.
"""

from __future__ import annotations

import contextlib
import functools

import tensorflow as tf
from keras.src import backend
from keras.src.backend.tensorflow.optimizer import TFOptimizer
from tensorflow.python.distribute import numpy_dataset, values_util

from keras_replicator._compat.patching import ScopedPatch, ours
from keras_replicator.optimizers.state_sharding import gather_owned_values, partition


def sharding(optimizer) -> bool:
    """Whether `optimizer` keeps its state sharded (made under such a strategy's scope)."""
    strategy = getattr(optimizer, "_distribution_strategy", None)
    return (
        ours(strategy)
        and bool(getattr(strategy, "shard_optimizer_state", False))
        and strategy.num_replicas_in_sync > 1
    )


def _tf_variable(variable):
    return variable.value if isinstance(variable, backend.Variable) else variable


class _Plan:
    """Who owns which model variable; which one the optimizer's build is at."""

    def __init__(self, optimizer, variables):
        strategy = optimizer._distribution_strategy
        self.devices = list(strategy.extended.worker_devices)
        self.first_replica = strategy.extended.worker_index * len(self.devices)
        self.variables = variables
        sizes = [int(v.shape.num_elements() or 0) for v in variables]
        self.owners = partition(sizes, len(self.devices))
        self.index_by_key = {optimizer._var_key(v): i for i, v in enumerate(variables)}
        # The model variable the build is at next: Adafactor makes a variable's factored
        # moments (add_variable) just before its velocity (by reference).
        self.cursor = 0
        self.placing = False

    def owner_of(self, optimizer, variable) -> int | None:
        index = self.index_by_key.get(optimizer._var_key(variable))
        if index is not None:
            self.cursor = index + 1
        return None if index is None else self.owners[index]


@contextlib.contextmanager
def _on_device(strategy, device: str):
    """Variables made in it are made on `device` only (not mirrored), in `strategy`'s scope."""

    def creator(next_creator, **kwargs):
        kwargs["colocate_with"] = numpy_dataset.SingleDevice(device)
        return next_creator(**kwargs)

    inside = tf.distribute.has_strategy() and tf.distribute.get_strategy() is strategy
    with contextlib.nullcontext() if inside else strategy.scope():
        with tf.variable_creator_scope(creator):
            yield


def _build(original):
    @functools.wraps(original)
    def build(self, variables):
        if sharding(self) and not getattr(self, "_kr_plan", None):
            if getattr(self, "use_ema", False):
                raise ValueError(
                    f"Optimizer {self.name!r} has use_ema=True, which shard_optimizer_state=True "
                    "does not support: the moving averages of every weight would be updated on "
                    "every replica. Keep the average in a callback, or turn sharding off."
                )
            self._kr_plan = _Plan(self, list(variables))
            try:
                return original(self, variables)
            except BaseException:
                # Unbuilt again, so that the next build (Keras retries) raises the same error.
                self.built, self._kr_plan = False, None
                raise
        return original(self, variables)

    return build


def _add_variable_from_reference(original):
    @functools.wraps(original)
    def add_variable_from_reference(self, reference_variable, name=None, initializer="zeros"):
        plan = getattr(self, "_kr_plan", None)
        owner = None if plan is None else plan.owner_of(self, reference_variable)
        if owner is None:
            return original(self, reference_variable, name=name, initializer=initializer)
        plan.placing = True
        try:
            with _on_device(self._distribution_strategy, plan.devices[owner]):
                # Past TFOptimizer's override, which would mirror it beside its reference.
                return super(TFOptimizer, self).add_variable_from_reference(
                    reference_variable, name=name, initializer=initializer
                )
        finally:
            plan.placing = False

    return add_variable_from_reference


def _add_variable(original):
    @functools.wraps(original)
    def add_variable(self, shape, *args, name=None, **kwargs):
        plan = getattr(self, "_kr_plan", None)
        if plan is None or plan.placing or tf.TensorShape(shape).rank == 0:
            return original(self, shape, *args, name=name, **kwargs)
        # Adafactor names its factored moments after the model variable it is at.
        at = plan.cursor
        if at >= len(plan.variables) or plan.variables[at].name != name:
            raise ValueError(
                f"Optimizer {self.name!r} creates the variable {name!r} of shape {tuple(shape)}, "
                "which belongs to no model variable, so shard_optimizer_state=True cannot choose "
                "the replica that keeps it. Create slots with "
                "add_variable_from_reference(model_variable), or turn sharding off."
            )
        with _on_device(self._distribution_strategy, plan.devices[plan.owners[at]]):
            return original(self, shape, *args, name=name, **kwargs)

    return add_variable


def _apply_weight_decay(original):
    @functools.wraps(original)
    def _apply_weight_decay(self, variables):
        if getattr(self, "_kr_plan", None) is None:
            return original(self, variables)
        # Applied by each variable's owner in _backend_update_step.

    return _apply_weight_decay


def _sharded_update(self, grads, variables, learning_rate):
    """The owner's update and the all-gather; runs in a replica context."""
    plan = self._kr_plan
    grads_and_vars = self._all_reduce_sum_gradients(list(zip(grads, variables)))
    local = values_util.get_current_replica_id_as_int()
    me = plan.first_replica + local
    n = tf.distribute.get_replica_context().num_replicas_in_sync
    copies, owners = [], []
    for grad, var in grads_and_vars:
        owner = plan.first_replica + plan.owners[plan.index_by_key[self._var_key(var)]]
        copy = var._get() if isinstance(var, tf.distribute.DistributedValues) else var
        if owner == me and grad is not None:
            if self.weight_decay is not None and self._use_weight_decay(var):
                lr = tf.cast(self.learning_rate, copy.dtype)
                copy.assign_sub(copy * tf.cast(self.weight_decay, copy.dtype) * lr)
            self.update_step(grad, copy, learning_rate)
        copies.append(copy)
        owners.append(owner)
    for copy, value, owner in zip(copies, gather_owned_values(copies, owners, me, n), owners):
        if owner != me:
            copy.assign(value)


def _backend_update_step(original):
    @functools.wraps(original)
    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        if getattr(self, "_kr_plan", None) is None:
            return original(self, grads, trainable_variables, learning_rate)
        if tf.distribute.in_cross_replica_context():
            raise ValueError(
                f"Optimizer {self.name!r} keeps its state sharded (shard_optimizer_state=True): "
                "apply() must be called in a replica context, e.g. inside strategy.run() or a "
                "Keras train_step."
            )
        _sharded_update(self, grads, [_tf_variable(v) for v in trainable_variables], learning_rate)

    return _backend_update_step


# Installed by keras_replicator._compat.install(), undone by uninstall().
PATCHES = (
    ScopedPatch(TFOptimizer, "build", _build),
    ScopedPatch(TFOptimizer, "add_variable_from_reference", _add_variable_from_reference),
    ScopedPatch(TFOptimizer, "add_variable", _add_variable),
    ScopedPatch(TFOptimizer, "_apply_weight_decay", _apply_weight_decay),
    ScopedPatch(TFOptimizer, "_backend_update_step", _backend_update_step),
)
