"""Keras 3's TensorFlow trainer under keras_replicator's strategies.

Patches `keras.src.backend.tensorflow.trainer` (checked on Keras 3.15):

* `TensorFlowTrainer._maybe_symbolic_build`: builds from replica 0's slice
  (not an element-wise mean of the slices), and not at all for a model without
  `call()` (keras-io's GAN style), as Keras does without a strategy; from the
  dataset's `element_spec` rather than a batch read eagerly, without tracing a
  built functional model again, and not at all once everything is built;
* `reduce_per_replica`: metrics and `predict` rows across every worker;
* `TFEpochIterator.__init__`: an infinite dataset without a step count is refused; the
  dataset it distributes is marked as Keras's (`short_batches.keras_distributing`: its
  slices carry their real rows, replica 0's spec is the slice's);
* `TFEpochIterator._enumerate_iterator`: after `BackupAndRestore` restored a backup
  written mid-epoch (at a preemption), the first epoch skips the data of the steps
  already done (`resume_current_fit_at`);
* `TensorFlowTrainer.fit` / `evaluate` / `predict` / `*_on_batch`: one wrapper that
  hands a model built under `AsyncReplicatorStrategy` to `parameter_server`, and else,
  before any work, catches a model built outside the strategy's scope (an
  error when its data was distributed by one of our strategies, a warning when
  such a strategy exists), refuses infinite `validation_data` without
  `validation_steps`, re-raises a step's error caused by a lost worker as
  `WorkerLostError`, appends the preemption check to `fit`'s callbacks
  (`preemption`), drops `predict`'s padding rows (`short_batches.predicting`), and TensorFlow's oneDNN failure on an empty batch (a
  dataset with fewer examples than replicas leaves a replica empty) as a
  `ValueError` that says so. Reads the private `_strategy` of TensorFlow's distributed
  datasets (TF 2.16-2.21: `input_lib`).

Every patch acts only for keras_replicator's strategies (`patching.ours`; the
multi-worker ones only with more than one worker); other strategies keep
Keras's behaviour. `PATCHES` are installed by `keras_replicator._compat.install()`
(and undone by `uninstall()`): `fit` is called outside any strategy scope, so
they cannot be scoped.
"""

from __future__ import annotations

import contextlib
import functools
import re
import warnings
import weakref

import keras
import tensorflow as tf
from keras.src.backend.tensorflow import trainer as tf_trainer

from keras_replicator._compat import mid_epoch_resume, parameter_server, short_batches
from keras_replicator._compat.patching import ScopedPatch, multi_worker, ours, ours_async
from keras_replicator._validation import ArgumentError

__all__ = ["PATCHES", "multi_worker", "ours", "register_strategy"]


def _first_replica(strategy, value):
    if isinstance(value, tf.distribute.DistributedValues):
        return strategy.experimental_local_results(value)[0]
    return value


def _has_call(model) -> bool:
    return type(model).call is not keras.Model.call


def _needs_data_to_build(model) -> bool:
    """Whether `_symbolic_build` would read a batch (the checks of Keras 3.15's `Trainer._symbolic_build`)."""
    compile_metrics = getattr(model, "_compile_metrics", None)
    compile_loss = getattr(model, "_compile_loss", None)
    return (not all(layer.built for layer in model._flatten_layers())
            or (compile_metrics is not None and not compile_metrics.built)
            or (compile_loss is not None and not compile_loss.built))


def _replica_element_spec(epoch_iterator):
    """Replica 0's `TensorSpec`s of the distributed dataset behind Keras's epoch iterator, or None."""
    from tensorflow.python.distribute import values

    dataset = getattr(epoch_iterator, "_distributed_dataset", None)
    spec = getattr(dataset, "element_spec", None)
    if spec is None:
        return None

    def first(v):
        return v._value_specs[0] if isinstance(v, values.PerReplicaSpec) else v

    spec = short_batches.unwrap_spec(tf.nest.map_structure(first, spec))
    if not all(isinstance(v, tf.TensorSpec) for v in tf.nest.flatten(spec)):
        return None  # ragged, sparse, optional: read a batch as before
    return spec


def _build_from_spec(model, spec) -> None:
    """Keras's `_symbolic_build` from replica 0's `TensorSpec`s, without tracing a built model.

    Keras traces the whole forward pass once more (`compute_output_spec` of the
    model) to get `y_pred`'s shape for the loss and metrics, even when every layer
    is built; for a built functional model we take `y_pred` from its output
    tensors instead (measured: most of the time before `fit`'s first step on a
    ResNet-50). Other models get Keras's own build, from the specs.
    """
    from keras.src import backend
    from keras.src.models.functional import Functional

    layers_built = all(layer.built for layer in model._flatten_layers())
    if not (layers_built and isinstance(model, Functional)):
        model._symbolic_build(data_batch=spec)
        return
    data = tf.nest.map_structure(lambda v: keras.KerasTensor(v.shape, v.dtype.name), spec)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    batch = tf.nest.flatten(x)[0].shape[0]
    y_pred = tf.nest.map_structure(lambda o: keras.KerasTensor((batch, *o.shape[1:]), o.dtype),
                                   model._outputs_struct)
    if model._compile_metrics is not None and not model._compile_metrics.built:
        backend.compute_output_spec(model.compute_metrics, x, y, y_pred, sample_weight=sample_weight)
    if model._compile_loss is not None and not model._compile_loss.built:
        backend.compute_output_spec(model._compute_loss, x, y, y_pred, sample_weight=sample_weight,
                                    training=False)


def _symbolic_build_from_first_replica(original):
    """`TensorFlowTrainer._maybe_symbolic_build`. Why: `_maybe_symbolic_build` builds the model from one distributed batch by
    `strategy.reduce("MEAN", batch, axis=None)`: an element-wise mean of every
    replica's slice. That fails when the slices differ in size (a short last
    batch: "Inputs to operation AddN must have the same size and shape") and,
    across workers, on structures of PerReplica values
    (tensorflow/tensorflow#72388). The build only needs the shapes and dtypes of
    one example batch, so we take replica 0's slice. A model without `call()`
    (a GAN written as keras-io's guides do: only `train_step`) cannot be built
    symbolically at all; without a strategy Keras skips this build and the
    model builds when the step is traced: we do the same.

    Speed: Keras reads that batch at every `fit`/`evaluate` call (a distributed
    iterator with its per-replica pipelines, made and dropped) and traces the whole
    forward pass once more, only to build the loss and metrics. We build from
    replica 0's `TensorSpec`s (`_replica_element_spec`), take a built functional
    model's output specs from its outputs (`_build_from_spec`), and skip it all when
    nothing needs data to build (every call after the first). A model the specs
    cannot build (a failure there) gets the batch, as before.
    """

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if not ours(strategy):
            return original(self, iterator=iterator, data_batch=data_batch)
        if not _has_call(self):
            return None
        with strategy.scope():
            if _needs_data_to_build(self) and iterator is not None:
                spec = _replica_element_spec(iterator)
                if spec is not None:
                    optimizer_unbuilt = self.optimizer is not None and not self.optimizer.built
                    try:
                        _build_from_spec(self, spec)
                        if optimizer_unbuilt and not self.optimizer.built:
                            self.optimizer.build(self.trainable_variables)
                        return None
                    except Exception:  # a model that needs a concrete batch: as before
                        if optimizer_unbuilt and self.optimizer.built:
                            raise  # the optimizer's build failed: no batch changes that

                # (step, iterator) on Keras 3.8-3.10, (begin, end, iterator) on 3.11+.
                for *_, it in iterator:
                    batch = next(it)
                    data_batch = short_batches.unwrap_spec(
                        tf.nest.map_structure(lambda v: _first_replica(strategy, v), batch))
                    break
            # Nothing left to build from data (a later fit, evaluate): no batch is read.
            self._symbolic_build(data_batch=data_batch)

    return _maybe_symbolic_build


def _reduce_across_workers(original):
    """`reduce_per_replica`: global metrics and all of predict's rows across workers.

    Why: Keras 3's `reduce_per_replica` reduces across workers only for
    `isinstance(strategy, MultiWorkerMirroredStrategy)`, and there with
    `strategy.reduce(..., axis=0)`, which fails on the scalar metrics
    ("Invalid reduction dimension 0", tensorflow/tensorflow#72388). For other
    strategies it reduces the local replicas only: each worker's `predict`
    would return its own rows and step outputs would be per-worker means. For
    our multi-worker strategies: "concat" gathers every replica's rows with
    Keras's own `_multi_worker_concat` (which undoes the order in which
    tf.data's data-sharding hands rows to replicas), and "mean"/"sum" reduce
    over every replica of every worker, element-wise as Keras does on one worker.
    """

    def reduce_per_replica(values, strategy, reduction):
        if not multi_worker(strategy) or reduction == "first":
            return original(values, strategy, reduction)
        if reduction == "auto":
            reduction = "mean"
        if reduction not in ("mean", "sum", "concat"):
            return original(values, strategy, reduction)

        def _reduce(v):
            if not isinstance(v, (tf.Tensor, tf.distribute.DistributedValues)):
                return v
            if reduction == "concat":
                return tf_trainer._multi_worker_concat(v, strategy)
            if not isinstance(v, tf.distribute.DistributedValues):
                # One local replica: strategy.run returned this worker's plain value.
                v = strategy.experimental_distribute_values_from_function(lambda _: v)
            return strategy.reduce(reduction.upper(), v, axis=None)

        return tf.nest.map_structure(_reduce, values)

    return reduce_per_replica


def _infinite_without_steps(data, steps) -> bool:
    if steps is not None:
        return False
    if isinstance(data, (tf.data.Dataset, tf.distribute.DistributedDataset)):
        cardinality = data.cardinality
        cardinality = int(cardinality() if callable(cardinality) else cardinality)
        return cardinality == tf.data.INFINITE_CARDINALITY
    return False


def _refuse_infinite_epochs(original):
    """`TFEpochIterator.__init__`. Why: Keras 3.15's `EpochIterator` runs an epoch of an infinite `tf.data`
    dataset forever when `steps_per_epoch` (`steps`) is not given. We raise
    instead, in `TFEpochIterator.__init__` (fit, evaluate, predict), before any step.
    """

    @functools.wraps(original)
    def __init__(self, distribute_strategy=None, *args, **kwargs):
        if ours(distribute_strategy) and _infinite_without_steps(
            kwargs.get("x"), kwargs.get("steps_per_epoch")
        ):
            raise ArgumentError(
                "The dataset is infinite (it repeats forever), so an epoch would never end. "
                "Give the number of steps: model.fit(..., steps_per_epoch=N), "
                "model.evaluate(..., steps=N) or model.predict(..., steps=N); "
                "or make the dataset finite (remove .repeat())."
            )
        with short_batches.keras_distributing():
            original(self, distribute_strategy, *args, **kwargs)
        if ours(distribute_strategy):
            mid_epoch_resume.current.iterator = weakref.ref(self)

    return __init__


# Every keras_replicator strategy created in this process (for the scope checks).
_strategies: weakref.WeakSet = weakref.WeakSet()


def register_strategy(strategy) -> None:
    """Remembers `strategy`, so that `fit` can tell a model built outside its scope."""
    _strategies.add(strategy)


def unregister_strategy(strategy) -> None:
    """Forgets `strategy` (a Keras distribution's, once unset: plain Keras again, no warning)."""
    _strategies.discard(strategy)


def _distributed_by(data):
    """The strategy that distributed `data`, if it is a distributed dataset."""
    if isinstance(data, tf.distribute.DistributedDataset):
        return getattr(data, "_strategy", None)
    return None


def _check_scope(model, name: str, args, kwargs) -> None:
    """Catches a model built (or loaded) outside the strategy's scope, before any work."""
    strategy = getattr(model, "_distribute_strategy", None)
    data = args[0] if args else kwargs.get("x")
    dataset_strategy = _distributed_by(data)
    if ours(dataset_strategy) and dataset_strategy is not strategy:
        where = "outside any strategy's scope" if strategy is None else f"under another strategy ({strategy!r})"
        raise ArgumentError(
            f"model.{name}() got a dataset distributed by {dataset_strategy!r}, but the model was "
            f"built {where}, so its variables are not that strategy's. Build (or "
            "keras.saving.load_model) and compile the model under `with strategy.scope():`, "
            "the same strategy that distributes the data."
        )
    if strategy is None and len(_strategies) and name in ("fit", "evaluate", "predict"):
        warnings.warn(
            f"model.{name}() runs on one device: the model was built (or loaded) outside "
            f"the scope of {next(iter(_strategies))!r}. To replicate it, build or "
            "keras.saving.load_model it, and compile it, under `with strategy.scope():`.",
            stacklevel=3,
        )


def _check_validation_data(kwargs) -> None:
    validation_data = kwargs.get("validation_data")
    if isinstance(validation_data, (tuple, list)) and validation_data:
        validation_data = validation_data[0]
    if _infinite_without_steps(validation_data, kwargs.get("validation_steps")):
        # Keras builds the validation iterator only after the first epoch.
        raise ArgumentError(
            "validation_data is an infinite dataset (it repeats forever), so validation "
            "would never end. Pass validation_steps=N to fit, or make it finite."
        )


# TensorFlow 2.21's oneDNN kernels on CPU fail on an empty batch with these (a
# convolution's output then has the wrong shape for what follows it).
_EMPTY_BATCH_FAILURE = re.compile(
    r"Matrix size-incompatible: In\[0\]: \[0,|input depth must be evenly divisible by filter depth"
)


def _empty_replica_error(strategy, error: Exception) -> ValueError | None:
    if not isinstance(error, tf.errors.InvalidArgumentError) or not _EMPTY_BATCH_FAILURE.search(
        str(error)
    ):
        return None
    n = strategy.num_replicas_in_sync
    return ValueError(
        f"A replica got an empty batch: the data has fewer examples than the {n} replicas (or a "
        f"last batch that small), and TensorFlow's oneDNN kernels on CPU fail on empty batches "
        f"(a convolution returns a wrongly shaped result). Use at least {n} examples, a strategy "
        "over fewer devices, or set TF_ENABLE_ONEDNN_OPTS=0 before TensorFlow starts. "
        f"TensorFlow said: {str(error).strip().splitlines()[0][:300]}"
    )


def _cancelled_replica_error(strategy, error: Exception) -> Exception | None:
    """The same error type, saying where the error that caused the cancellation is.

    Why (TF 2.21): in a step traced once, each replica is a call of its own in one
    function. When one fails (an op XLA cannot compile, a failed check), the calls
    not yet started are cancelled, and TensorFlow may raise one of those
    cancellations ("Function was cancelled before it was started") instead of the
    error itself, which it has logged (seen in 1 run in 8 of a step that XLA
    refuses: `tests/test_xla.py`).
    """
    if not isinstance(error, tf.errors.CancelledError) or "cancelled before it was started" not in str(error):
        return None
    if not getattr(strategy.extended, "trace_once", False) or strategy.num_replicas_in_sync < 2:
        return None
    return tf.errors.CancelledError(
        None, None,
        "A replica's step failed, and TensorFlow raised only the cancellation of another replica's "
        "call that it caused: the error itself is in TensorFlow's log above (its 'E' lines, such "
        "as 'OP_REQUIRES failed'). To have it raised here, run the step traced per replica: "
        "kr.ReplicatorStrategy(..., trace_once=False). "
        f"TensorFlow said: {' '.join(str(error).split())[:300]}",
    )


_ENTRY_POINTS = ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch")


def _entry_point(name):
    """One wrapper around the trainer's entry point `name` (see the module docstring)."""

    def wrap(method):
        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            strategy = getattr(self, "_distribute_strategy", None)
            if ours_async(strategy):
                return parameter_server.ENTRY_POINTS[name](self, *args, **kwargs)
            _check_scope(self, name, args, kwargs)
            if not ours(strategy):
                return method(self, *args, **kwargs)
            watching = contextlib.nullcontext()
            if name == "fit":
                _check_validation_data(kwargs)
                args, kwargs, watching = _with_preemption_check(strategy, args, kwargs)
            try:
                with watching, short_batches.predicting(name == "predict"):
                    return method(self, *args, **kwargs)
            except tf.errors.OpError as e:
                lost = strategy.extended.lost_worker_error(e) if multi_worker(strategy) else None
                if lost is not None:
                    raise lost from e
                empty = _empty_replica_error(strategy, e)
                if empty is not None:
                    raise empty from e
                cancelled = _cancelled_replica_error(strategy, e)
                if cancelled is not None:
                    raise cancelled from e
                raise

        return wrapper

    return wrap


_FIT_CALLBACKS_POSITION = 5  # fit(x, y, batch_size, epochs, verbose, callbacks, ...)


def _with_preemption_check(strategy, args, kwargs):
    """`fit`'s arguments with the preemption check appended to its callbacks (`preemption`)."""
    from keras_replicator._compat import preemption

    mode = getattr(strategy, "on_sigterm", "save")
    if len(args) > _FIT_CALLBACKS_POSITION:
        callbacks, watching = preemption.fit_callbacks(strategy, args[_FIT_CALLBACKS_POSITION], mode)
        args = args[:_FIT_CALLBACKS_POSITION] + (callbacks,) + args[_FIT_CALLBACKS_POSITION + 1:]
    else:
        callbacks, watching = preemption.fit_callbacks(strategy, kwargs.get("callbacks"), mode)
        kwargs = dict(kwargs, callbacks=callbacks)
    return args, kwargs, watching


# Installed by keras_replicator._compat.install(), undone by uninstall().
PATCHES = (
    ScopedPatch(tf_trainer.TensorFlowTrainer, "_maybe_symbolic_build", _symbolic_build_from_first_replica),
    ScopedPatch(tf_trainer, "reduce_per_replica", _reduce_across_workers),
    ScopedPatch(tf_trainer.TFEpochIterator, "__init__", _refuse_infinite_epochs),
    ScopedPatch(tf_trainer.TFEpochIterator, "_enumerate_iterator",
                mid_epoch_resume.resume_from_mid_epoch, guards=mid_epoch_resume.GUARDS),
    *(ScopedPatch(tf_trainer.TensorFlowTrainer, name, _entry_point(name)) for name in _ENTRY_POINTS),
)
