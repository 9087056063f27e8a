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

Random layers inside a recomputed call (`Dropout`): the recomputation draws the
next seed of the layer's `SeedGenerator`, so the gradient is that of another
mask than the forward's, as with `tf.recompute_grad` in eager mode; train such
layers outside the remat scope (`RematScope(mode="list_of_layers", ...)`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import tensorflow as tf
from keras.src.backend.tensorflow import core as tf_backend_core

from keras_replicator._compat.patching import ScopedPatch


def _differentiable(value: Any) -> bool:
    return isinstance(value, tf.Tensor) and value.dtype.is_floating


def remat(f: Callable[..., Any]) -> Callable[..., Any]:
    """`tf.recompute_grad(f)` that takes keyword arguments in graph mode as well."""

    @functools.wraps(f)
    def rematerialized(*args: Any, **kwargs: Any) -> Any:
        flat = tf.nest.flatten((args, kwargs))
        tensors = [value for value in flat if _differentiable(value)]

        def call(*new_tensors: tf.Tensor) -> Any:
            replacements = iter(new_tensors)
            rebuilt = [next(replacements) if _differentiable(v) else v for v in flat]
            new_args, new_kwargs = tf.nest.pack_sequence_as((args, kwargs), rebuilt)
            return f(*new_args, **new_kwargs)

        return tf.recompute_grad(call)(*tensors)

    return rematerialized


PATCHES = [ScopedPatch(tf_backend_core, "remat", lambda original: remat)]
