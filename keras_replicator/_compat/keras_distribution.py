"""`keras.distribution.set_distribution` on TensorFlow: `DataParallel` and `ModelParallel` run on `ReplicatorStrategy`.

Patches `set_distribution` where Keras defines it
(`keras/src/distribution/distribution_lib.py`, which its `Distribution.scope()`
also calls) and where Keras's public API binds it (`keras.distribution`,
`keras.src.distribution`, and `keras._tf_keras.keras.distribution`). Installed
when `keras_replicator` is imported (and by every strategy), with the Keras-API
set of `_compat`; it acts only when called, and then only for the distribution
it is given. Checked on Keras 3.15 with TF 2.21.

Why: on TensorFlow Keras only stores the distribution (a per-thread global);
nothing reads it to place variables or to replicate `fit` (only the JAX backend
calls `get_variable_layout`; `backend/tensorflow/distribution_lib.py` is a
prototype whose `distribute_value` is a `TODO`). A script written for JAX's
`DataParallel` trains on one device, and a `ModelParallel`'s layouts are
ignored, silently.

How: the replacement checks the distribution first (`keras_replicator.
keras_distribution`: errors for what it cannot run, before Keras's setting
changes), calls Keras's `set_distribution`, then enters (or leaves) the calling
thread's scope of the `ReplicatorStrategy` over the distribution's devices (a
`ModelParallel`: over its `LayoutMap`, which Keras keeps in `_layout_map`):
Keras's TensorFlow trainer takes the strategy in scope when a model is made, and
variables made in the scope are mirrored, as with `with strategy.scope():`.

Also `distribute_tensor` (same modules), installed with it: Keras's front end calls
its backend's `distribute_tensor`, which the TensorFlow backend lacks (Keras 3.15:
`AttributeError`); KerasHub's `CausalLM.generate` calls it on its inputs whenever a
distribution is set. In a keras_replicator strategy's scope it returns the tensor
as it is (the strategy places data itself; `generate` reads the variables where
they live); elsewhere Keras's function runs.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

from keras_replicator._compat import patching
from keras_replicator._compat.patching import ScopedPatch

# Every module that binds Keras's `set_distribution`, the defining one first.
_MODULES = (
    "keras.src.distribution.distribution_lib",
    "keras.src.distribution",
    "keras.distribution",
    "keras._tf_keras.keras.distribution",
)


# `keras_replicator.keras_distribution.follow(distribution, keras_set_distribution)`, handed
# over by that module when it is imported (`register`): this module does not import it.
_follow: list[Callable[[Any, Callable[[Any], None]], None]] = []


def register(follow: Callable[[Any, Callable[[Any], None]], None]) -> None:
    """Hands over what a patched `set_distribution` calls (`keras_replicator.keras_distribution`)."""
    _follow[:] = [follow]


def _follow_or_keras(value: Any) -> None:
    if _follow:
        _follow[0](value, _keras_set_distribution())
    else:  # nothing registered: Keras's own behaviour
        _keras_set_distribution()(value)


def _replacement(original: Callable[[Any], None]) -> Callable[[Any], None]:
    @functools.wraps(original)
    def set_distribution(value: Any) -> None:
        # Keras's own function, whichever module's binding was called.
        _follow_or_keras(value)

    return set_distribution


def _distribute_tensor(original: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    @functools.wraps(original)
    def distribute_tensor(tensor: Any, layout: Any) -> Any:
        import tensorflow as tf

        if tf.distribute.has_strategy() and patching.ours(tf.distribute.get_strategy()):
            return tensor
        return original(tensor, layout)

    return distribute_tensor


def layout_map(distribution: Any) -> Any:
    """A `keras.distribution.ModelParallel`'s `LayoutMap` (Keras keeps it private)."""
    return distribution._layout_map


def _keras_set_distribution() -> Callable[[Any], None]:
    """Keras's own `set_distribution`, patched or not."""
    return patching.original(importlib.import_module(_MODULES[0]), "set_distribution")


def follow_current() -> None:
    """Follows the distribution Keras already holds (one set before the patch was installed)."""
    import keras

    current = keras.distribution.distribution()
    if current is not None:
        _follow_or_keras(current)


def _patches() -> list[ScopedPatch]:
    patches = []
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # keras._tf_keras is optional in some builds
            continue
        if hasattr(module, "set_distribution"):
            patches.append(ScopedPatch(module, "set_distribution", _replacement))
        if hasattr(module, "distribute_tensor"):
            patches.append(ScopedPatch(module, "distribute_tensor", _distribute_tensor))
    return patches


PATCHES = _patches()
