"""XLA (`jit_compile`) under keras_replicator's strategies.

Why: Keras 3.15 compiles `fit`'s step as one `tf.function(jit_compile=True)`
around `strategy.run`, so a single XLA cluster placed on replica 0's device
would read every replica's variable components, and fails at the first step
("Trying to access resource .../replica_1/... located in device CPU:1 from
device CPU:0"), stock `MirroredStrategy` and ours alike. And its
`jit_compile="auto"` turns XLA off under any tf.distribute strategy
(`keras/src/trainers/trainer.py`: "Disable XLA with tf.distribute").

What we do instead, for keras_replicator's strategies only:

* `replica_compiled(fn)`: `fn` as a `tf.function(jit_compile=True)` called
  inside each replica (each replica traces it under its own device, so it reads
  its own variable components). Writes to variables that are aggregated across
  replicas (a `MirroredVariable` with `aggregation` other than `NONE`: plain
  `BatchNormalization`'s moving statistics under our strategy) are a
  synchronisation point that cannot run inside XLA: they are taken out of the
  compiled function (it returns the values) and made after it, in the replica
  context, where TensorFlow all-reduces them as before. This patches
  `keras.src.backend.tensorflow.core.Variable._direct_assign` (every Keras
  `assign`/`assign_add`/`assign_sub` goes through it), permanently, acting only
  while such a function is being traced.
* `TensorFlowTrainer._make_function` (train and test steps): the outer
  function around `strategy.run` is built without `jit_compile`; Keras's own
  `train_step` is split into a compiled part (forward, loss, gradients, loss
  and metric states) and the optimizer's `apply_gradients` (the gradient
  all-reduce and the cross-replica update) after it; Keras's own `test_step`
  is compiled whole. A model whose layers all-reduce in their forward pass
  (`GlobalBatchNormalization`: marked `_keras_replicator_cross_replica_call`)
  is compiled layer by layer instead: every other leaf layer's `call` is a
  `replica_compiled` function, the cross-replica layer runs outside XLA.
  A model that overrides `train_step`/`test_step` is left to compile its own
  per-replica parts (`keras_replicator.replica_jit`) when it sets
  `_keras_replicator_jit_aware = True` (the SN-GAN and D4PG models); otherwise
  its step runs without XLA, with a warning.
* `Trainer._resolve_auto_jit_compile` (`jit_compile="auto"`): under our
  strategies, what Keras decides for one device (XLA when the machine has a
  device other than a CPU and `model_supports_jit`), for the steps we can compile.

Keras's `make_predict_function` already compiles `predict_step` inside
`strategy.run` (per replica): it is left as it is.

Checked on Keras 3.15 (TensorFlow 2.21).
"""

from __future__ import annotations

import functools
import threading
import warnings

import tensorflow as tf
from keras.src import tree
from keras.src.backend.common import stateless_scope
from keras.src.backend.tensorflow import core as tf_core
from keras.src.backend.tensorflow import trainer as tf_trainer
from keras.src.losses import loss as loss_module
from keras.src.trainers import trainer as base_trainer
from keras.src.trainers.data_adapters import data_adapter_utils

from keras_replicator._compat import patching
from keras_replicator._compat.patching import ScopedPatch, ours

CROSS_REPLICA_CALL = "_keras_replicator_cross_replica_call"
JIT_AWARE = "_keras_replicator_jit_aware"

_tracing = threading.local()


def _aggregated(variable) -> bool:
    """Whether writing `variable` in a replica is a cross-replica synchronisation."""
    value = getattr(variable, "_value", None)
    if not isinstance(value, tf.distribute.DistributedValues):
        return False
    return (
        value.synchronization != tf.VariableSynchronization.ON_READ
        and value.aggregation != tf.VariableAggregation.NONE
    )


def _deferred_assign(original):
    @functools.wraps(original)
    def _direct_assign(self, value):
        deferred = getattr(_tracing, "deferred", None)
        if deferred is not None and _aggregated(self):
            deferred.append((self, value))
            return
        original(self, value)

    return _direct_assign


def refuse_collective_in_compiled(name: str) -> None:
    """Raises a clear error when a cross-replica primitive is traced inside `replica_compiled`."""
    if getattr(_tracing, "deferred", None) is not None:
        raise RuntimeError(
            f"{name} inside an XLA-compiled replica function (kr.replica_jit, or the replica "
            "step of jit_compile=True): XLA cannot run TensorFlow's collectives between "
            "devices. Call it outside the compiled function (compile the parts before and "
            "after it separately), or use kr.compile_layers for a model whose layers cross "
            "replicas."
        )


def replica_compiled(fn):
    """`fn`, compiled with XLA in each replica, its aggregated variable writes made after it."""
    written: dict[int, list] = {}

    def traced(*args, **kwargs):
        outer = getattr(_tracing, "deferred", None)
        _tracing.deferred = []
        try:
            outputs = fn(*args, **kwargs)
            deferred = _tracing.deferred
        finally:
            _tracing.deferred = outer
        written[0] = [variable for variable, _ in deferred]
        return outputs, [value for _, value in deferred]

    # No autograph (as Keras's own step functions): converting `traced` mixed up the closures
    # of two instances (one learner's compiled function called another method of it).
    compiled = tf.function(traced, jit_compile=True, reduce_retracing=True, autograph=False)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        outputs, values = compiled(*args, **kwargs)
        for variable, value in zip(written.get(0, []), values):
            variable.assign(value)
        return outputs

    return call


# --- layer by layer (models whose forward pass crosses replicas) ---------------------

_layer_lock = threading.Lock()
_layer_depth: dict[int, int] = {}


def _compiled_call(call):
    """A layer's `call` compiled, except inside a `StatelessScope` (a wrapper such as
    spectral normalization maps the layer's weights to tensors of the caller's graph,
    which a cached compiled function must not capture)."""
    compiled = replica_compiled(call)

    @functools.wraps(call)
    def dispatch(*args, **kwargs):
        if stateless_scope.in_stateless_scope():
            return call(*args, **kwargs)
        return compiled(*args, **kwargs)

    return dispatch


def _leaf_layers(model) -> list:
    layers = []
    for layer in model._flatten_layers(include_self=False):
        if getattr(layer, CROSS_REPLICA_CALL, False) or not getattr(layer, "supports_jit", True):
            continue
        if not list(layer._flatten_layers(include_self=False)):
            layers.append(layer)
    return layers


def crosses_replicas(model) -> bool:
    """Whether a layer of `model` all-reduces in its forward pass."""
    return any(getattr(layer, CROSS_REPLICA_CALL, False) for layer in model._flatten_layers())


class layerwise:
    """While entered (re-entrant, across replica threads): `model`'s leaf layers compiled."""

    def __init__(self, models):
        self.models = models

    def __enter__(self):
        with _layer_lock:
            for model in self.models:
                depth = _layer_depth.get(id(model), 0)
                if depth == 0:
                    for layer in _leaf_layers(model):
                        if "_keras_replicator_jit_call" not in vars(layer):
                            layer._keras_replicator_jit_call = _compiled_call(layer.call)
                        layer.call = layer._keras_replicator_jit_call
                _layer_depth[id(model)] = depth + 1
        return self

    def __exit__(self, *exc):
        with _layer_lock:
            for model in self.models:
                depth = _layer_depth[id(model)] - 1
                _layer_depth[id(model)] = depth
                if depth == 0:
                    for layer in _leaf_layers(model):
                        vars(layer).pop("call", None)
        return False


# --- Keras's train and test steps -----------------------------------------------------


def _first_input(x):
    return next(i for i in tree.flatten(x) if i is not None)


# `_keras_train_compute` and `_split_train_step` are Keras's `TensorFlowTrainer.train_step`
# cut in two: its source's fingerprint on each Keras checked (3.8-3.11 take the first input
# as `tree.flatten(x)[0]`, 3.12+ the first one not None, as the copy does). Another source
# is refused: Keras changed its step, and the copy would silently drop the change.
TRAIN_STEP_FINGERPRINTS = {
    "3.8.0": "5ba4b231aa0966a7", "3.9.2": "5ba4b231aa0966a7", "3.10.0": "5ba4b231aa0966a7",
    "3.11.3": "5ba4b231aa0966a7", "3.12.4": "f6ecb19499b554c4", "3.13.2": "f6ecb19499b554c4",
    "3.14.1": "f6ecb19499b554c4", "3.15.1": "f6ecb19499b554c4",
}
TRAIN_STEP = patching.same_source(
    "keras TensorFlowTrainer.train_step (copied by keras_xla)",
    lambda: tf_trainer.TensorFlowTrainer.train_step, TRAIN_STEP_FINGERPRINTS)


def _keras_train_compute(model):
    """Keras 3.15's `train_step` up to the gradients (the part compiled with XLA)."""

    def compute(data):
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True) if model._call_has_training_arg else model(x)
            loss = model._compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
            )
            model._loss_tracker.update_state(
                loss_module.unscale_loss_for_distribution(loss),
                sample_weight=tf.shape(_first_input(x))[0],
            )
            if model.optimizer is not None:
                loss = model.optimizer.scale_loss(loss)
        gradients = tape.gradient(loss, model.trainable_weights) if model.trainable_weights else []
        return gradients, model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    return compute


def _split_train_step(model, compile_fn):
    compute = compile_fn(_keras_train_compute(model))

    def train_step(data):
        gradients, logs = compute(data)
        if model.trainable_weights:
            model.optimizer.apply_gradients(zip(gradients, model.trainable_weights))
        else:
            warnings.warn("The model does not have any trainable weights.", stacklevel=2)
        return logs

    return train_step


def _is_keras_step(step_function, name: str) -> bool:
    return getattr(step_function, "__func__", None) is getattr(tf_trainer.TensorFlowTrainer, name)


def _compiled_step(model, step_function):
    """The per-replica step to run under `strategy.run` when `model.jit_compile` is on."""
    name = getattr(step_function, "__name__", "")
    if getattr(model, JIT_AWARE, False):
        return step_function
    if _is_keras_step(step_function, "train_step") or _is_keras_step(step_function, "test_step"):
        if crosses_replicas(model):
            scope = layerwise([model])

            def compile_fn(fn):
                def run(data):
                    with scope:
                        return fn(data)

                return run
        else:
            compile_fn = replica_compiled
        if name == "train_step":
            return _split_train_step(model, compile_fn)
        return compile_fn(step_function)
    warnings.warn(
        f"jit_compile=True under {model.distribute_strategy!r}: the model's own {name} runs "
        "without XLA. Compile its per-replica computation (forward, loss, gradients; not the "
        "optimizer's apply, which crosses replicas) with keras_replicator.replica_jit.",
        stacklevel=3,
    )
    return step_function


def _per_replica_make_function(original):
    @functools.wraps(original)
    def _make_function(self, step_function):
        if not (ours(self._distribute_strategy) and self.jit_compile and not self.run_eagerly):
            return original(self, step_function)
        step_function = _compiled_step(self, step_function)
        self._jit_compile = False  # the outer function around strategy.run: no XLA
        try:
            return original(self, step_function)
        finally:
            self._jit_compile = True

    return _make_function


def compilable(model) -> bool:
    """Whether we compile `model`'s steps with XLA under our strategy."""
    if getattr(model, JIT_AWARE, False):
        return True
    cls = type(model)
    return (
        cls.train_step is tf_trainer.TensorFlowTrainer.train_step
        and cls.test_step is tf_trainer.TensorFlowTrainer.test_step
    )


def _auto_as_one_device(original):
    @functools.wraps(original)
    def _resolve_auto_jit_compile(self):
        if not ours(getattr(self, "_distribute_strategy", None)):
            return original(self)
        if not any(d.device_type != "CPU" for d in tf.config.list_physical_devices()):
            return False  # as Keras: no XLA on CPU-only machines
        return base_trainer.model_supports_jit(self) and compilable(self)

    return _resolve_auto_jit_compile


# Installed by keras_replicator._compat.install(), undone by uninstall().
PATCHES = (
    ScopedPatch(tf_core.Variable, "_direct_assign", _deferred_assign),
    ScopedPatch(tf_trainer.TensorFlowTrainer, "_make_function", _per_replica_make_function,
                guards=[TRAIN_STEP]),
    ScopedPatch(base_trainer.Trainer, "_resolve_auto_jit_compile", _auto_as_one_device),
)
