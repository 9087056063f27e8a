"""Keras callbacks for replicated training.

* :class:`LearningRateWarmup`: the linear scaling rule with gradual warmup of
  Goyal et al. (2017), "Accurate, Large Minibatch SGD".
* :class:`Throughput`: examples per second (global and per replica), step time
  and scaling efficiency, in ``History`` and TensorBoard.
* :class:`ReplicaConsistencyCheck`: fails fast when the copies of a mirrored
  variable stop being identical across replicas (and workers).

They work with any Keras model; with a :class:`~keras_replicator.ReplicatorStrategy`
they read the number of replicas from the model's strategy.

Checkpointing: ``keras.callbacks.BackupAndRestore(save_freq="epoch")`` resumes a
replicated run exactly, also on a different number of replicas (same global
batch): weights, optimizer slots, iteration count (hence the learning-rate
schedule position) and :class:`~keras_replicator.optimizers.CrossReplicaOptimizer`'s
half-accumulated gradients are restored. Batch-level ``save_freq`` restores the
state but Keras restarts the interrupted epoch from its first batch.
"""

from __future__ import annotations

import math
import time
import warnings

import keras
import numpy as np
import tensorflow as tf

from keras_replicator import testing
from keras_replicator.collectives import all_gather, all_reduce


def _check_positive_number(name: str, value, *, allow_zero: bool = False) -> float:
    ok = (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and (value >= 0 if allow_zero else value > 0)
    )
    if not ok:
        kind = "a non-negative" if allow_zero else "a positive"
        raise ValueError(f"{name} must be {kind} number, got {value!r}.")
    return float(value)


def _check_positive_int(name: str, value, *, optional: bool = False) -> int | None:
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        extra = " or None" if optional else ""
        raise ValueError(f"{name} must be a positive integer{extra}, got {value!r}.")
    return value


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


class _GlobalBatch:
    """The global batch size: given, or measured from the first executed steps."""

    def __init__(self, given: int | None, owner: str):
        self.value = given
        self._given = given
        self._owner = owner

    def reset(self):
        self.value = self._given

    def observe(self, model, steps_in_epoch: int) -> None:
        if self.value is not None:
            return
        seen = _examples_seen(model)
        if not seen:
            raise ValueError(
                f"{self._owner} could not find the global batch size: the model counts no "
                "examples in its 'loss' metric (a custom train_step?). Pass "
                f"{self._owner}(..., global_batch_size=...)."
            )
        self.value = max(1, round(seen / steps_in_epoch))


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
class LearningRateWarmup(_ConfigFromArguments):
    """Linear learning-rate scaling with gradual warmup (Goyal et al., 2017).

    The target learning rate is ``base_lr * global_batch / reference_batch``.
    Training starts at ``base_lr`` and the rate grows linearly, step by step,
    to the target over ``warmup_epochs`` epochs; from then on the callback no
    longer touches it. A warmup only ever raises the rate: when the global
    batch is at most ``reference_batch`` the target is at most ``base_lr``, and
    the target rate applies from the first step.

    The global batch (all replicas, all workers) is ``global_batch_size`` if
    given, else measured on the first step (from the examples counted by the
    model's ``loss`` metric). Pass it explicitly when resuming a run in the
    middle of the warmup, or when the global batch may be below
    ``reference_batch``: a measured batch is known only after the first step,
    which therefore runs at ``base_lr`` (with a warning if that was above the
    target).

    To follow the warmup with a schedule, use a callback that changes the
    rate relative to the current one, listed **after** this one; it sees the
    target rate once the warmup is over. The optimizer's learning rate must be
    a float (not a ``LearningRateSchedule``), which the callbacks set.

    Example:
        ```python
        import keras, numpy as np
        import keras_replicator as kr

        kr.simulate_devices(2)
        strategy = kr.ReplicatorStrategy()
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(keras.optimizers.SGD(0.01), "mse")
        decay = keras.callbacks.LearningRateScheduler(
            lambda epoch, lr: lr * 0.1 if epoch == 3 else lr)     # after the warmup
        model.fit(np.ones((64, 4)), np.ones((64, 1)), batch_size=32, epochs=4, verbose=0,
                  callbacks=[kr.callbacks.LearningRateWarmup(0.01, warmup_epochs=2,
                                                             reference_batch=8), decay])
        print(model.history.history["learning_rate"])   # [0.0175, 0.0325, 0.04, 0.004]
        ```

    Args:
        base_lr: the learning rate for ``reference_batch`` examples per step.
        warmup_epochs: length of the warmup in epochs (fractions allowed);
            ``0`` applies the scaled rate from the first step.
        reference_batch: the batch size ``base_lr`` was tuned for.
        global_batch_size: the global batch size; ``None`` measures it.
        verbose: ``1`` prints when the warmup ends.
    """

    _config_keys = ("base_lr", "warmup_epochs", "reference_batch", "global_batch_size", "verbose")

    def __init__(
        self,
        base_lr: float,
        warmup_epochs: float,
        reference_batch: int = 256,
        *,
        global_batch_size: int | None = None,
        verbose: int = 0,
    ):
        super().__init__()
        self.base_lr = _check_positive_number("base_lr", base_lr)
        self.warmup_epochs = _check_positive_number("warmup_epochs", warmup_epochs, allow_zero=True)
        self.reference_batch = _check_positive_int("reference_batch", reference_batch)
        self.global_batch_size = _check_positive_int(
            "global_batch_size", global_batch_size, optional=True
        )
        if verbose not in (0, 1):
            raise ValueError(f"verbose must be 0 or 1, got {verbose!r}.")
        self.verbose = verbose
        self._batch = _GlobalBatch(self.global_batch_size, "LearningRateWarmup")
        self._epoch = 0
        self._steps_per_epoch = None
        self._done = False
        self._started_at_base_lr = False

    @property
    def global_batch(self) -> int | None:
        """The global batch size in use: given, or measured on the first step (else None)."""
        return self._batch.value

    @property
    def target_lr(self) -> float | None:
        """``base_lr * global_batch / reference_batch``, once the global batch is known."""
        if self._batch.value is None:
            return None
        return self.base_lr * self._batch.value / self.reference_batch

    def learning_rate(self, step: int, steps_per_epoch: int, global_batch_size: int) -> float:
        """The learning rate this callback sets for global step ``step`` (0-based).

        Example:
            ```python
            warmup = kr.callbacks.LearningRateWarmup(0.1, warmup_epochs=5)
            warmup.learning_rate(0, steps_per_epoch=100, global_batch_size=1024)    # 0.1
            warmup.learning_rate(250, steps_per_epoch=100, global_batch_size=1024)  # 0.25
            warmup.learning_rate(500, steps_per_epoch=100, global_batch_size=1024)  # 0.4
            # a global batch below reference_batch (256): the scaled rate at once, no ramp
            warmup.learning_rate(0, steps_per_epoch=100, global_batch_size=64)      # 0.025
            ```

        Args:
            step: number of training steps before this one.
            steps_per_epoch: training steps per epoch.
            global_batch_size: examples per step over all replicas.
        """
        target = self.base_lr * global_batch_size / self.reference_batch
        warmup_steps = int(round(self.warmup_epochs * steps_per_epoch))
        if step >= warmup_steps:
            return target
        start = min(self.base_lr, target)  # warm up from a small rate, never down to one
        return start + (target - start) * step / warmup_steps

    def _warmup_steps(self) -> int:
        return int(round(self.warmup_epochs * self._steps_per_epoch))

    def _set_lr(self, value: float) -> None:
        self.model.optimizer.learning_rate = value

    def on_train_begin(self, logs=None):
        self._batch.reset()
        self._done = False
        self._started_at_base_lr = False
        steps = (self.params or {}).get("steps")
        if not steps:
            raise ValueError(
                "LearningRateWarmup needs the number of steps per epoch; the dataset's size is "
                "unknown, so pass steps_per_epoch= to fit()."
            )
        self._steps_per_epoch = int(steps)
        optimizer = self.model.optimizer
        if optimizer is None:
            raise ValueError("LearningRateWarmup needs a compiled model with an optimizer.")
        try:
            optimizer.learning_rate = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
        except TypeError as e:
            raise TypeError(
                "LearningRateWarmup sets the optimizer's learning rate, so it must be a float, "
                "not a LearningRateSchedule. Follow the warmup with a callback such as "
                "keras.callbacks.LearningRateScheduler instead."
            ) from e
        if self._warmup_steps() == 0 and self._batch.value is None:
            raise ValueError(
                "warmup_epochs=0 applies the scaled rate from the first step, before the global "
                "batch can be measured: pass global_batch_size=."
            )

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._maybe_finish(epoch * self._steps_per_epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if self._done:
            return
        step = self._epoch * self._steps_per_epoch + batch
        if self._maybe_finish(step):
            return
        if self._batch.value is not None:
            self._set_lr(self.learning_rate(step, self._steps_per_epoch, self._batch.value))
        elif step == 0:
            # Not measured yet: base_lr is the right start unless the global batch turns
            # out to be below reference_batch, which on_train_batch_end warns about.
            self._set_lr(self.base_lr)
            self._started_at_base_lr = True
        # else: the first step of a run resumed mid-warmup, batch not measured yet:
        # the restored rate stays for this one step.

    def on_train_batch_end(self, batch, logs=None):
        if self._batch.value is None:
            self._batch.observe(self.model, batch + 1)
            if self._started_at_base_lr and self.target_lr < self.base_lr:
                warnings.warn(
                    f"LearningRateWarmup: the global batch ({self._batch.value}) is below "
                    f"reference_batch ({self.reference_batch}), so the rate should have been the "
                    f"target {self.target_lr:g} from the first step, but the first {batch + 1} "
                    f"step(s) ran at base_lr={self.base_lr:g} before the batch was measured. "
                    f"Pass global_batch_size={self._batch.value} to avoid this.",
                    stacklevel=2,
                )
            self._started_at_base_lr = False

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["learning_rate"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))

    def _maybe_finish(self, step: int) -> bool:
        if self._done or step < self._warmup_steps() or self.target_lr is None:
            return self._done
        self._set_lr(self.target_lr)
        self._done = True
        if self.verbose:
            print(
                f"\nEpoch {self._epoch + 1}: finished learning rate warmup to {self.target_lr:g} "
                f"(global batch {self._batch.value})."
            )
        return True


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
        self.single_replica_rate = (
            None
            if single_replica_rate is None
            else _check_positive_number("single_replica_rate", single_replica_rate)
        )
        self.global_batch_size = _check_positive_int(
            "global_batch_size", global_batch_size, optional=True
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


class ReplicaDivergenceError(RuntimeError):
    """Raised by :class:`ReplicaConsistencyCheck` when replica copies differ."""


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

    On a mismatch it raises :class:`ReplicaDivergenceError` naming the first
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
        self.every_n_steps = _check_positive_int("every_n_steps", every_n_steps)
        if not isinstance(include_optimizer, bool):
            raise TypeError(f"include_optimizer must be True or False, got {include_optimizer!r}.")
        if not isinstance(check_at_end, bool):
            raise TypeError(f"check_at_end must be True or False, got {check_at_end!r}.")
        self.include_optimizer = include_optimizer
        self.check_at_end = check_at_end
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
        """Runs the check now; raises :class:`ReplicaDivergenceError` on a mismatch.

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
