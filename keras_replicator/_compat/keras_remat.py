"""`keras.RematScope` and `keras.remat` on TensorFlow: recompute in graph mode too.

Patches `keras.src.backend.tensorflow.core.remat` (the TensorFlow backend's
`remat`, which `keras.remat` and every layer under a `RematScope` call through
`keras/src/backend/common/remat.py` and `Operation.rematerialized_call`).
Installed when `keras_replicator` is imported (and by every strategy, through
`_compat.install()`), with the Keras-API set of `_compat`; it acts for every
caller, with or without a strategy, since the unpatched function fails
everywhere outside eager execution. Checked on Keras 3.15 with TF 2.21.

Why: Keras returns `tf.recompute_grad(f)`, a `tf.custom_gradient`, and a layer
calls it with keyword arguments (`training=`, `mask=`). In graph mode (every
`fit`, `evaluate`, `predict`, any `tf.function`) TensorFlow's custom gradient
refuses keywords: "The custom_gradient decorator currently supports keywords
arguments only when eager execution is enabled" (keras#21207), on one device as
under any strategy.

How: the replacement still uses `tf.recompute_grad` (TensorFlow's own
recomputation: the forward runs without recording, the gradient re-runs `f`
under a tape). The call's floating-point tensors, wherever they are in the
positional or keyword arguments, become the recomputed function's positional
arguments, so their gradients flow (a keyword `value=` of an attention layer
included); everything else (flags, `None`, integer and boolean masks) is bound
in a closure, as the call received it. Variables that `f` reads itself (a
plain function's) get their gradients through `tf.custom_gradient`'s variable
tracking.

The layer's state is read once, before the forward, and both runs see those
values: a layer's variables (its own and its sublayers', the states of their
seed generators included: `Layer.variables`) are read, and the forward and the
recomputation run under `keras.StatelessScope` mapping each variable to its value
read then. The trainable ones' values are positional arguments of the
recomputed function too, so their gradients reach the variables through those
reads, as without remat (where the backward pass uses the forward's reads).
The forward's assignments (a seed generator's next state,
`BatchNormalization`'s moving statistics) and `add_loss` losses are applied once,
after it; the recomputation's are discarded, so it draws the forward's dropout masks again
and updates nothing twice. The recomputation runs under the layer's autocast
scope of the forward (mixed precision: the tape runs it after the layer's call
has returned, where float32 variables would otherwise be read as float32).

Why not let `tf.recompute_grad` read the variables again in the gradient: that
read can come after the optimizer's update of the same variable. TensorFlow's
automatic control dependencies order it with a control edge (read before
update), and Grappler's dependency optimizer removes that edge with TensorFlow's
default settings: its transitive reduction finds another path from the read to
the update, through `IdentityN` nodes (the custom gradients' and the optimizer's;
the path enters an `IdentityN` at one input and leaves at another output), then
it bypasses those `IdentityN` nodes (each consumer wired to its own input), which
cuts that path. Left unordered is, for example, the last `Dense`'s kernel read
for the gradient of its input (`dy @ kernel^T`), so when the update runs first the
layers below it get the gradient of the updated kernel (found by running Grappler
on the traced step: `tests/test_remat.py`; measured, the same seeded fit: 10 of
200 remat runs up to 4.0e-3 away from the run without remat before, 0 of 400
after: docs/keras_distribution.md). With the reads made once before the
forward, each read feeds the forward's output, hence the loss
and the variable's own gradient: a data path to its update, as without remat.

A function given to `keras.remat` directly (not a layer or a layer's method)
has no known variables: `tf.recompute_grad` reads whatever it reads again in the
gradient, and its random draws are not replayed. Layers not yet built run as
such a function (their variables are made by the call), and so do all calls in a
strategy's cross-replica context (Keras's symbolic build: nothing is
differentiated there, and an FSDP shard's copies differ). A trainable variable
of the layer that its call does not read gets a zero gradient instead of none.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf
from keras.src import backend as keras_backend
from keras.src.backend.tensorflow import core as tf_backend_core

from keras_replicator._compat.patching import ScopedPatch


def _differentiable(value: Any) -> bool:
    return isinstance(value, tf.Tensor) and value.dtype.is_floating


def _built_layer(f: Callable[..., Any]) -> keras.layers.Layer | None:
    """The built layer that `f` is, or whose method `f` is, when its state can be read per replica.

    In a strategy's cross-replica context (Keras's symbolic build of a model) a variable has no
    one value (an FSDP shard's copies differ; they are read by their components there), and
    nothing is differentiated: the call runs as a plain function's.
    """
    if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
        return None
    owner = f if isinstance(f, keras.layers.Layer) else getattr(f, "__self__", None)
    return owner if isinstance(owner, keras.layers.Layer) and owner.built else None


def _read(variable: keras.Variable) -> tf.Tensor:
    """The variable's value now, as stored (the scope's reads autocast it, as a variable's do)."""
    with keras_backend.AutocastScope(None):
        return tf.convert_to_tensor(variable.value)


def _calling(f: Callable[..., Any], args: tuple, kwargs: dict) -> Callable[..., Any]:
    """`f` of the call's float tensors, given positionally; the rest of the call as it came."""
    flat = tf.nest.flatten((args, kwargs))

    def call(*tensors: tf.Tensor) -> Any:
        replacements = iter(tensors)
        rebuilt = [next(replacements) if _differentiable(v) else v for v in flat]
        new_args, new_kwargs = tf.nest.pack_sequence_as((args, kwargs), rebuilt)
        return f(*new_args, **new_kwargs)

    return call


def _recompute_with_state_read_once(layer: keras.layers.Layer, call: Callable[..., Any],
                                    tensors: list[tf.Tensor]) -> Any:
    """`tf.recompute_grad(call)(*tensors)`, the layer's variables read once, before the forward."""
    variables = layer.variables
    values = [_read(v) for v in variables]
    # Positional, so their gradients reach the variables through these reads.
    differentiated = [i for i, v in enumerate(variables) if v.trainable and _differentiable(values[i])]
    forward: list = []  # the forward's StatelessScope and its mapping before the call
    # The layer's autocast (mixed precision), which the recomputation, run by the tape's
    # gradient after the layer's call has returned, would otherwise lose.
    autocast = keras_backend.get_autocast_scope()

    def stateless(*inputs: tf.Tensor) -> Any:
        state = list(values)
        for i, value in zip(differentiated, inputs[len(tensors):]):
            state[i] = value
        with keras.StatelessScope(list(zip(variables, state)), collect_losses=not forward,
                                  initialize_variables=False) as scope, \
                keras_backend.AutocastScope(autocast.dtype if autocast else None):
            before = dict(scope.state_mapping)
            outputs = call(*inputs[:len(tensors)])
        forward.append((scope, before))
        return outputs

    outputs = tf.recompute_grad(stateless)(*tensors, *[values[i] for i in differentiated])
    # The forward's assignments and losses, once (the recomputation's are dropped).
    scope, before = forward[0]
    for variable in variables:
        if scope.state_mapping[id(variable)] is not before[id(variable)]:
            variable.assign(scope.state_mapping[id(variable)])
    for loss in scope.losses:
        layer.add_loss(loss)
    return outputs


def remat(f: Callable[..., Any]) -> Callable[..., Any]:
    """`tf.recompute_grad(f)` that takes keyword arguments in graph mode, a layer's state read once."""

    @functools.wraps(f)
    def rematerialized(*args: Any, **kwargs: Any) -> Any:
        tensors = [value for value in tf.nest.flatten((args, kwargs)) if _differentiable(value)]
        call = _calling(f, args, kwargs)
        layer = _built_layer(f)
        if layer is None:
            return tf.recompute_grad(call)(*tensors)
        return _recompute_with_state_read_once(layer, call, tensors)

    return rematerialized


# `core.remat` (keras.remat, keras.RematScope) is from Keras 3.9: on 3.8 there is nothing to patch.
PATCHES = [ScopedPatch(tf_backend_core, "remat", lambda original: remat, optional=True)]
