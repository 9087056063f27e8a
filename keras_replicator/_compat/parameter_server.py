"""Keras 3 `fit` / `evaluate` / `predict` under `AsyncReplicatorStrategy` (parameter servers).

Keras 3.15 has no code for `tf.distribute.ParameterServerStrategy`: its TF
trainer calls `strategy.run` on the chief and iterates a dataset there, which a
parameter-server strategy forbids (steps must be scheduled onto workers through
a `ClusterCoordinator`). tf-keras 2.x had it (`tf_keras/src/engine/training.py`:
`self._cluster_coordinator.schedule(train_function, ...)`, metrics read from
the model at epoch end, `steps_per_epoch` required); this module does the same
for Keras 3:

* `fit` runs Keras's own `train_step` in a `tf.function` that the coordinator
  schedules onto whichever worker is free, `steps_per_execution` steps per
  closure, over each worker's own iterator; callbacks run on the chief; at the
  end of an epoch it waits for every closure, and the epoch's logs are the
  model's metrics, whose variables live on the parameter servers and were
  updated by every step of every worker (real aggregates, not one worker's).
* `evaluate` and `predict` run on the chief, reading the variables from the
  parameter servers: exact (every example once, rows in order) and on a
  consistent snapshot of the weights (nothing trains meanwhile).

Every use of private Keras / TensorFlow API is here, each commented with what
and why; checked on TF 2.21 / Keras 3.15. `keras_trainer`'s patch of
`TensorFlowTrainer` is a thin dispatch to `ENTRY_POINTS` (installed, inert for
every other strategy: users call `model.fit` on Keras's class, so that is the
only hook); what changes Keras's behaviour is scoped: `ATOMIC_UPDATES` while a
step is traced, `_on_chief` while evaluate/predict run. `SHARDED_READS` are installed when
variables are partitioned (inert for the others).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import time

import numpy as np
import tensorflow as tf
from keras.src.backend.common.stateless_scope import in_stateless_scope
from keras.src.backend.tensorflow import core
from keras.src.backend.tensorflow import trainer as tf_trainer

from keras_replicator._compat import keras_seed_generator, patching
from keras_replicator._compat.patching import ScopedPatch
from keras_replicator._validation import ArgumentError, check_int

# How many closures fit keeps scheduled but unfinished, per worker. More lets a
# fast worker never wait for the chief; fewer keeps batch-level callbacks (the
# progress bar, BackupAndRestore(save_freq=N)) close to the real progress.
_IN_FLIGHT_PER_WORKER = 2
# How often the chief looks at a closure it waits for (and at the parameter servers).
_POLL_SECONDS = 0.2


# --- atomic read-modify-write of Keras variables ------------------------------


def _atomic(op: str):
    """`keras.Variable.<op>` as TensorFlow's one-op `ResourceVariable.<op>` (see `atomic_variable_updates`)."""

    def make(inherited):
        def method(self, value):
            if in_stateless_scope():
                return inherited(self, value)
            value = tf.cast(self._convert_to_tensor(value, dtype=self._dtype), self._value.dtype)
            return getattr(self._value, op)(value)

        return method

    return make


ATOMIC_UPDATES = patching.Patches(
    [ScopedPatch(core.Variable, op, _atomic(op)) for op in ("assign_add", "assign_sub")]
)


def atomic_variable_updates():
    """While active, `keras.Variable.assign_add` / `assign_sub` are single atomic ops.

    What: Keras 3.15's `KerasVariable.assign_add(v)` is `self.assign(self + v)`
    (keras/src/backend/common/variables.py): a read, then a write. Why: under a
    parameter-server strategy several workers update the same variable on a
    parameter server at once, and a read-then-write loses the updates that land
    in between: the optimizer's `iterations` and the metrics' totals and counts
    come out short (measured: 47 of 60 steps counted with 2 workers). TensorFlow's
    `ResourceVariable.assign_add` is one `AssignAddVariableOp`, applied under
    the variable's lock on the parameter server. Scoped (`ATOMIC_UPDATES.scope()`,
    re-entrant and thread-safe): installed on Keras's TensorFlow `Variable`
    class (keras.src.backend.tensorflow.core) while a step function is traced,
    removed when the last scope exits. Checked on Keras 3.15.
    """
    return ATOMIC_UPDATES.scope()


# --- waiting for closures, with an eye on the parameter servers -----------------


def _ready(remote_value) -> bool:
    # What: RemoteValueImpl._status_available_event / _status (TF 2.21,
    # distribute/coordinator/values.py). Why: RemoteValue.fetch() blocks without a
    # timeout; the chief must keep checking the parameter servers while it waits,
    # and a closure aborted by a lost worker is re-run (its event set, then cleared).
    from tensorflow.python.distribute.coordinator import remote_value as rv_lib

    event = remote_value._status_available_event
    return event.wait(_POLL_SECONDS) and remote_value._status is not rv_lib.RemoteValueStatus.ABORTED


def _fetch(strategy, remote_value) -> dict:
    while not _ready(remote_value):
        strategy._check_parameter_servers()
    return _pythonify(remote_value.fetch())


def _join(strategy) -> None:
    coordinator = strategy.coordinator
    while not coordinator.done():  # done() raises the first error of any closure
        strategy._check_parameter_servers()
        time.sleep(_POLL_SECONDS)


def _pythonify(logs):
    # keras.src.utils.python_utils.pythonify_logs: Keras's own conversion of step
    # outputs to Python numbers for callbacks (Keras 3.15).
    from keras.src.utils.python_utils import pythonify_logs

    if not isinstance(logs, dict):
        return logs
    return pythonify_logs({k: np.asarray(v) for k, v in logs.items()})


@contextlib.contextmanager
def _parameter_server_errors(strategy):
    """Re-raises an error caused by a lost parameter server as `ParameterServerLostError`."""
    try:
        yield
    except Exception as e:
        from keras_replicator.errors import ParameterServerLostError

        if isinstance(e, ParameterServerLostError):
            raise
        lost = strategy._parameter_server_lost_error(e)
        if lost is not None:
            raise lost from e
        raise


# --- fit ------------------------------------------------------------------------


def _first(strategy, value):
    """One worker's step outputs: the local replicas' are the same metric results."""
    if isinstance(value, tf.distribute.DistributedValues):
        return strategy.experimental_local_results(value)[0]
    return value


def _train_function(model, strategy):
    """The scheduled function: `steps` training steps on one worker's iterator.

    Cached as `model.train_function` (Keras's `compile` resets it to None).
    """
    cached = getattr(model, "train_function", None)
    if getattr(cached, "_kr_strategy", None) is strategy:
        return cached

    @tf.function
    def train_function(iterator, steps):
        # The index of the worker running this closure (a value bound when it runs: the
        # function is traced once, on the chief): random draws differ across workers.
        worker = tf.distribute.coordinator.experimental_get_current_worker_index()
        with atomic_variable_updates(), keras_seed_generator.folded_with_worker(worker):
            outputs = strategy.run(model.train_step, args=(next(iterator),))
            outputs = tf.nest.map_structure(functools.partial(_first, strategy), outputs)
            for _ in tf.range(steps - 1):
                step = strategy.run(model.train_step, args=(next(iterator),))
                outputs = tf.nest.map_structure(functools.partial(_first, strategy), step)
            return outputs

    train_function._kr_strategy = strategy
    model.train_function = train_function
    return train_function


def _refuse(name: str, value, why: str) -> None:
    if value is not None:
        raise ArgumentError(f"fit(..., {name}=...) is not supported with AsyncReplicatorStrategy: {why}")


def fit(
    model,
    x=None,
    y=None,
    batch_size=None,
    epochs=1,
    verbose="auto",
    callbacks=None,
    validation_split=0.0,
    validation_data=None,
    shuffle=True,
    class_weight=None,
    sample_weight=None,
    initial_epoch=0,
    steps_per_epoch=None,
    validation_steps=None,
    validation_batch_size=None,
    validation_freq=1,
):
    """Keras's `fit` for a model built under an `AsyncReplicatorStrategy` (see module doc)."""
    from keras.src import callbacks as callbacks_module
    from keras.src import optimizers as optimizers_module

    strategy = model._distribute_strategy
    steps_per_epoch, epochs, initial_epoch = _check_fit_arguments(
        model, strategy, x, y, batch_size, epochs, validation_split, validation_data,
        class_weight, sample_weight, initial_epoch, steps_per_epoch, validation_freq,
    )
    with _parameter_server_errors(strategy):
        with strategy.scope():
            # Creates the metrics', loss trackers' and optimizer's variables on the
            # parameter servers from the element spec (Trainer._symbolic_build, Keras 3.15).
            model._symbolic_build(data_batch=x.element_spec)
        _refuse_partitioned_training(model)
        train_function = _train_function(model, strategy)
        iterator = x._iterator()

        if not isinstance(callbacks, callbacks_module.CallbackList):
            callbacks = callbacks_module.CallbackList(
                callbacks,
                add_history=True,
                add_progbar=verbose != 0,
                verbose=verbose,
                epochs=epochs,
                steps=steps_per_epoch,
                model=model,
            )
        model.stop_training = False
        callbacks.on_train_begin()
        training_logs = None
        logs = {}
        # Set by BackupAndRestore.on_train_begin when it restored a backup (Keras 3.15).
        initial_epoch = model._initial_epoch or initial_epoch
        for epoch in range(initial_epoch, epochs):
            model.reset_metrics()
            callbacks.on_epoch_begin(epoch)
            logs = _train_epoch(model, strategy, callbacks, train_function, iterator, steps_per_epoch, logs)
            # The metrics' variables on the parameter servers: every step of every worker.
            epoch_logs = dict(_pythonify(model._get_metrics_result_or_logs(logs)))
            if validation_data is not None and model._should_eval(epoch, validation_freq):
                val_x, val_y, val_sample_weight = _unpack(validation_data)
                val_logs = evaluate(
                    model,
                    x=val_x,
                    y=val_y,
                    sample_weight=val_sample_weight,
                    batch_size=validation_batch_size,
                    steps=validation_steps,
                    callbacks=callbacks,
                    return_dict=True,
                )
                epoch_logs.update({f"val_{name}": value for name, value in val_logs.items()})
            callbacks.on_epoch_end(epoch, epoch_logs)
            training_logs = epoch_logs
            if model.stop_training:
                break
        if isinstance(model.optimizer, optimizers_module.Optimizer) and epochs > 0:
            model.optimizer.finalize_variable_values(model.trainable_weights)
        callbacks.on_train_end(logs=training_logs)
        return model.history


def _check_fit_arguments(
    model, strategy, x, y, batch_size, epochs, validation_split, validation_data,
    class_weight, sample_weight, initial_epoch, steps_per_epoch, validation_freq,
) -> tuple[int, int, int]:
    """Refuses what `fit` cannot do under a parameter-server strategy, before any work.

    Returns the checked ``(steps_per_epoch, epochs, initial_epoch)``.
    """
    model._assert_compile_called("fit")
    if not getattr(x, "_keras_replicator_async_input", False):
        raise ArgumentError(
            "With AsyncReplicatorStrategy, fit trains on the workers, each reading its own input "
            "pipeline: pass x=strategy.distribute_dataset(dataset_fn, per_replica_batch_size=...), "
            f"got {type(x).__name__}. (evaluate and predict take arrays or datasets: they run on the chief.)"
        )
    if x.strategy is not strategy:
        raise ArgumentError("The dataset was made by another strategy than the model's.")
    why = "each worker's examples come from dataset_fn (return (x, y) or (x, y, sample_weight) elements)."
    for name, value in (("y", y), ("sample_weight", sample_weight), ("class_weight", class_weight)):
        _refuse(name, value, why)
    _refuse("batch_size", batch_size, "give per_replica_batch_size to strategy.distribute_dataset.")
    if validation_split:
        raise ArgumentError(
            "fit(..., validation_split=...) is not supported with AsyncReplicatorStrategy: pass "
            "validation_data (arrays or a tf.data.Dataset, evaluated on the chief)."
        )
    if steps_per_epoch is None:
        raise ArgumentError(
            "fit needs steps_per_epoch with AsyncReplicatorStrategy: every worker reads its own "
            "endless stream of batches, so an epoch is the number of steps you choose, e.g. "
            "model.fit(data, epochs=10, steps_per_epoch=100)."
        )
    steps_per_epoch = check_int("steps_per_epoch", steps_per_epoch, minimum=1)
    epochs = check_int("epochs", epochs, minimum=0)
    initial_epoch = check_int("initial_epoch", initial_epoch, minimum=0)
    check_int("validation_freq", validation_freq, minimum=1)
    if model.run_eagerly:
        raise ArgumentError(
            "run_eagerly=True is not supported with AsyncReplicatorStrategy: steps are functions "
            "the chief sends to the workers. Debug with a local strategy first."
        )
    if validation_data is not None:
        _check_outside_scope(strategy, "fit(..., validation_data=...)")
    return steps_per_epoch, epochs, initial_epoch


def _train_epoch(model, strategy, callbacks, train_function, iterator, steps_per_epoch, logs) -> dict:
    """Schedules one epoch's steps onto the workers; returns the last fetched step's logs.

    ``logs`` are the last ones fetched before (the batch callbacks get them until
    a step of this epoch has been fetched).
    Keeps at most `_IN_FLIGHT_PER_WORKER` closures per worker unfinished, runs
    the batch callbacks on the chief, and waits for every closure at the end.
    """
    per_execution = int(model.steps_per_execution)
    max_in_flight = _IN_FLIGHT_PER_WORKER * strategy.num_workers
    pending: collections.deque = collections.deque()
    step = 0
    while step < steps_per_epoch:
        n = min(per_execution, steps_per_epoch - step)
        callbacks.on_train_batch_begin(step)
        pending.append(
            strategy.coordinator.schedule(train_function, args=(iterator, tf.constant(n)))
        )
        while len(pending) > max_in_flight:
            logs = _fetch(strategy, pending.popleft())
        step += n
        callbacks.on_train_batch_end(step - 1, logs)
        if model.stop_training:
            break
    _join(strategy)
    if pending:
        logs = _fetch(strategy, pending[-1])
    return logs


def _refuse_partitioned_training(model) -> None:
    """Trainable variables split by a variable_partitioner cannot be trained by Keras 3 yet.

    What: `tf.__internal__.distribute.ShardedVariable` (TF 2.21), what a
    partitioner makes. Why: Keras 3.15's TensorFlow `Variable.handle` returns
    `self.value.handle`, which a `ShardedVariable` (several variables, one per
    parameter server) has not, so `GradientTape.gradient` fails on it with an
    AttributeError deep in the step; this says so before any step.
    """
    sharded = [
        v.path
        for v in model.trainable_variables
        if isinstance(getattr(v, "value", v), tf.__internal__.distribute.ShardedVariable)
    ]
    if sharded:
        raise NotImplementedError(
            f"The trainable variable(s) {sharded} are partitioned over several parameter servers "
            "(variable_partitioner), and Keras 3 cannot compute their gradients yet (its variables "
            "expect one handle). Use variable_partitioner=None (every variable whole, on the "
            "parameter servers in turn), or keep partitioned variables non-trainable."
        )


def _unpack(data):
    from keras.src.trainers.data_adapters import data_adapter_utils

    return data_adapter_utils.unpack_x_y_sample_weight(data)


# --- evaluate / predict on the chief ----------------------------------------------


def _check_outside_scope(strategy, what: str) -> None:
    if tf.distribute.has_strategy() and tf.distribute.get_strategy() is strategy:
        raise RuntimeError(
            f"Call {what} outside `with strategy.scope():` under AsyncReplicatorStrategy: it runs "
            "on the chief (reading the weights from the parameter servers), not in the scope "
            "where variables are created. Build and compile in the scope; fit, evaluate and "
            "predict after it."
        )


@contextlib.contextmanager
def _on_chief(model, strategy, what: str):
    """Runs Keras's own evaluate/predict on the chief with the default strategy.

    What: `TensorFlowTrainer._distribute_strategy` is set to None for the call
    (Keras 3.15 then uses `tf.distribute.get_strategy()`, the default strategy
    outside any scope), and restored after. The step functions Keras traces read
    every weight from the parameter servers and update the metrics' variables
    there.
    """
    _check_outside_scope(strategy, what)
    model._distribute_strategy = None
    try:
        with _parameter_server_errors(strategy):
            yield
    finally:
        model._distribute_strategy = strategy


def _refuse_async_input(x, what: str) -> None:
    if getattr(x, "_keras_replicator_async_input", False):
        raise ArgumentError(
            f"{what} runs on the chief under AsyncReplicatorStrategy (exactly once over the data, "
            "on one snapshot of the weights): pass arrays or a tf.data.Dataset, not the "
            "workers' dataset from strategy.distribute_dataset."
        )


def _keras_method(name: str):
    """Keras's own `TensorFlowTrainer.<name>`, not `keras_trainer`'s wrapper around it."""
    return patching.original(tf_trainer.TensorFlowTrainer, name)


def evaluate(model, x=None, y=None, *args, **kwargs):
    """Keras's `evaluate`, run on the chief (see `_on_chief`)."""
    _refuse_async_input(x, "evaluate")
    with _on_chief(model, model._distribute_strategy, "evaluate"):
        return _keras_method("evaluate")(model, x, y, *args, **kwargs)


def predict(model, x, *args, **kwargs):
    """Keras's `predict`, run on the chief (see `_on_chief`)."""
    _refuse_async_input(x, "predict")
    with _on_chief(model, model._distribute_strategy, "predict"):
        return _keras_method("predict")(model, x, *args, **kwargs)


def test_on_batch(model, *args, **kwargs):
    with _on_chief(model, model._distribute_strategy, "test_on_batch"):
        return _keras_method("test_on_batch")(model, *args, **kwargs)


def predict_on_batch(model, *args, **kwargs):
    with _on_chief(model, model._distribute_strategy, "predict_on_batch"):
        return _keras_method("predict_on_batch")(model, *args, **kwargs)


def train_on_batch(model, *args, **kwargs):
    raise NotImplementedError(
        "train_on_batch is not supported with AsyncReplicatorStrategy: training steps run on the "
        "workers, scheduled by fit(strategy.distribute_dataset(...), steps_per_epoch=...)."
    )


def _sharded_array(original_array):
    def __array__(self, dtype=None, *args, **kwargs):
        if isinstance(getattr(self, "_value", None), tf.__internal__.distribute.ShardedVariable):
            value = tf.convert_to_tensor(self._value).numpy()
            return value if dtype is None else value.astype(dtype)
        return original_array(self, dtype, *args, **kwargs)

    return __array__


def _sharded_numpy(original_numpy):
    def numpy(self):
        if isinstance(getattr(self, "_value", None), tf.__internal__.distribute.ShardedVariable):
            return tf.convert_to_tensor(self._value).numpy()
        return original_numpy(self)

    return numpy


# Keras variables split by a `variable_partitioner` read as whole NumPy arrays.
#
# What: `__array__` and `numpy` of Keras's TensorFlow `Variable`
# (keras.src.backend.tensorflow.core.Variable, Keras 3.15), for a value that is
# a `tf.__internal__.distribute.ShardedVariable` (TF 2.21) only. Why: Keras
# reads `self.value.__array__()`, which a `ShardedVariable` lacks, so
# `model.save`, `get_weights` and `BackupAndRestore` fail on a partitioned
# variable; `tf.convert_to_tensor` of a `ShardedVariable` is the whole tensor
# (its shards concatenated). Installed (saving happens anywhere) by
# `keras_replicator._compat.install(sharded_variable_reads=True)` when a strategy
# partitions variables, and inert for every other variable. Assigning a whole
# value (loading) already works: a `ShardedVariable` splits it.
SHARDED_READS = patching.Patches([
    ScopedPatch(core.Variable, "__array__", _sharded_array),
    ScopedPatch(core.Variable, "numpy", _sharded_numpy),
])


# What `keras_trainer`'s one wrapper around `TensorFlowTrainer`'s entry points calls
# for a model built under an `AsyncReplicatorStrategy`.
ENTRY_POINTS = {
    "fit": fit,
    "evaluate": evaluate,
    "predict": predict,
    "train_on_batch": train_on_batch,
    "test_on_batch": test_on_batch,
    "predict_on_batch": predict_on_batch,
}

