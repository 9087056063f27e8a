"""The layouts in force while a model is built: which variables become shards, and where.

`ModelSharding` joins a `LayoutMap`'s checked rules (`layout.LayoutRules`) and a
placement (logical device j of each replica for shard j). While it is current,
every `Layer.add_weight` (patched in `_compat/keras_layouts.py`) asks it for the
variable: a variable whose layout names the model axis becomes k shard variables,
each the j-th slice of the initial value the whole variable would have had
(so a sharded model starts from the same weights as the same model on one device
with the same seeds), wrapped in a `ShardedVariable`.

A `ReplicatorStrategy(layout_map=...)` makes one and keeps it current inside its
scope; `ModelSharding.scope()` makes one current without a strategy (a model that
spans k devices of one process, one replica).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import keras
import tensorflow as tf

from keras_replicator.errors import LayoutError, LayoutWarning
from keras_replicator.model_parallel.fsdp import (
    ReplicaShardedVariable,
    assign_replica_slices,
    data_dim,
    mark_replica_slices,
    split_over_replicas,
)
from keras_replicator.model_parallel.layout import (
    DATA_AXIS,
    MODEL_AXIS,
    LayoutRules,
    VariableLayout,
)
from keras_replicator.model_parallel.logical_device import logical_device
from keras_replicator.model_parallel.sharded_variable import DevicePlacement, ShardedVariable

__all__ = ["ModelSharding", "StrategyPlacement", "current", "owner", "sharded_variables"]

# Regularizers whose penalty on the whole tensor is the sum of their penalties on
# its slices: applying them per shard is exact.
_ELEMENTWISE_REGULARIZERS = (keras.regularizers.L1, keras.regularizers.L2, keras.regularizers.L1L2)

_stack: list[ModelSharding] = []
_stack_lock = threading.Lock()
# Set once any variable was sharded: the saving patches skip walking models before.
created_any = threading.Event()
# id(shard) -> (weak reference to it, its placement, its logical device).
_homes: dict[int, tuple] = {}
# id(shard) -> (weak reference to it, weak reference to the whole variable, j).
_owners: dict[int, tuple] = {}


def shard_home(variable) -> tuple[Any, int] | None:
    """`(placement, j)` of a shard variable (its logical device j), else `None`."""
    home = _homes.get(id(variable))
    if home is None or home[0]() is not variable:
        return None
    return home[1], home[2]


def owner(variable) -> tuple[ShardedVariable, int] | None:
    """`(whole, j)` when `variable` is shard j of the `ShardedVariable` `whole`, else `None`."""
    entry = _owners.get(id(variable))
    if entry is None or entry[0]() is not variable:
        return None
    whole = entry[1]()
    return None if whole is None else (whole, entry[2])


def current() -> ModelSharding | None:
    """The sharding in force: the current strategy's, else the innermost `scope()`'s."""
    if tf.distribute.has_strategy():
        sharding = getattr(tf.distribute.get_strategy(), "model_sharding", None)
        if sharding is not None:
            return sharding
    return _stack[-1] if _stack else None


def sharded_variables(layer) -> list[ShardedVariable]:
    """The `ShardedVariable`s `layer` itself created (not its sublayers')."""
    return layer.__dict__.get("_kr_sharded_variables", [])


class ModelSharding:
    """A `LayoutMap` applied to the variables created while it is current.

    Args:
        layout_map: a `keras.distribution.LayoutMap` (axes `batch` and `model`).
        placement: where shard j's variables and ops go; by default the devices
            of the mesh's first row (`DevicePlacement`), one replica.
        model_axis: the name of the mesh's axis that splits a replica's variables.
        data_axis: the name of the mesh's axis over the replicas.
        strict: whether a rule that matches no variable raises `LayoutError` in
            `check_rules` (else a `LayoutWarning`, once).

    Example:
        ```python
        import keras
        from keras_replicator.model_parallel.sharding import ModelSharding

        mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], ["cpu:0", "cpu:1"])
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map["dense/kernel"] = (None, "model")      # column-parallel
        sharding = ModelSharding(layout_map)
        with sharding.scope():
            layer = keras.layers.Dense(4, name="dense")
            layer.build((None, 8))
        [w.path for w in layer.trainable_weights]
        # ['dense/kernel_shard0', 'dense/kernel_shard1', 'dense/bias']
        layer.kernel.shape                                # (8, 4): used whole
        layer(np.ones((1, 8))).shape                      # (1, 4)
        ```
    """

    def __init__(self, layout_map: keras.distribution.LayoutMap, placement: Any = None, *, model_axis: str = MODEL_AXIS,
                 data_axis: str = DATA_AXIS, strict: bool = False):
        self.rules = LayoutRules(layout_map, model_axis=model_axis, data_axis=data_axis)
        self.strict = bool(strict)
        self._warned: set[tuple[str, ...]] = set()
        if placement is None:
            placement = DevicePlacement(self.rules.mesh_devices()[:self.rules.model_size])
        self.placement = placement

    @contextlib.contextmanager
    def scope(self) -> Iterator[ModelSharding]:
        """Makes this sharding current (outside any strategy) and patches `add_weight`."""
        from keras_replicator import _compat
        from keras_replicator._compat import keras_layouts

        _compat.install()
        with _stack_lock:
            _stack.append(self)
        try:
            with keras_layouts.ADD_WEIGHT.scope():
                yield self
        finally:
            with _stack_lock:
                _stack.remove(self)

    def check_all_rules_matched(self, where: str) -> None:
        """Raises `LayoutError` naming a rule that matched no variable (see `LayoutRules`)."""
        self.rules.check_all_rules_matched(where)

    def check_rules(self, where: str) -> None:
        """A rule that matched no variable: `LayoutError` if `strict`, else one `LayoutWarning`.

        The warning is given once per set of unmatched rules (the strategy checks at
        `compile` and again at the first `fit`).
        """
        if self.strict:
            self.rules.check_all_rules_matched(where)
            return
        unmatched = tuple(self.rules.unmatched_rules())
        if unmatched and unmatched not in self._warned:
            self._warned.add(unmatched)
            warnings.warn(self.rules.unmatched_message(where), LayoutWarning, stacklevel=2)

    def add_weight(self, layer, add_weight: Callable, path: str, kwargs: dict):
        """`layer.add_weight(**kwargs)` under the layouts: a variable or a `ShardedVariable`."""
        shape = tuple(int(d) for d in kwargs.get("shape") or ())
        layout = self.rules.resolve(path, shape)
        replica_dim = data_dim(layout, self.rules, self.placement)  # FSDP: split over the replicas
        if layout is None or not (layout.sharded or replica_dim is not None):
            return add_weight(layer, **kwargs)
        _check_shardable(layout, kwargs)
        dtype = kwargs.get("dtype") or layer.variable_dtype
        initializer = kwargs.get("initializer")
        if initializer is None:
            initializer = "glorot_uniform" if "float" in str(dtype) else "zeros"
        initializer = keras.initializers.get(initializer)
        with tf.init_scope():
            # The whole variable's initial value, once (its fans, its seed): shard j
            # starts as its j-th slice, as the one-device model's weight would.
            whole = initializer(shape, dtype=dtype)
            slices = tf.split(whole, layout.num_shards, axis=layout.model_dim) if layout.sharded else [whole]
        name = kwargs.get("name") or path.rsplit("/", 1)[-1]
        shards = []
        for j, part in enumerate(slices):
            # FSDP: every copy is made as replica 0's slice, then given its own.
            first = part if replica_dim is None else split_over_replicas(part, replica_dim, self.rules.data_size)[0]
            shard_kwargs = dict(kwargs, shape=tuple(first.shape), dtype=dtype,
                                name=f"{name}_shard{j}" if layout.sharded else name, initializer=_constant(first))
            with self.placement.variables(j):
                shards.append(add_weight(layer, **shard_kwargs))
            if replica_dim is not None:
                with tf.init_scope():
                    assign_replica_slices(shards[-1], part, replica_dim)
                mark_replica_slices(shards[-1], replica_dim)
            _homes[id(shards[-1])] = (weakref.ref(shards[-1]), self.placement, j)
        if replica_dim is None:
            variable = ShardedVariable(shards, layout.model_dim, path, self.placement)
        else:
            variable = ReplicaShardedVariable(shards, layout.model_dim, replica_dim, path, self.placement)
        for j, shard in enumerate(shards):
            _owners[id(shard)] = (weakref.ref(shard), weakref.ref(variable), j)
        layer.__dict__.setdefault("_kr_sharded_variables", []).append(variable)
        created_any.set()
        return variable


class StrategyPlacement:
    """Shard j under a `ReplicatorStrategy`: logical device j of every replica.

    Variables through `strategy.logical_device_for_variables(j)` (mirrored over the
    replicas), ops through `keras_replicator.logical_device(j)` (the running
    replica's device j; nothing is placed outside a replica).
    """

    def __init__(self, strategy):
        self.strategy = strategy

    @property
    def num_shards(self) -> int:
        return self.strategy.devices_per_replica

    def variables(self, j: int) -> contextlib.AbstractContextManager:
        return self.strategy.logical_device_for_variables(j)

    def ops(self, j: int) -> contextlib.AbstractContextManager:
        return logical_device(j)


def _constant(value: tf.Tensor) -> Callable:
    def initializer(shape, dtype=None):
        return tf.identity(value) if dtype is None else tf.cast(value, dtype)

    return initializer


def _check_shardable(layout: VariableLayout, kwargs: dict) -> None:
    if kwargs.get("constraint") is not None:
        raise LayoutError(
            f"the variable {layout.path!r} has a constraint and LayoutMap rule {layout.rule!r} "
            "shards it: a constraint applied per shard is not the constraint of the whole "
            "(e.g. a norm); remove the constraint or the rule."
        )
    regularizer = keras.regularizers.get(kwargs.get("regularizer"))
    if regularizer is not None and not isinstance(regularizer, _ELEMENTWISE_REGULARIZERS):
        raise LayoutError(
            f"the variable {layout.path!r} has the regularizer {type(regularizer).__name__} and "
            f"LayoutMap rule {layout.rule!r} shards it: only L1/L2 penalties (sums over the "
            "elements) are exact per shard."
        )

