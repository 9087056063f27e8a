"""Preemption (SIGTERM) during `fit`: every worker stops after the same step, saves there, exits 143.

Uses TensorFlow's coordination service's key-value store through the private
`Context.get_config_key_value`, `set_config_key_value` and `wait_at_barrier`
(TensorFlow 2.16-2.21), and the key its preemption notifier writes on SIGTERM,
`TF_DEFAULT_PREEMPTION_NOTICE_KEY` (`tsl::PreemptionNotifier` "sigterm", the
same key `tf.distribute.experimental.PreemptionCheckpointHandler` reads as
`failure_handling.PREEMPTION_KEY`; checked on TensorFlow 2.21). The backup
itself is written by `keras_checkpointing.save_mid_epoch`.

Why: in a multi-worker job TensorFlow's coordination service catches SIGTERM
(the process keeps running and dies at the SIGKILL after the grace period,
saving nothing), and Keras's `BackupAndRestore` keeps only the epoch. Here
(the backup is committed atomically, `keras_checkpointing`: a SIGKILL after the grace
period that lands in the save costs only the work since the previous backup):

* one process: while `fit` runs under our strategy with a `BackupAndRestore`,
  a Python SIGTERM handler records the signal (the previous handler is put back
  after `fit`); the step that is running finishes, the backup is written with
  the epoch *and the step within it*, and the process exits with 143;
* several workers: a watcher thread blocks on the notice key; the first
  worker to see it at a step end proposes "stop after step n + 1" (n: the steps
  it finished; no peer can have finished more), which the others acknowledge
  before that step starts, as `PreemptionCheckpointHandler` does. Every
  worker stops after that same step, they all save (the chief writes), wait for
  each other at a barrier, and exit with 143.

The agreement is keras_replicator's own on the notice key: TensorFlow 2.21 does
not expose its C++ `PreemptionSyncManager` to Python, and
`PreemptionCheckpointHandler` wants to own the step function and a
`tf.train.Checkpoint`, which Keras's `fit` does not offer.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

import keras
import tensorflow as tf
from tensorflow.python.eager import context

from keras_replicator._compat import keras_checkpointing

# What TensorFlow's SIGTERM notifier writes in the coordination service (checked on TF 2.21).
NOTICE_KEY = "TF_DEFAULT_PREEMPTION_NOTICE_KEY"
_STOP_KEY = "keras_replicator/preemption/stop_after"
_ACK_KEY = "keras_replicator/preemption/ack/"
_SAVED_BARRIER = "keras_replicator/preemption/saved"
# The status of a process stopped by SIGTERM (128 + 15), and what TensorFlow's own
# PreemptionCheckpointHandler exits with on GCE: "restart me" for the launcher, Ray
# Train's FailureConfig and a Kubernetes restart/failure policy alike.
EXIT_CODE = 143
MODES = ("save", "fatal")
MODE_ENV = "KERAS_REPLICATOR_ON_SIGTERM"


def default_mode() -> str:
    """``KERAS_REPLICATOR_ON_SIGTERM`` if set ("save" or "fatal"), else "save"."""
    value = os.environ.get(MODE_ENV, "save").strip().lower()
    if value not in MODES:
        raise ValueError(f"{MODE_ENV} must be one of {list(MODES)}, got {value!r}.")
    return value


def make_sigterm_fatal() -> None:
    """Gives SIGTERM its default action back (the coordination service had caught it).

    Main thread only (Python's rule for `signal.signal`); elsewhere a no-op.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


class _ClusterWatch:
    """One per process: the coordination service's preemption notice and the agreed stop step."""

    def __init__(self, worker_index: int, num_workers: int, timeout: float):
        self.worker_index, self.num_workers, self.timeout = worker_index, num_workers, timeout
        self.noticed = threading.Event()
        self.stop_after: int | None = None
        self.thread = threading.Thread(target=self._watch, name="keras_replicator-preemption", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        ctx = context.context()
        try:
            self.preempted = ctx.get_config_key_value(NOTICE_KEY)  # blocks until a SIGTERM
            self.noticed.set()
            stop = int(ctx.get_config_key_value(_STOP_KEY))  # blocks until a worker proposes
            self.stop_after = stop
            ctx.set_config_key_value(f"{_ACK_KEY}{self.worker_index}", str(stop))
        except Exception:  # the service went away (the process ends): nothing to watch
            return

    def should_stop(self, done: int) -> bool:
        """Called after each step, `done` steps finished: whether to stop now."""
        if self.stop_after is None and self.noticed.is_set():
            ctx = context.context()
            try:
                ctx.set_config_key_value(_STOP_KEY, str(done + 1))
            except tf.errors.OpError:  # AlreadyExists: another worker proposed first, its value holds
                pass
            self.stop_after = int(ctx.get_config_key_value(_STOP_KEY))
            # Nobody may finish the stop step before knowing it: wait for every acknowledgement.
            for i in range(self.num_workers):
                ctx.get_config_key_value(f"{_ACK_KEY}{i}", timeout_in_ms=int(self.timeout * 1000))
        return self.stop_after is not None and done >= self.stop_after

    def saved(self) -> None:
        """Waits until every worker saved (the chief's files are complete before anyone exits)."""
        context.context().wait_at_barrier(_SAVED_BARRIER, int(self.timeout * 1000))


_cluster_watch: _ClusterWatch | None = None
_steps_done = 0  # this process's training steps (calls of the train function) in every fit


def _cluster(strategy) -> _ClusterWatch:
    global _cluster_watch
    if _cluster_watch is None:
        _cluster_watch = _ClusterWatch(
            strategy.worker_index, strategy.num_workers, strategy.extended.failure_timeout
        )
    return _cluster_watch


class _LocalWatch:
    """One process: a SIGTERM handler while `fit` runs; the previous one is put back after."""

    def __init__(self):
        self.received = threading.Event()
        self.previous = None

    def __enter__(self):
        self.previous = signal.signal(signal.SIGTERM, lambda signum, frame: self.received.set())
        return self

    def __exit__(self, *exc):
        signal.signal(signal.SIGTERM, self.previous if self.previous is not None else signal.SIG_DFL)
        return False

    def should_stop(self, done: int) -> bool:
        return self.received.is_set()

    def saved(self) -> None:
        pass


def _find_backup(callbacks):
    for cb in callbacks or ():
        if isinstance(cb, keras.callbacks.BackupAndRestore):
            return cb
    return None


class _StopAtPreemption(keras.callbacks.Callback):
    """Appended last to `fit`'s callbacks: checks for preemption after every step."""

    def __init__(self, watch, backup, strategy):
        super().__init__()
        self.watch, self.backup, self.strategy = watch, backup, strategy
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        global _steps_done
        _steps_done += 1
        if not self.watch.should_stop(_steps_done):
            return
        started = time.monotonic()
        if self.backup is not None:
            keras_checkpointing.save_mid_epoch(self.backup, self.epoch, batch + 1)
        self.watch.saved()
        where = f"after step {batch + 1} of epoch {self.epoch}"
        what = f"saved to {self.backup.backup_dir!r}" if self.backup is not None else "nothing saved"
        print(
            f"keras_replicator: SIGTERM (preemption): stopped {where}, {what} in "
            f"{time.monotonic() - started:.1f} s; exiting with {EXIT_CODE} (restart to resume).",
            file=sys.stderr, flush=True,
        )
        sys.stdout.flush()
        raise SystemExit(EXIT_CODE)


def fit_callbacks(strategy, callbacks, mode: str):
    """(callbacks for `fit` with the preemption check appended, context manager to run it in)."""
    if mode != "save" or not isinstance(callbacks, (list, tuple, type(None))):
        return callbacks, contextlib.nullcontext()  # a CallbackList is the caller's own
    listed = list(callbacks or ())
    backup = _find_backup(listed)
    if strategy.num_workers > 1:
        return listed + [_StopAtPreemption(_cluster(strategy), backup, strategy)], contextlib.nullcontext()
    if backup is None or threading.current_thread() is not threading.main_thread():
        return callbacks, contextlib.nullcontext()  # SIGTERM keeps its usual effect
    watch = _LocalWatch()
    return listed + [_StopAtPreemption(watch, backup, strategy)], watch
