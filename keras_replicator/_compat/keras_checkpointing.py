"""Keras's checkpointing callbacks in multi-worker jobs: only the chief writes.

Patches `ModelCheckpoint._save_model` and `BackupAndRestore._save_model`,
`on_train_begin`, `on_train_end` (keras.src.callbacks; checked on Keras 3.15), and
reads `BackupAndRestore`'s private path attributes and `_current_epoch`. Acts only for
keras_replicator's strategies (the chief-only writes with more than one worker).
`PATCHES` are installed by `keras_replicator._compat.install()` (undone by
`uninstall()`): callbacks run outside any strategy scope.
`BackupAndRestore.on_train_begin` also resumes mid-epoch from a backup written
at a preemption (`preemption`): it hands the step to the trainer's epoch
iterator (`mid_epoch_resume.resume_current_fit_at`). Every backup the chief writes
also records where the data stands (`keras_replicator.resume.data_state`: the
shuffles' epoch order, the global batch, the shape), so that the restored run reads
the uninterrupted run's examples, on another number of replicas too
(`keras_replicator.resume.plan` checks the new shape first).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

import tensorflow as tf
from keras.src.callbacks import backup_and_restore, model_checkpoint

from keras_replicator import resume
from keras_replicator._compat import mid_epoch_resume
from keras_replicator._compat.patching import ScopedPatch, multi_worker, ours


def _callback_strategy(callback):
    model = getattr(callback, "model", None)
    strategy = getattr(model, "_distribute_strategy", None)
    return strategy if multi_worker(strategy) else None


class _PathsRedirected:
    """On a non-chief worker, points a callback's output paths into a temporary directory.

    Every worker runs the same save (the same reads of every variable, so any
    collective a read needs happens on all workers alike), but only the chief's
    files land where the user asked; the others' are removed afterwards.
    """

    def __init__(self, callback, attributes, strategy):
        self.callback, self.attributes = callback, attributes
        self.tmp = tempfile.mkdtemp(prefix=f"keras_replicator_worker{strategy.worker_index}_")

    def redirect(self, path: str) -> str:
        return os.path.join(self.tmp, os.path.basename(str(path).rstrip("/\\")) or "out")

    def __enter__(self):
        self.saved = {a: getattr(self.callback, a) for a in self.attributes}
        for a, path in self.saved.items():
            setattr(self.callback, a, self.redirect(path))
        return self

    def __exit__(self, *exc):
        for a, path in self.saved.items():
            setattr(self.callback, a, path)
        shutil.rmtree(self.tmp, ignore_errors=True)
        return False


# Added to BackupAndRestore's training_metadata.json: the steps of "epoch" already done.
STEP_KEY = "keras_replicator_step_in_epoch"


def save_mid_epoch(backup, epoch: int, step: int, is_chief: bool) -> None:
    """Writes `backup`'s files at `step` steps into `epoch` (Keras resumes at `epoch`).

    Sets the private `_current_epoch` (the epoch Keras writes) and adds `STEP_KEY` to
    the metadata file at `_training_metadata_path`; the weights and optimizer state are
    written by `_save_model` (patched below: only the chief writes where asked).
    """
    backup._current_epoch = epoch
    backup._kr_mid_epoch = True
    try:
        backup._save_model()  # the weights and optimizer state; the chief writes (keras_checkpointing)
    finally:
        del backup._kr_mid_epoch
    if is_chief:
        _update_metadata(backup, {STEP_KEY: int(step)})


# Added to the metadata by every backup of our strategies: keras_replicator.resume.data_state.
DATA_KEY = "keras_replicator_data"


def _update_metadata(backup, entries: dict) -> None:
    with open(backup._training_metadata_path) as f:
        metadata = json.load(f)
    metadata.update(entries)
    with open(backup._training_metadata_path, "w") as f:
        json.dump(metadata, f)


def _read_metadata(backup) -> dict:
    path = backup._training_metadata_path
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def read_step_in_epoch(backup) -> int:
    """The steps of the restored epoch already done (0: none, or no mid-epoch backup)."""
    return int(_read_metadata(backup).get(STEP_KEY, 0))


def fit_iterator():
    """The running `fit`'s epoch iterator (a weak reference), for `data_state`: call from
    ``on_train_begin``, before `evaluate` or `fit`'s validation make iterators of their own."""
    return mid_epoch_resume.fit_iterator()


def data_state(strategy, mid_epoch: bool, fit_iterator) -> dict | None:
    """`resume.data_state` of a running `fit` (its `fit_iterator()`), for a backup that resumes at
    the running epoch (``mid_epoch``) or at the next one (written at an epoch's end); None for
    other strategies."""
    if not ours(strategy):
        return None
    position = resume.input_position(mid_epoch_resume.distributed_dataset(fit_iterator))
    return resume.data_state(mid_epoch_resume.epoch_draw(mid_epoch, fit_iterator), position,
                             strategy.num_replicas_in_sync, strategy.num_workers)


def _data_state(backup, strategy) -> dict:
    """`data_state` for a backup being written: mid-epoch (our preemption save, or Keras's
    integer ``save_freq``, whose restore restarts the running epoch), else at an epoch's end."""
    mid_epoch = getattr(backup, "_kr_mid_epoch", False) or isinstance(backup.save_freq, int)
    return data_state(strategy, mid_epoch, getattr(backup, "_kr_fit_iterator", None))


# Only the chief writes ``ModelCheckpoint`` and ``BackupAndRestore`` files.
#
# Why: Keras 3's callbacks (3.15) know nothing of workers, so every worker
# would write the same files concurrently. On a non-chief worker of our
# multi-worker strategies the output paths point into a temporary directory
# that is removed after each save, the backup is not deleted at the end of
# training (the chief does that), and after ``BackupAndRestore`` restored,
# the workers check that they all resume from the same epoch (the backup must
# be on storage every worker reads).


def _mc_save_model(original_mc_save):
    def mc_save_model(self, epoch, batch, logs):
        strategy = _callback_strategy(self)
        if strategy is None or strategy.is_chief:
            return original_mc_save(self, epoch, batch, logs)
        redirect = _PathsRedirected(self, (), strategy)
        original_get = self._get_file_path
        self._get_file_path = lambda *a: redirect.redirect(original_get(*a))
        try:
            with redirect:
                return original_mc_save(self, epoch, batch, logs)
        finally:
            del self._get_file_path

    return mc_save_model


_BR_PATHS = ("backup_dir", "_weights_path", "_training_metadata_path", "_prev_weights_path",
             "_prev_training_metadata_path")


def _br_save_model(original_br_save):
    def br_save_model(self):
        strategy = getattr(getattr(self, "model", None), "_distribute_strategy", None)
        if not ours(strategy):
            return original_br_save(self)
        state = _data_state(self, strategy)
        if not multi_worker(strategy) or strategy.is_chief:
            result = original_br_save(self)
            _update_metadata(self, {DATA_KEY: state})
            return result
        with _PathsRedirected(self, _BR_PATHS, strategy):
            return original_br_save(self)

    return br_save_model


def _br_on_train_end(original_br_end):
    def br_on_train_end(self, logs=None):
        strategy = _callback_strategy(self)
        if strategy is None or strategy.is_chief:
            return original_br_end(self, logs)

    return br_on_train_end


def _br_on_train_begin(original_br_begin):
    def br_on_train_begin(self, logs=None):
        result = original_br_begin(self, logs)
        strategy = getattr(getattr(self, "model", None), "_distribute_strategy", None)
        self._kr_fit_iterator = fit_iterator()  # whose data position this fit's backups record
        step = read_step_in_epoch(self) if ours(strategy) else 0
        epoch = int(getattr(self.model, "_initial_epoch", None) or 0)
        if multi_worker(strategy):
            # All equal iff n * sum(e^2) == sum(e)^2 (integers: exact), for epochs and steps.
            values = tf.constant([epoch, epoch * epoch, step, step * step], tf.int64)
            e, e2, s, s2 = (int(v) for v in strategy.reduce("SUM", values, axis=None))
            n = strategy.num_workers
            if n * e2 != e * e or n * s2 != s * s:
                where = f"epoch {epoch}" + (f", step {step}" if step else "")
                raise RuntimeError(
                    f"BackupAndRestore: the workers restored different epochs; worker "
                    f"{strategy.worker_index} restored {where} from {self.backup_dir!r}. The "
                    "chief writes the backup; backup_dir must be on storage that every worker reads "
                    "(a shared file system or bucket)."
                )
        if ours(strategy):
            _resume(self, strategy, epoch, step)
        return result

    return br_on_train_begin


def _resume(backup, strategy, epoch: int, step: int) -> None:
    saved = _read_metadata(backup).get(DATA_KEY) if os.path.exists(backup._weights_path) else None
    if saved is not None or step:
        resume_fit(strategy, epoch, step, saved)


def resume_fit(strategy, epoch: int, step: int, saved: dict | None) -> None:
    """Checks the shape against a backup's `data_state` (before any step); sets where `fit` resumes."""
    if not ours(strategy):
        mid_epoch_resume.resume_current_fit_at(epoch, step)
        return
    where = resume.plan(saved, step, replicas=strategy.num_replicas_in_sync, workers=strategy.num_workers,
                        position=resume.input_position(mid_epoch_resume.distributed_dataset()))
    if where.inexact and strategy.is_chief:
        print(f"keras_replicator: resuming epoch {epoch} at step {where.step}: {where.inexact}",
              file=sys.stderr, flush=True)
    mid_epoch_resume.resume_current_fit_at(epoch, where.step, where.epoch_draw)


# Installed by keras_replicator._compat.install(), undone by uninstall().
PATCHES = (
    ScopedPatch(model_checkpoint.ModelCheckpoint, "_save_model", _mc_save_model),
    ScopedPatch(backup_and_restore.BackupAndRestore, "_save_model", _br_save_model),
    ScopedPatch(backup_and_restore.BackupAndRestore, "on_train_end", _br_on_train_end),
    ScopedPatch(backup_and_restore.BackupAndRestore, "on_train_begin", _br_on_train_begin),
)
