"""Keras's optimizers with their state sharded over the replicas (ZeRO stage 1).

Patches, installed (`keras_replicator._compat.install()`), acting only for an
optimizer made under a keras_replicator strategy with
``shard_optimizer_state=True`` (`sharding`); checked on Keras 3.15:

* `TFOptimizer.build`: chooses each trainable variable's owner replica
  (`keras_replicator.optimizers.state_sharding.partition`) before the
  optimizer creates its slots.
* `TFOptimizer.add_variable_from_reference` and `add_variable`: a slot of a
  model variable (found by reference, or by the model variable's name as
  Adafactor's factored moments are) is created on its owner's device only (the
  owner's logical device that holds the model variable, when a replica spans
  several devices: `ReplicatorStrategy(devices_per_replica=k)`), as
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
On several workers the owners are all the job's replicas: a slot owned on
another worker is an empty placeholder here, and `TFOptimizer.save_own_variables`
/ `load_own_variables` (patched) gather the whole state to write it (every
worker saves together, as the checkpoint callbacks do) and load each worker's
own slots, so the files keep the unsharded format.
"""

from __future__ import annotations

import contextlib
import functools

import tensorflow as tf
from keras.src import backend
from keras.src.backend.tensorflow.optimizer import TFOptimizer
from tensorflow.python.distribute import numpy_dataset, values_util

from keras_replicator._compat import patching
from keras_replicator._compat.keras_optimizer import UPDATE_STEP_REDUCES
from keras_replicator._compat.patching import ScopedPatch, ours
from keras_replicator._validation import ArgumentError
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
    """Who owns which model variable (global replica indices); where the build is at."""

    def __init__(self, optimizer, variables):
        strategy = optimizer._distribution_strategy
        self.strategy = strategy
        self.devices = list(strategy.extended.worker_devices)
        self.first_replica = strategy.extended.worker_index * len(self.devices)
        self.num_replicas = strategy.num_replicas_in_sync
        self.variables = variables
        sizes = [int(v.shape.num_elements() or 0) for v in variables]
        self.owners = partition(sizes, self.num_replicas)
        self.index_by_key = {optimizer._var_key(v): i for i, v in enumerate(variables)}
        # The model variable the build is at next: Adafactor makes a variable's factored
        # moments (add_variable) just before its velocity (by reference).
        self.cursor = 0
        self.placing = False
        # Every sharded slot (by id): its owner and whole shape. A slot whose owner is on
        # another worker is an empty placeholder here (`remote`).
        self.slot_owner: dict[int, int] = {}
        self.slot_shape: dict[int, tuple] = {}
        self.remote: set[int] = set()
        self.gather = None

    def owner_of(self, optimizer, variable) -> int | None:
        index = self.index_by_key.get(optimizer._var_key(variable))
        if index is not None:
            self.cursor = index + 1
        return None if index is None else self.owners[index]

    def local_device(self, owner: int, logical_device: int = 0) -> str | None:
        local = owner - self.first_replica
        if not 0 <= local < len(self.devices):
            return None
        if logical_device == 0:
            return self.devices[local]
        return self.strategy.extended.mesh.device(local, logical_device)

    def logical_device(self, variable) -> int:
        """The logical device of the replicas that holds `variable` (0 unless a replica spans several)."""
        mesh = getattr(self.strategy.extended, "mesh", None)
        variable = _tf_variable(variable)
        if mesh is None or mesh.devices_per_replica == 1 or not isinstance(
            variable, tf.distribute.DistributedValues
        ):
            return 0
        first = variable.values[0].device
        mine = mesh.replica_devices(0)
        return mine.index(first) if first in mine else 0

    def make_slot(self, owner: int, shape, make, reference=None):
        """`make(shape)` on the owner's device (the logical device of `reference`'s copies),
        or an empty placeholder if it is elsewhere."""
        logical = 0 if reference is None else self.logical_device(reference)
        device = self.local_device(owner, logical)
        self.placing = True
        try:
            with _on_device(self.strategy, device or self.devices[0]):
                slot = make(tuple(shape) if device else (0,))
        finally:
            self.placing = False
        self.slot_owner[id(slot)], self.slot_shape[id(slot)] = owner, tuple(shape)
        if device is None:
            self.remote.add(id(slot))
        return slot


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
                raise ArgumentError(
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
        # BaseOptimizer.add_variable_from_reference's naming, past TFOptimizer's override
        # (which would mirror the slot beside its reference).
        prefix = getattr(reference_variable, "path", None) or str(reference_variable.name)
        name = f"{prefix.replace('/', '_').replace(':', '_')}_{name or 'var'}"
        return plan.make_slot(owner, reference_variable.shape, lambda shape: self.add_variable(
            shape, initializer=initializer, dtype=reference_variable.dtype, name=name),
            reference=reference_variable)

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
        return plan.make_slot(plan.owners[at], shape, lambda shape: original(
            self, shape, *args, name=name, **kwargs), reference=plan.variables[at])

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
        owner = plan.owners[plan.index_by_key[self._var_key(var)]]
        copy = var._get() if isinstance(var, tf.distribute.DistributedValues) else var
        if grad is not None and self.weight_decay is not None and self._use_weight_decay(var):
            # Every replica decays its own copy (the owner's value replaces the others'), as
            # unsharded: it needs no data, so it also runs alone in the last step of an epoch
            # of unknown length, as on one device (`exhausted_step`).
            lr = tf.cast(self.learning_rate, copy.dtype)
            copy.assign_sub(copy * tf.cast(self.weight_decay, copy.dtype) * lr)
        if owner == me and grad is not None:
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


def _whole_state(self) -> list:
    """Every optimizer variable's whole value (a collective: every worker calls it together)."""
    plan = self._kr_plan
    variables = self.variables
    slots = [i for i, v in enumerate(variables) if id(v) in plan.slot_owner]
    owners = [plan.slot_owner[id(variables[i])] for i in slots]
    if plan.gather is None:

        @tf.function
        def gather():
            def replica_gather():
                me = plan.first_replica + values_util.get_current_replica_id_as_int()
                values = [
                    variables[i].value.read_value() if owner == me
                    else tf.zeros(plan.slot_shape[id(variables[i])], variables[i].dtype)
                    for i, owner in zip(slots, owners)
                ]
                return gather_owned_values(values, owners, me, plan.num_replicas)

            return plan.strategy.run(replica_gather)

        plan.gather = gather
    whole = [v.numpy() for v in plan.strategy.experimental_local_results(plan.gather())[0]]
    out = [None if id(v) in plan.slot_owner else v.numpy() for v in variables]
    for i, value in zip(slots, whole):
        out[i] = value
    return out


def _save_own_variables(original):
    @functools.wraps(original)
    def save_own_variables(self, store):
        plan = getattr(self, "_kr_plan", None)
        if plan is None or not plan.remote:
            return original(self, store)
        # Slots owned on other workers are gathered: the file has the unsharded format.
        for i, value in enumerate(_whole_state(self)):
            store[str(i)] = value

    return save_own_variables


def _load_own_variables(original):
    @functools.wraps(original)
    def load_own_variables(self, store):
        plan = getattr(self, "_kr_plan", None)
        if plan is None or not plan.remote or len(store.keys()) != len(self.variables):
            return original(self, store)  # (a count that differs: Keras's own warning)
        for i, variable in enumerate(self.variables):
            if id(variable) not in plan.remote:  # another worker loads that one
                variable.assign(store[str(i)])

    return load_own_variables


# Installed by keras_replicator._compat.install(), undone by uninstall().
# What the sharded update replaces: Keras's update, reached through `_backend_update_step`
# (which sums the gradients: the sharded update reduces them itself).
_APPLIES_THROUGH_UPDATE_STEP = patching.calls(
    "keras BaseOptimizer._backend_apply_gradients (calls self._backend_update_step)",
    lambda: TFOptimizer._backend_apply_gradients, "_backend_update_step")

PATCHES = (
    ScopedPatch(TFOptimizer, "build", _build),
    ScopedPatch(TFOptimizer, "add_variable_from_reference", _add_variable_from_reference),
    ScopedPatch(TFOptimizer, "add_variable", _add_variable),
    ScopedPatch(TFOptimizer, "_apply_weight_decay", _apply_weight_decay),
    ScopedPatch(TFOptimizer, "_backend_update_step", _backend_update_step,
                guards=[UPDATE_STEP_REDUCES, _APPLIES_THROUGH_UPDATE_STEP]),
    ScopedPatch(TFOptimizer, "save_own_variables", _save_own_variables),
    ScopedPatch(TFOptimizer, "load_own_variables", _load_own_variables),
)
