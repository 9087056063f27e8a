"""Checks users want too: replicas identical, models equal, weights compared.

Example:
    ```python
    import keras, numpy as np
    import keras_replicator as kr

    x = np.random.rand(64, 4).astype("float32")
    y = np.random.rand(64, 1).astype("float32")

    def make_model():
        keras.utils.set_random_seed(0)                 # the same initial weights
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        return model

    strategy = kr.ReplicatorStrategy()
    with strategy.scope():
        model = make_model()
    reference = make_model()                          # one device
    for m in (model, reference):
        m.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    kr.testing.assert_replicas_identical(model)     # every mirrored copy equal
    assert kr.testing.max_weight_difference(model, reference) <= 1e-5
    ```
"""

from __future__ import annotations

from collections.abc import Iterable

import keras
import numpy as np
import tensorflow as tf

from keras_replicator._validation import ArgumentError


def _tf_variable(v):
    """The TensorFlow variable behind a Keras 3 variable (or ``v`` itself)."""
    return getattr(v, "value", v) if isinstance(v, keras.Variable) else v


def replica_values(variable) -> list[np.ndarray]:
    """The value of ``variable`` on each local replica, in replica order.

    A variable created outside any strategy has one value.

    Example:
        ```python
        copies = kr.testing.replica_values(model.weights[0])
        ```
    """
    v = _tf_variable(variable)
    if isinstance(v, tf.distribute.DistributedValues):
        return [np.asarray(x.numpy()) for x in v.values]
    return [np.asarray(keras.ops.convert_to_numpy(variable))]


def _variables(obj) -> list:
    if isinstance(obj, (keras.Model, keras.layers.Layer)):
        return list(obj.weights)
    if isinstance(obj, keras.optimizers.Optimizer):
        return list(obj.variables)
    return list(obj)


def assert_replicas_identical(obj: keras.Model | Iterable, atol: float = 0.0) -> None:
    """Raises ``AssertionError`` naming the first variable whose replica copies differ.

    Args:
        obj: a model, layer, optimizer or a list of variables.
        atol: tolerated absolute difference (0: bit-identical).

    Example:
        ```python
        kr.testing.assert_replicas_identical(model)
        kr.testing.assert_replicas_identical(model.optimizer)
        ```
    """
    for var in _variables(obj):
        values = replica_values(var)
        for i, other in enumerate(values[1:], start=1):
            diff = np.max(np.abs(other.astype(np.float64) - values[0].astype(np.float64)), initial=0.0)
            if not diff <= atol:
                raise AssertionError(
                    f"Variable {getattr(var, 'path', getattr(var, 'name', var))!r} differs between "
                    f"replica 0 and replica {i}: max abs difference {diff:g} > {atol:g}."
                )


def max_weight_difference(a: keras.Model | Iterable, b: keras.Model | Iterable) -> float:
    """Largest absolute difference between corresponding weights of ``a`` and ``b``.

    Compares replica 0's copy of each variable; the two must have the same
    weights in the same order and shapes.

    Example:
        ```python
        kr.testing.max_weight_difference(model, reference)   # the largest |a - b| of any weight
        ```
    """
    va, vb = _variables(a), _variables(b)
    if len(va) != len(vb):
        raise ArgumentError(f"Different numbers of weights: {len(va)} vs {len(vb)}.")
    worst = 0.0
    for x, y in zip(va, vb):
        x0, y0 = replica_values(x)[0], replica_values(y)[0]
        if x0.shape != y0.shape:
            raise ArgumentError(f"Shapes differ for {getattr(x, 'path', x)}: {x0.shape} vs {y0.shape}.")
        worst = max(worst, float(np.max(np.abs(x0.astype(np.float64) - y0.astype(np.float64)), initial=0.0)))
    return worst
