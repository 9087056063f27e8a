"""XLA under the strategy: compile what each replica computes, keep what crosses replicas out.

`model.compile(..., jit_compile=True)` under `ReplicatorStrategy` compiles
Keras's train, test and predict steps per replica (see docs/design.md,
"XLA"). `replica_jit` is the same tool for a custom step: it compiles a
per-replica function (forward, loss, gradients) with XLA on the replica's own
device; the cross-replica parts (`kr.all_reduce`, the optimizer's apply, a
`merge_call`) go outside it, after the call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras

from keras_replicator._compat import keras_xla
from keras_replicator._validation import ArgumentError


def replica_jit(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` compiled with XLA (`tf.function(jit_compile=True)`) in each replica.

    Call the result inside a replica function (`strategy.run`, a Keras
    `train_step`) or outside any strategy. Each replica traces and compiles it
    on its own device, reading its own copies of the variables. `fn` must not
    cross replicas: no `kr.all_reduce`/`all_gather`/`broadcast`, no
    `merge_call`, no optimizer `apply` (XLA cannot run TensorFlow's collectives
    between devices; tracing fails). Writes to variables aggregated across
    replicas (plain `BatchNormalization`'s moving statistics under
    `ReplicatorStrategy`) are made after the compiled call, outside XLA. `fn` is
    traced without AutoGraph, as Keras's own steps are: use `tf.cond` and
    `tf.while_loop` for control flow that depends on tensors.

    Example:
        ```python
        import keras
        import tensorflow as tf
        import keras_replicator as kr

        strategy = kr.ReplicatorStrategy()
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            optimizer = keras.optimizers.SGD(0.1)
            optimizer.build(model.trainable_variables)

        @kr.replica_jit
        def gradients(x, y):          # compiled per replica
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x) - y))
            return loss, tape.gradient(loss, model.trainable_variables)

        @tf.function
        def step(x, y):
            def replica_step(x, y):
                loss, grads = gradients(x, y)
                optimizer.apply(grads, model.trainable_variables)  # all-reduce: outside XLA
                return loss
            return strategy.reduce("mean", strategy.run(replica_step, (x, y)), axis=None)

        step(tf.ones((8, 4)), tf.zeros((8, 1)))
        ```
    """
    if not callable(fn):
        raise ArgumentError(f"replica_jit needs a function (callable), got {fn!r}.")
    return keras_xla.replica_compiled(fn)


def compile_layers(*models: Any) -> Any:
    """A context manager: while entered, the models' layers each run compiled per replica.

    For a step that cannot be compiled whole because a layer crosses replicas in
    its forward pass (`kr.layers.GlobalBatchNormalization` all-reduces its
    statistics): every leaf layer of `models` other than those runs its `call`
    as a `replica_jit` function, and the cross-replica layers run between them,
    outside XLA. Gradients through a compiled call are compiled too. Use it
    where the step is traced (inside `train_step` or the replica function).
    Re-entrant, and safe across the strategy's replica threads.

    Example:
        ```python
        import keras
        import keras_replicator as kr

        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                                  kr.layers.GlobalBatchNormalization(), keras.layers.Dense(1)])
        with kr.compile_layers(model):
            y = model(keras.ops.ones((2, 4)), training=True)
        ```
    """
    for model in models:
        if not isinstance(model, keras.Model):
            raise ArgumentError(f"compile_layers takes keras.Model objects, got {model!r}.")
    return keras_xla.layerwise(models)
