"""Keras callbacks for replicated training.

* `Throughput`: examples per second (global and per replica), step time
  and scaling efficiency, in `History` and TensorBoard.
* `ReplicaConsistencyCheck`: fails fast when the copies of a mirrored
  variable stop being identical across replicas (and workers); it raises
  `keras_replicator.errors.ReplicaDivergenceError` (also importable from here).

They work with any Keras model; with a `keras_replicator.ReplicatorStrategy`
they read the number of replicas from the model's strategy.

Learning-rate warmup and decay are schedules, not callbacks: see
`keras_replicator.schedules`. A schedule follows `optimizer.iterations`, so it
resumes with a checkpoint and on another number of replicas; the former
`LearningRateWarmup` callback measured the global batch from the first step and
counted epochs, which a resumed or re-sharded run could not reproduce.

Checkpointing: `keras.callbacks.BackupAndRestore(save_freq="epoch")` resumes a
replicated run exactly, also on a different number of replicas (same global
batch): weights, optimizer slots, iteration count (hence the learning-rate
schedule position) and `keras_replicator.optimizers.CrossReplicaOptimizer`'s
half-accumulated gradients are restored. Batch-level `save_freq` restores the
state but Keras restarts the interrupted epoch from its first batch.

Example:
    ```python
    callbacks = [kr.callbacks.Throughput(), kr.callbacks.ReplicaConsistencyCheck(every_n_steps=500)]
    ```
"""

from __future__ import annotations

import time

import keras
import numpy as np
import tensorflow as tf

from keras_replicator import testing
from keras_replicator._validation import check_bool, check_int, check_number
from keras_replicator.collectives import all_gather, all_reduce
from keras_replicator.errors import ReplicaDivergenceError

__all__ = ["ReplicaConsistencyCheck", "ReplicaDivergenceError", "Throughput"]


def _num_replicas(model) -> int:
    strategy = getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()
    return int(strategy.num_replicas_in_sync)


def _examples_seen(model) -> float | None:
    """Examples the model's loss tracker counted this epoch, over all replicas.

    Keras's ``train_step`` weighs its ``loss`` metric (a ``Mean``) by the batch
    size of each replica; the count is synchronised on read, so reading it sums
    the replicas. ``None`` if the model has no such metric.
    """
    for metric in model.metrics:
        if metric.name == "loss" and isinstance(metric, keras.metrics.Mean):
            return float(keras.ops.convert_to_numpy(metric.count))
    return None


class _ConfigFromArguments(keras.callbacks.Callback):
    """A callback whose Keras config is its constructor's arguments.

    Each subclass keeps every argument named in ``_config_keys`` as an attribute
    of the same name, so one ``get_config``/``from_config`` pair serves them all.
    """

    _config_keys: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, config: dict) -> _ConfigFromArguments:
        return cls(**config)

    def get_config(self) -> dict:
        return {key: getattr(self, key) for key in self._config_keys}


@keras.saving.register_keras_serializable(package="keras_replicator")
class Throughput(_ConfigFromArguments):
    """Examples per second (global and per replica) and step time, per epoch.

    Adds to each epoch's logs, hence to ``History`` and to TensorBoard:
    ``examples_per_second`` (all replicas), ``examples_per_second_per_replica``,
    ``step_time`` (seconds per training step) and, with ``single_replica_rate``,
    ``scaling_efficiency`` (per-replica rate over the single-replica rate; 1.0 is
    perfect linear scaling). List it **before** ``TensorBoard``, ``CSVLogger``
    and other loggers: callbacks run in order and read the logs as they are.

    The clock runs during training steps: from this callback's
    ``on_train_batch_begin`` to its ``on_train_batch_end``, summed over the
    epoch's steps (validation and the work of callbacks listed after this one
    are left out). In a multi-worker job the figures are the job's, the same on
    every worker: the examples of all workers over the longest of the workers'
    clocks (every worker runs the callback; it takes one small collective per epoch). The first step of each ``fit`` is left out too, as it
    includes tracing (unless it is the only one). The number of examples is ``global_batch_size`` per
    step if given, else what the model's ``loss`` metric counted (exact with a
    short last batch).

    Example:
        ```python
        import keras, numpy as np
        import keras_replicator as kr

        kr.simulate_devices(2)
        strategy = kr.ReplicatorStrategy()
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile("sgd", "mse")
        history = model.fit(np.ones((256, 4)), np.ones((256, 1)), batch_size=32, epochs=2,
                            verbose=0, callbacks=[kr.callbacks.Throughput()])
        print(history.history["examples_per_second"])
        ```

    After each epoch, ``last`` holds that epoch's numbers as a dict.

    Args:
        single_replica_rate: examples per second of one replica training alone
            (measure it with the same model and per-replica batch); enables
            ``scaling_efficiency``.
        global_batch_size: examples per step over all replicas; ``None``
            counts them.
    """

    _config_keys = ("single_replica_rate", "global_batch_size")

    def __init__(self, *, single_replica_rate: float | None = None, global_batch_size: int | None = None):
        super().__init__()
        self.single_replica_rate = check_number(
            "single_replica_rate", single_replica_rate, positive=True, optional=True
        )
        self.global_batch_size = check_int(
            "global_batch_size", global_batch_size, minimum=1, optional=True
        )
        self._skip_first = True
        self._max_fn = None  # the cross-worker max of a multi-worker job, built on first use
        self.last = None

    def _examples(self, steps_in_epoch: int) -> float:
        if self.global_batch_size is not None:
            return float(steps_in_epoch * self.global_batch_size)
        seen = _examples_seen(self.model)
        if seen is None:
            raise ValueError(
                "Throughput could not count examples: the model has no 'loss' metric (a custom "
                "train_step?). Pass Throughput(global_batch_size=...)."
            )
        return seen

    def on_train_begin(self, logs=None):
        self._skip_first = True

    def _job_seconds(self, seconds: float) -> float:
        """The longest of every worker's ``seconds`` (this worker's on one machine).

        In a synchronous job a step ends on every worker together, but a worker
        whose callbacks take longer (the chief printing progress) leaves the others
        waiting inside their steps; each worker's clock alone would give a different
        rate. The job's figure uses the slowest worker's time, the same everywhere.
        """
        strategy = self.model.distribute_strategy
        if getattr(strategy, "num_workers", 1) <= 1:
            return seconds
        if self._max_fn is None:

            @tf.function
            def longest(value):
                per_replica = strategy.run(lambda v: all_reduce(v, "max"), args=(value,))
                return strategy.experimental_local_results(per_replica)[0]

            self._max_fn = longest
        return float(self._max_fn(tf.constant(seconds, tf.float64)))

    def on_epoch_begin(self, epoch, logs=None):
        self._done = (0, 0.0)  # steps and examples done this epoch
        self._measured = [0.0, 0, 0.0]  # seconds, steps, examples
        self._first = None  # the first execution of fit(), kept as a fallback

    def on_train_batch_begin(self, batch, logs=None):
        self._started = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        seconds = time.perf_counter() - self._started
        steps, examples = batch + 1, self._examples(batch + 1)
        span = (seconds, steps - self._done[0], examples - self._done[1])
        self._done = (steps, examples)
        if self._skip_first:  # it includes tracing
            self._skip_first = False
            self._first = span
            return
        for i, value in enumerate(span):
            self._measured[i] += value

    def on_epoch_end(self, epoch, logs=None):
        if self._measured[1] > 0:
            seconds, steps, examples = self._measured
        elif self._first is not None:  # only the first (tracing) execution ran
            seconds, steps, examples = self._first
        else:
            return
        seconds = self._job_seconds(seconds)
        if seconds <= 0 or steps <= 0 or examples <= 0:
            return
        rate = examples / seconds
        per_replica = rate / _num_replicas(self.model)
        values = {
            "examples_per_second": rate,
            "examples_per_second_per_replica": per_replica,
            "step_time": seconds / steps,
        }
        if self.single_replica_rate is not None:
            values["scaling_efficiency"] = per_replica / self.single_replica_rate
        if logs is not None:
            logs.update(values)
        self.last = values


def _mirrored_variables(model, include_optimizer: bool) -> list:
    """The model's (and optimizer's) variables that are mirrored on every replica.

    Variables synchronised on read (metrics, gradient accumulators) hold a
    different value per replica by design and are left out.
    """
    candidates = list(model.weights)
    if include_optimizer and model.optimizer is not None:
        candidates += list(model.optimizer.variables)
    out, seen = [], set()
    for v in candidates:
        tf_var = getattr(v, "value", v) if isinstance(v, keras.Variable) else v
        if id(tf_var) in seen or not isinstance(tf_var, tf.distribute.DistributedValues):
            continue
        seen.add(id(tf_var))
        if getattr(tf_var, "synchronization", None) == tf.VariableSynchronization.ON_READ:
            continue
        if not (tf_var.dtype.is_floating or tf_var.dtype.is_integer or tf_var.dtype == tf.bool):
            continue
        out.append((v, tf_var))
    return out


def _fingerprint(t: tf.Tensor) -> tf.Tensor:
    """A 64-bit hash of a tensor's bytes (int64 scalar); equal values, equal hashes."""
    flat = tf.reshape(t, [1, -1])
    if flat.dtype == tf.bool:
        flat = tf.cast(flat, tf.uint8)
    return tf.bitcast(tf.fingerprint(flat)[0], tf.int64)


def _path(variable) -> str:
    return str(getattr(variable, "path", None) or getattr(variable, "name", variable))


@keras.saving.register_keras_serializable(package="keras_replicator")
class ReplicaConsistencyCheck(_ConfigFromArguments):
    """Checks that every mirrored variable is identical on all replicas and workers.

    Every ``every_n_steps`` training steps (and at the end of training) each
    replica hashes its own copy of every mirrored variable of the model (and of
    the optimizer); the hashes are gathered across all replicas, so a copy that
    differs on any device of any worker is found. The check is bit-exact and
    sends 8 bytes per variable. Variables synchronised on read (metrics,
    gradient accumulators) differ per replica by design and are not checked.

    On a mismatch it raises `ReplicaDivergenceError` naming the first
    variable that diverged (model weights first, then optimizer variables), the
    two replicas and, when both are local, the largest difference.

    Example:
        ```python
        import keras, numpy as np
        import keras_replicator as kr

        kr.simulate_devices(2)
        strategy = kr.ReplicatorStrategy()
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile("adam", "mse")
        model.fit(np.ones((64, 4)), np.ones((64, 1)), batch_size=16, epochs=2, verbose=0,
                  callbacks=[kr.callbacks.ReplicaConsistencyCheck(every_n_steps=4)])
        ```

    Args:
        every_n_steps: check after every this many training steps.
        include_optimizer: also check the optimizer's variables (slots,
            iteration count).
        check_at_end: also check when training ends.
    """

    _config_keys = ("every_n_steps", "include_optimizer", "check_at_end")

    def __init__(self, every_n_steps: int = 100, *, include_optimizer: bool = True, check_at_end: bool = True):
        super().__init__()
        self.every_n_steps = check_int("every_n_steps", every_n_steps, minimum=1)
        self.include_optimizer = check_bool("include_optimizer", include_optimizer)
        self.check_at_end = check_bool("check_at_end", check_at_end)
        self.checks_done = 0
        self._fn = None
        self._variables = None

    def on_train_begin(self, logs=None):
        self._steps_before_epoch = 0
        self._steps_in_epoch = 0
        self._next_check = self.every_n_steps
        self._last_checked = None
        self._fn = None  # the variables may have changed since the last fit

    def on_epoch_begin(self, epoch, logs=None):
        self._steps_before_epoch += self._steps_in_epoch
        self._steps_in_epoch = 0

    def on_train_batch_end(self, batch, logs=None):
        self._steps_in_epoch = batch + 1
        step = self._steps_before_epoch + self._steps_in_epoch
        if step >= self._next_check:
            self._next_check = (step // self.every_n_steps + 1) * self.every_n_steps
            self._last_checked = step
            self.check(step)

    def on_train_end(self, logs=None):
        step = self._steps_before_epoch + self._steps_in_epoch
        if self.check_at_end and step != self._last_checked:
            self.check(step)

    def _build(self):
        strategy = self.model.distribute_strategy
        self._variables = _mirrored_variables(self.model, self.include_optimizer)
        tf_vars = [tv for _, tv in self._variables]

        @tf.function
        def fingerprints():
            def replica_fn():
                # In a replica context, reading a mirrored variable reads this replica's copy.
                hashes = tf.stack([_fingerprint(tf.convert_to_tensor(v)) for v in tf_vars])
                return all_gather(hashes[tf.newaxis], axis=0)

            return strategy.experimental_local_results(strategy.run(replica_fn))[0]

        self._fn = fingerprints

    def check(self, step: int | None = None) -> None:
        """Runs the check now; raises `ReplicaDivergenceError` on a mismatch.

        Example:
            ```python
            check = kr.callbacks.ReplicaConsistencyCheck()
            check.set_model(model)
            check.check()
            ```
        """
        if self.model is None:
            raise ValueError("ReplicaConsistencyCheck has no model: call set_model(model) first.")
        if _num_replicas(self.model) == 1:
            return
        if self._fn is None:
            self._build()
        if not self._variables:
            return
        table = np.asarray(self._fn())  # [replicas, variables]
        self.checks_done += 1
        for j, (variable, _) in enumerate(self._variables):
            column = table[:, j]
            bad = np.flatnonzero(column != column[0])
            if bad.size == 0:
                continue
            other = int(bad[0])
            detail = ""
            copies = testing.replica_values(variable)
            if table.shape[0] == len(copies):  # every replica is local
                a = copies[0].astype(np.float64)
                b = copies[other].astype(np.float64)
                detail = f" (max abs difference {np.max(np.abs(a - b), initial=0.0):g})"
            when = f" after step {step}" if step is not None else ""
            raise ReplicaDivergenceError(
                f"Replica consistency check{when}: variable {_path(variable)!r} differs between "
                f"replica 0 and replica {other}{detail}. Replicas must stay identical; look for "
                "per-replica updates (random ops, assign() on a mirrored variable from one "
                "replica, non-deterministic layers) touching this variable."
            )


def __getattr__(name: str):
    if name == "LearningRateWarmup":
        raise AttributeError(
            "keras_replicator.callbacks.LearningRateWarmup was removed: the warmup is a learning-rate "
            "schedule now, keras_replicator.schedules.LinearScalingWarmup(base_learning_rate, "
            "global_batch_size, warmup_steps=...), given to the optimizer (it follows "
            "optimizer.iterations, so it resumes from checkpoints)."
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
