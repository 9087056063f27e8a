"""Keras's own distribution API (`keras.distribution`) on TensorFlow, run by `ReplicatorStrategy`.

After `import keras_replicator`, a script written for Keras's distribution API
on JAX runs on TensorFlow unchanged:

```python
keras.distribution.set_distribution(keras.distribution.DataParallel())
model = ...; model.compile(...); model.fit(...)   # replicated, no strategy.scope()
```

`set_distribution(DataParallel(devices=...))` (or its `scope()`) makes the
calling thread enter the scope of a `ReplicatorStrategy` over those devices, as
if the rest of the script were inside `with strategy.scope():` (Keras's setting
is per thread too): the models built and compiled afterwards have mirrored
variables and `fit`, `evaluate` and `predict` run replicated, the global batch
split over the replicas as JAX's `DataParallel` shards it. The same devices
give the same strategy, so a model keeps training after the distribution is set
again. `set_distribution(None)` leaves the scope: models built afterwards are
plain Keras ones (the models built before keep their strategy, as on JAX).
`keras.utils.clear_session()` ends it too, as it ends Keras's setting.

`set_distribution(ModelParallel(layout_map=...))` runs on
`ReplicatorStrategy(layout_map=...)` (tensor parallelism over the mesh's model
axis, data parallelism over its batch axis; see the guide "Model parallelism");
a bad layout raises `LayoutError` in `set_distribution`. A rule of its
`LayoutMap` that matches no variable gives a `LayoutWarning` (Keras's semantics);
to make it a `LayoutError`, get the distribution's strategy once with
`strategy_for(distribution, strict_layouts=True)` before `set_distribution`.

What it cannot do raises `ArgumentError` in `set_distribution`, before Keras's
setting changes: devices that are not this process's, a multi-process
distribution (`keras.distribution.initialize`: use `keras-replicator launch`
and `ReplicatorStrategy` instead), another strategy's scope already entered.
"""

from __future__ import annotations

import re
import threading
from typing import Any

import keras
import tensorflow as tf

from keras_replicator._compat import keras_distribution, keras_trainer
from keras_replicator._validation import ArgumentError, check_bool
from keras_replicator.strategy import ReplicatorStrategy

__all__ = ["strategy_for"]

# One strategy per tuple of devices, so that setting a DataParallel of the same
# devices again finds the strategy its models' variables belong to.
_strategies: dict[tuple, tuple[ReplicatorStrategy, Any]] = {}
_lock = threading.Lock()
# The scope this thread entered for its Keras distribution: (strategy, scope, the default
# graph it was entered in: `keras.utils.clear_session()` replaces that graph).
_entered = threading.local()

_DEVICE = re.compile(r"^(?:.*/)?(?:device:)?(cpu|gpu):(\d+)$", re.IGNORECASE)


def _tensorflow_device(name: Any) -> str:
    """`"cpu:1"` (Keras's spelling) -> `"/device:CPU:1"`, if it is a local logical device."""
    local = [d.name for d in tf.config.list_logical_devices()]
    match = _DEVICE.match(str(name))
    wanted = f"/device:{match.group(1).upper()}:{match.group(2)}" if match else None
    for device in local:
        if wanted is not None and device.endswith(wanted):
            return wanted
    raise ArgumentError(
        f"keras.distribution's device {str(name)!r} is not a device of this process: "
        f"ReplicatorStrategy replicates over this process's devices ({', '.join(local)}). "
        "Name them as keras.distribution.list_devices() does, e.g. 'cpu:0'."
    )


def _check(distribution: Any) -> tuple | None:
    """(kind, key, value) of the strategy `distribution` runs on (`None` for none), or the error.

    A `DataParallel`'s key is its devices; a `ModelParallel`'s is its `LayoutMap`
    (by identity: the layouts the strategy applies).
    """
    if distribution is None:
        return None
    if isinstance(distribution, keras.distribution.ModelParallel):
        layouts = keras_distribution.layout_map(distribution)
        return ("layout_map", id(layouts), layouts)  # a LayoutMap is not hashable
    if not isinstance(distribution, keras.distribution.DataParallel):
        raise ArgumentError(
            "set_distribution on TensorFlow takes keras.distribution.DataParallel, ModelParallel "
            f"or None, got {distribution!r}."
        )
    if distribution.num_processes > 1:  # never on TensorFlow in Keras 3.15 (no num_processes there)
        raise ArgumentError(
            "a multi-process keras.distribution (keras.distribution.initialize) is not bridged "
            "to TensorFlow: start the workers with `keras-replicator launch` (or TF_CONFIG) and "
            "use kr.ReplicatorStrategy(), which finds them."
        )
    # Keras 3.15 itself refuses a DataParallel of a 2-D mesh (its warning raises a TypeError).
    mesh = distribution.device_mesh
    devices = tuple(_tensorflow_device(d) for d in mesh.devices.flatten())
    if len(set(devices)) != len(devices):
        raise ArgumentError(f"DataParallel's devices repeat a device: {list(mesh.devices)}.")
    return ("devices", devices, devices)


def strategy_for(distribution: keras.distribution.Distribution, *,
                 strict_layouts: bool | None = None) -> ReplicatorStrategy:
    """The `ReplicatorStrategy` that runs a Keras `DataParallel` distribution on TensorFlow.

    `keras.distribution.set_distribution` enters its scope for you; this gives
    the strategy itself, e.g. for `strategy.distribute_dataset`, a custom loop,
    or to check what a distribution will do. The same devices give the same
    strategy. A distribution this bridge cannot run raises `ArgumentError`.

    Example:
        ```python
        import keras
        import keras_replicator as kr

        data_parallel = keras.distribution.DataParallel(devices=["cpu:0", "cpu:1"])
        strategy = kr.keras_distribution.strategy_for(data_parallel)
        print(strategy.num_replicas_in_sync)                      # 2
        keras.distribution.set_distribution(data_parallel)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        print(model.distribute_strategy is strategy)             # True
        keras.distribution.set_distribution(None)                # plain Keras again
        ```

    A `ModelParallel`'s strategy made here with ``strict_layouts=True`` raises
    `LayoutError` for a rule of its `LayoutMap` that matches no variable, instead
    of a `LayoutWarning`; `set_distribution` of the same `ModelParallel` (after
    this call) runs on that strategy.

    Args:
        distribution: a `keras.distribution.DataParallel`, over the default
            devices (`keras.distribution.list_devices()`) or those it names, or
            a `keras.distribution.ModelParallel` (its `LayoutMap`'s mesh).
        strict_layouts: a `ModelParallel`'s strategy's `strict_layouts` (see
            `ReplicatorStrategy`), given when the strategy is first made;
            ``None``: the strategy already made, else ``False``.

    Returns:
        The strategy over those devices, in the order the mesh lists them.
    """
    key = _check(distribution)
    if key is None:
        raise ArgumentError("strategy_for takes a keras.distribution.DataParallel or ModelParallel, "
                            "got None.")
    kind, key, value = key
    if strict_layouts is not None:
        strict_layouts = check_bool("strict_layouts", strict_layouts)
        if strict_layouts and kind == "devices":
            raise ArgumentError("strict_layouts=True checks a ModelParallel's LayoutMap; a DataParallel has none.")
    with _lock:
        if (kind, key) not in _strategies:
            # A bad layout raises LayoutError here, before Keras's setting changes.
            _strategies[kind, key] = (
                ReplicatorStrategy(devices=list(value)) if kind == "devices"
                else ReplicatorStrategy(layout_map=value, strict_layouts=bool(strict_layouts)),
                value)  # the value kept alive with its id
        strategy = _strategies[kind, key][0]
    sharding = strategy.model_sharding
    if strict_layouts is not None and sharding is not None and sharding.strict != strict_layouts:
        raise ArgumentError(
            f"this ModelParallel's strategy was made with strict_layouts={sharding.strict}; "
            f"strict_layouts={strict_layouts} must be given the first time (before set_distribution)."
        )
    return strategy


def _leave() -> None:
    entered = getattr(_entered, "value", None)
    if entered is None:
        return
    strategy, scope, graph = entered
    _entered.value = None
    try:
        scope.__exit__(None, None, None)
    except IndexError:
        # keras.utils.clear_session() reset TensorFlow's default graph, and the scope's
        # entry with it (as it reset Keras's distribution); the scope's patches are left.
        if graph is tf.compat.v1.get_default_graph():
            raise
    # Models built from now on are plain Keras ones: no "fit runs on one device" warning.
    keras_trainer.unregister_strategy(strategy)


def _forget_a_cleared_scope() -> None:
    """Leaves a scope whose entry `keras.utils.clear_session()` erased with the default graph."""
    entered = getattr(_entered, "value", None)
    if entered is not None and entered[2] is not tf.compat.v1.get_default_graph():
        _leave()


def follow(distribution: Any, set_distribution: Any) -> None:
    """Sets Keras's distribution with `set_distribution` and enters or leaves the matching scope.

    Called by the patched `keras.distribution.set_distribution`
    (`_compat.keras_distribution`). Every check runs before Keras's setting
    changes, so a distribution that cannot run leaves everything as it was.
    """
    strategy = None if distribution is None else strategy_for(distribution)
    _forget_a_cleared_scope()
    entered = getattr(_entered, "value", None)
    current = entered[0] if entered is not None else None
    top = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
    if strategy is not current and top is not current:
        # TensorFlow's scopes are a stack: ours can be entered or left only at its top.
        raise ArgumentError(
            f"set_distribution({distribution!r}) inside the scope of {top!r}: leave that "
            "scope first (a model belongs to one strategy)."
        )
    set_distribution(distribution)
    if strategy is current:
        return
    _leave()
    if strategy is not None:
        keras_trainer.register_strategy(strategy)
        scope = strategy.scope()
        scope.__enter__()
        _entered.value = (strategy, scope, tf.compat.v1.get_default_graph())


# The patched `keras.distribution.set_distribution` (`_compat.keras_distribution`) calls `follow`.
keras_distribution.register(follow)
