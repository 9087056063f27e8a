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
in a closure, as the call received it. Variables read by `f` get their
gradients through `tf.custom_gradient`'s variable tracking, as before.

Random layers inside a recomputed layer (`Dropout`, `GaussianNoise`, ...): a
plain recomputation would draw the next seeds of their `SeedGenerator`s (Keras
advances a generator's state at each draw), so the gradient would be that of
another mask than the forward's (measured: a Dense + Dropout(0.5) MLP's weights
0.27 away from the run without remat after 8 steps). The replacement reads the
states of the seed generators of the layer and its sublayers
(`Layer._flatten_layers`, `Layer._seed_generators`) before the forward; the
recomputation sets them back to those values, recomputes (the same seeds, so the
same masks) and then puts back the states it found, so the draws after it are
those of a run without remat. A function given to `keras.remat` directly (not a
layer's `call`) has no known generators: its random draws are not replayed.

Not bitwise reproducible under Grappler's dependency optimizer: 8 of 267 runs
of a small MLP ended up to 2.8e-3 away from the others (0 of 71 without remat,
0 of 140 with that optimizer off); cause not found (docs/keras_distribution.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf
from keras.src.backend.tensorflow import core as tf_backend_core

from keras_replicator._compat.patching import ScopedPatch


def _differentiable(value: Any) -> bool:
    return isinstance(value, tf.Tensor) and value.dtype.is_floating


def _seed_generators(f: Callable[..., Any]) -> list:
    """The seed generators of the layer whose method `f` is, and of its sublayers."""
    owner = getattr(f, "__self__", None)
    if not isinstance(owner, keras.layers.Layer):
        return []
    return [g for layer in owner._flatten_layers() for g in layer._seed_generators]


def _states(generators: list) -> list[tf.Tensor]:
    return [g.state.value * 1 for g in generators]  # `* 1`: a read now, as Keras's `next`


def _set_states(generators: list, states: list[tf.Tensor]) -> None:
    for generator, state in zip(generators, states):
        generator.state.assign(state)


def remat(f: Callable[..., Any]) -> Callable[..., Any]:
    """`tf.recompute_grad(f)` that takes keyword arguments in graph mode as well."""

    @functools.wraps(f)
    def rematerialized(*args: Any, **kwargs: Any) -> Any:
        flat = tf.nest.flatten((args, kwargs))
        tensors = [value for value in flat if _differentiable(value)]
        generators = _seed_generators(f)
        before = _states(generators)
        forward_done = []

        def call(*new_tensors: tf.Tensor) -> Any:
            replacements = iter(new_tensors)
            rebuilt = [next(replacements) if _differentiable(v) else v for v in flat]
            new_args, new_kwargs = tf.nest.pack_sequence_as((args, kwargs), rebuilt)
            if not forward_done or not generators:
                forward_done.append(True)
                return f(*new_args, **new_kwargs)
            # The recomputation: the forward's seeds again, then the states as they are now.
            now = _states(generators)
            _set_states(generators, before)
            outputs = f(*new_args, **new_kwargs)
            with tf.control_dependencies([o for o in tf.nest.flatten(outputs) if tf.is_tensor(o)]):
                _set_states(generators, now)
            return outputs

        return tf.recompute_grad(call)(*tensors)

    return rematerialized


PATCHES = [ScopedPatch(tf_backend_core, "remat", lambda original: remat)]
