"""Keras's optimizers under `CrossReplicaOptimizer`.

* `skip_optimizer_gradient_all_reduce` overrides, on one optimizer instance, the
  private `TFOptimizer._all_reduce_sum_gradients` (keras.src.backend.tensorflow;
  checked on Keras 3.15): the wrapped optimizer must not sum gradients a second time.
* `PATCHES` patch `LossScaleOptimizer.__init__` (installed by
  `keras_replicator._compat.install()`, which `CrossReplicaOptimizer` calls
  before any exists; it acts only when the optimizer it wraps is a
  `CrossReplicaOptimizer`, whose class says so with `reduces_gradients = True`
  (`reduces_gradients`)): a loss scale outside the wrapper is refused when it
  is made, with the fix in the message.
"""

from __future__ import annotations

import functools

import keras
from keras.src.backend.tensorflow.optimizer import TFOptimizer

from keras_replicator._compat import patching
from keras_replicator._compat.patching import ScopedPatch
from keras_replicator._validation import ArgumentError

# What `skip_optimizer_gradient_all_reduce`, `keras_fsdp` and `keras_sharded_optimizer`
# rely on: Keras's update step sums the gradients through `_all_reduce_sum_gradients`
# (skipped, or replaced, by them). If it stopped calling it, gradients would be reduced
# twice or not at all, without an error.
UPDATE_STEP_REDUCES = patching.calls(
    "keras TFOptimizer._backend_update_step (calls self._all_reduce_sum_gradients)",
    lambda: TFOptimizer._backend_update_step, "_all_reduce_sum_gradients")


def _already_reduced(grads_and_vars):
    return list(grads_and_vars)


def skip_optimizer_gradient_all_reduce(optimizer) -> None:
    """Stops a Keras optimizer (and the ones it wraps) summing gradients across replicas.

    Why (Keras 3.15, TF backend): ``TFOptimizer._backend_update_step`` calls
    ``self._all_reduce_sum_gradients`` (a replica-context all-reduce) before every
    update. ``CrossReplicaOptimizer`` reduces the gradients itself (accumulated,
    compressed, once per update) and hands the result to the wrapped optimizer,
    which must then not sum them a second time. We override that method on the
    instance with the identity; the wrapped optimizer belongs to the wrapper from
    then on. ``LossScaleOptimizer`` has no reduction of its own: we follow
    ``inner_optimizer`` down to the optimizer that does the update. If a Keras
    version renames the method, fail loudly rather than reduce twice.
    """
    UPDATE_STEP_REDUCES.verify("keras_replicator's CrossReplicaOptimizer")
    opt = optimizer
    while opt is not None:
        if isinstance(opt, TFOptimizer):
            if not callable(getattr(type(opt), "_all_reduce_sum_gradients", None)):
                raise patching.IncompatiblePatchError(
                    "This Keras version has no TFOptimizer._all_reduce_sum_gradients; "
                    "keras_replicator's CrossReplicaOptimizer needs updating for it."
                )
            opt._all_reduce_sum_gradients = _already_reduced
        opt = getattr(opt, "inner_optimizer", None)


def reduces_gradients(optimizer) -> bool:
    """Whether `optimizer` all-reduces gradients itself (keras_replicator's `CrossReplicaOptimizer`)."""
    return bool(getattr(type(optimizer), "reduces_gradients", False))


def _refuse_outer_loss_scale_optimizer(original):
    """`LossScaleOptimizer(opt)` raises when `reduces_gradients(opt)`.

    Why: the loss scale must see the all-reduced gradient, so that every
    replica makes the same finite/non-finite decision; wrapped the other way
    round it sees one replica's. Keras itself adds the outer
    `LossScaleOptimizer` in `compile` under a "mixed_float16" policy.
    """

    @functools.wraps(original)
    def __init__(self, inner_optimizer, *args, **kwargs):
        if reduces_gradients(inner_optimizer):
            raise ArgumentError(
                "A LossScaleOptimizer cannot wrap a CrossReplicaOptimizer: the order must be the "
                "other way round, so that the loss scale sees the all-reduced gradient: "
                "CrossReplicaOptimizer(keras.optimizers.LossScaleOptimizer(opt)). With a "
                "'mixed_float16' policy, also pass model.compile(..., auto_scale_loss=False), "
                "or Keras adds the outer LossScaleOptimizer itself."
            )
        original(self, inner_optimizer, *args, **kwargs)

    return __init__


# Installed by keras_replicator._compat.install(), undone by uninstall().
PATCHES = (
    ScopedPatch(keras.optimizers.LossScaleOptimizer, "__init__", _refuse_outer_loss_scale_optimizer),
)
