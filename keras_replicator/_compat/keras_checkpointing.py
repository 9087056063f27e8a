"""Keras's checkpointing in multi-worker jobs and its crash consistency: only the chief writes, atomically.

Patches `ModelCheckpoint._save_model` and `BackupAndRestore._save_model`,
`on_train_begin`, `on_train_end` (keras.src.callbacks), `Model.save` and
`Model.save_weights` (keras.src.models.model; checked on Keras 3.15), and reads and
sets `BackupAndRestore`'s private path attributes, `_current_epoch` and calls its
`_load_model`. Acts only for keras_replicator's strategies (the chief-only writes
with more than one worker; the committed backups under the synchronous ones and
`AsyncReplicatorStrategy`). `PATCHES` are installed by `keras_replicator._compat.install()`
(undone by `uninstall()`): callbacks run outside any strategy scope.

Crash consistency (`keras_replicator.backup_commits`): Keras 3.15's `BackupAndRestore`
writes ``latest.weights.h5`` and then ``training_metadata.json`` in place, so a kill
during a save leaves a torn backup that every restart fails on. Under our strategies
(`AsyncReplicatorStrategy` included) each backup is a new folder committed by a pointer
written last (the previous one stays until then); `on_train_begin` restores the newest whole backup and skips the
others with one warning (in a multi-worker job every worker restores the chief's
choice). ``double_checkpoint=True`` keeps the two newest committed backups.
`Model.save` and `save_weights` of a model built under our strategies (so also
`ModelCheckpoint`'s files) write a temporary file beside the target and rename it
(`keras_replicator.atomic_files`): a file appears whole or not at all.

`BackupAndRestore.on_train_begin` also resumes mid-epoch from a backup written
at a preemption (`preemption`): it hands the step to the trainer's epoch
iterator (`mid_epoch_resume.resume_current_fit_at`). Every backup the chief writes
also records where the data stands (`keras_replicator.resume.data_state`: the
shuffles' epoch order, the global batch, the shape), so that the restored run reads
the uninterrupted run's examples, on another number of replicas too
(`keras_replicator.resume.plan` checks the new shape first).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings

import tensorflow as tf
from keras.src.callbacks import backup_and_restore, model_checkpoint
from keras.src.models import model as keras_model

from keras_replicator import atomic_files, backup_commits, resume
from keras_replicator._compat import mid_epoch_resume
from keras_replicator._compat.patching import ScopedPatch, multi_worker, ours, ours_async


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


def save_mid_epoch(backup, epoch: int, step: int) -> None:
    """Writes and commits `backup`'s files at `step` steps into `epoch` (Keras resumes at `epoch`).

    Sets the private `_current_epoch` (the epoch Keras writes); `STEP_KEY` goes into the
    metadata before the commit. The weights and optimizer state are written by
    `_save_model` (patched below: only the chief writes where asked, and commits).
    """
    backup._current_epoch = epoch
    backup._kr_mid_epoch = int(step)
    try:
        backup._save_model()
    finally:
        del backup._kr_mid_epoch


# Added to the metadata by every backup of our strategies: keras_replicator.resume.data_state.
DATA_KEY = "keras_replicator_data"


def _read_metadata(backup) -> dict:
    """The metadata of the backup `on_train_begin` restored ({}: none)."""
    return getattr(backup, "_kr_restored", None) or {}


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
    mid_epoch = getattr(backup, "_kr_mid_epoch", None) is not None or isinstance(backup.save_freq, int)
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


def _backups(callback) -> backup_commits.BackupDirectory:
    # Keras's double_checkpoint ("save 2 last training states"): the two newest committed backups.
    return backup_commits.BackupDirectory(str(callback.backup_dir), keep=2 if callback.double_checkpoint else 1)


@contextlib.contextmanager
def _kill_point_in_weights(model):
    """The test hook's "weights" stage: when the optimizer's state is about to be written
    (the weights file begun, not whole). Only while the hook's variable is set."""
    optimizer = getattr(model, "optimizer", None)
    if not os.environ.get(atomic_files.KILL_ENV) or optimizer is None:
        yield
        return
    original, own = optimizer.save_own_variables, "save_own_variables" in vars(optimizer)

    def save_own_variables(store):
        atomic_files.kill_point("weights")
        return original(store)

    optimizer.save_own_variables = save_own_variables
    try:
        yield
    finally:
        if own:
            optimizer.save_own_variables = original
        else:
            del optimizer.save_own_variables


def _commit_backup(self, original_br_save, state):
    """The chief's backup: Keras's files written into a new folder, then committed."""
    started = time.monotonic()
    backups = _backups(self)
    staging = backups.stage()
    saved = {a: getattr(self, a) for a in _BR_PATHS}
    self.backup_dir = staging.path
    self._weights_path = self._prev_weights_path = staging.weights_path
    self._training_metadata_path = self._prev_training_metadata_path = staging.metadata_path
    try:
        with _kill_point_in_weights(self.model), _plain_saves():
            result = original_br_save(self)  # Keras's weights file, then its metadata
        atomic_files.kill_point("optimizer")  # the weights file whole (weights and optimizer state)
        metadata = backup_commits.read_json(staging.metadata_path)  # Keras's: the epoch and the batch
        metadata[DATA_KEY] = state
        step = getattr(self, "_kr_mid_epoch", None)
        if step is not None:
            metadata[STEP_KEY] = step
        backup = backups.commit(staging, metadata)
    finally:
        for a, path in saved.items():
            setattr(self, a, path)
    atomic_files.record_save(time.monotonic() - started,
                             backup.metadata[backup_commits.COMMIT_KEY]["weights_bytes"])
    return result


def _committed_layout(callback) -> bool:
    """Whether ``callback.backup_dir`` holds backups in the committed layout (written under our
    strategies): then a `fit` without them (a model moved to one device) reads and writes it the
    same way, so it neither starts over nor leaves a newer in-place backup the next restart
    would not see. Looked up once per `fit` (at its start)."""
    found = getattr(callback, "_kr_committed_layout", None)
    if found is None:
        found = _backups(callback).pointer() is not None
        callback._kr_committed_layout = found
    return found


# Under `AsyncReplicatorStrategy` too, backups are committed.
#
# Why: there callbacks run on the chief only, which reads the variables from the parameter
# servers and writes Keras's files; in place, a kill (or a parameter server lost) during the save
# would leave a torn backup that every restart fails on. So the chief writes each backup into a
# new folder committed by its pointer, as under the synchronous strategies (without their
# `data_state`: the asynchronous regime streams its data, it does not resume within it), and
# restores the newest whole backup.


def _async_save(backup, original_br_save):
    """The chief's backup under `AsyncReplicatorStrategy`: committed, without a data state."""
    return _commit_backup(backup, original_br_save, None)


def _async_restore(backup) -> None:
    """`on_train_begin` under `AsyncReplicatorStrategy`: the newest whole backup (the chief, the
    only task that runs callbacks, chooses; the variables it loads are on the parameter servers)."""
    backup._kr_committed_layout = True  # this fit's backups: committed
    _restore(backup, None)


def _br_save_model(original_br_save):
    def br_save_model(self):
        strategy = getattr(getattr(self, "model", None), "_distribute_strategy", None)
        if ours_async(strategy):
            return _async_save(self, original_br_save)
        if not ours(strategy):
            if _committed_layout(self):
                return _commit_backup(self, original_br_save, None)
            return original_br_save(self)
        state = _data_state(self, strategy)
        if not multi_worker(strategy) or strategy.is_chief:
            return _commit_backup(self, original_br_save, state)
        with _PathsRedirected(self, _BR_PATHS, strategy), _kill_point_in_weights(self.model):
            result = original_br_save(self)
        atomic_files.kill_point("optimizer")
        return result

    return br_save_model


def _br_on_train_end(original_br_end):
    def br_on_train_end(self, logs=None):
        strategy = _callback_strategy(self)
        if strategy is None or strategy.is_chief:
            return original_br_end(self, logs)

    return br_on_train_end


def _agree_on_the_chiefs(strategy, code: int) -> int:
    """The chief's ``code`` on every worker (a sum of [code, 1] from the chief only, divided:
    independent of how often a worker's value is counted)."""
    mine = [code, 1] if strategy.is_chief else [0, 0]
    total, chiefs = (int(v) for v in strategy.reduce("SUM", tf.constant(mine, tf.int64), axis=None))
    return total // chiefs


def _restore(self, strategy) -> None:
    """Loads the newest whole backup (the chief's choice in a multi-worker job); warns once
    about the others, and the chief removes them."""
    backups = _backups(self)
    whole = backups.complete()
    in_place = None if whole else backups.in_place_backup()  # Keras's own layout (before this protocol)
    code = whole[0].number + 2 if whole else 1 if in_place else 0
    if multi_worker(strategy):
        code = _agree_on_the_chiefs(strategy, code)
    # A worker that cannot read the chief's choice restores nothing: `on_train_begin`'s check
    # of the restored epochs then stops every worker with the reason (not one worker alone).
    chosen = next((b for b in whole if b.number == code - 2), None)
    if code == 1 and in_place is None:
        code = 0
    paths = {a: getattr(self, a) for a in _BR_PATHS}
    none = os.path.join(str(self.backup_dir), "none")
    weights, metadata = ((chosen.weights_path, chosen.metadata_path) if chosen
                         else in_place if code == 1 else (none, none))
    self._weights_path, self._training_metadata_path = weights, metadata
    restored_from = None if weights == none else weights
    try:
        self._load_model()
        self._kr_restored = chosen.metadata if chosen else _in_place_metadata(metadata)
    except OSError as e:
        if chosen is not None:
            raise  # whole by its CRC-32: not a torn file (another model?); Keras's error
        backups.skipped.append((weights, f"it cannot be opened ({e})"))
        self._weights_path = self._training_metadata_path = none
        self._load_model()  # the built-model check only
        self._kr_restored, restored_from = None, None
    finally:
        for a, path in paths.items():
            setattr(self, a, path)
    message = backups.skip_message(chosen.path if chosen else restored_from)
    if message:
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    if strategy is None or strategy.is_chief:
        backups.remove_stale(chosen.number if chosen else None)


def _in_place_metadata(path: str) -> dict | None:
    try:
        return backup_commits.read_json(path)
    except Exception:  # OSError, ValueError; tf.io.gfile's errors on object stores
        return None


def _br_on_train_begin(original_br_begin):
    def br_on_train_begin(self, logs=None):
        strategy = getattr(getattr(self, "model", None), "_distribute_strategy", None)
        self._kr_committed_layout = None  # looked up again for this fit
        if ours_async(strategy):
            return _async_restore(self)
        if not ours(strategy):
            if not _committed_layout(self):
                return original_br_begin(self, logs)
            # A backup written under our strategies, resumed without them (e.g. on one device):
            # the same restore; the epoch resumes, a preemption's step within it does not.
            return _restore(self, None)
        _restore(self, strategy)
        self._kr_fit_iterator = fit_iterator()  # whose data position this fit's backups record
        step = read_step_in_epoch(self)
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
        _resume(self, strategy, epoch, step)

    return br_on_train_begin


def _resume(backup, strategy, epoch: int, step: int) -> None:
    saved = _read_metadata(backup).get(DATA_KEY)
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


# `Model.save` and `save_weights` of a model under our strategies write atomically.
#
# Why: Keras 3.15 writes the file in place, so a kill during `ModelCheckpoint(save_best_only=True)`
# leaves the best file half-written. A temporary file beside the target is renamed over it
# (`atomic_files.write_atomically`). Not for object stores (one upload is whole already), a sharded
# `save_weights` (several files), `zipped=False` (a folder), or when Keras must ask before
# overwriting (``overwrite=False`` and the file exists: Keras's own prompt).
_plain = threading.local()


@contextlib.contextmanager
def _plain_saves():
    """Inside a backup's folder (committed as a whole): Keras's saves as they are."""
    _plain.active = True
    try:
        yield
    finally:
        _plain.active = False


def _atomic_target(model, filepath, overwrite: bool, single_file: bool) -> str | None:
    if getattr(_plain, "active", False) or not single_file or not ours(getattr(model, "_distribute_strategy", None)):
        return None
    if not isinstance(filepath, (str, os.PathLike)):
        return None
    path = os.fspath(filepath)
    if atomic_files.is_remote(path) or os.path.isdir(path) or (not overwrite and os.path.exists(path)):
        return None
    return path


def _atomically(path: str, write) -> None:
    def write_then_mark(tmp):
        write(tmp)
        atomic_files.kill_point("file")  # the test hook: the file written, not yet in place

    atomic_files.write_atomically(path, write_then_mark)


def _model_save_weights(original):
    def save_weights(self, filepath, overwrite=True, max_shard_size=None):
        path = _atomic_target(self, filepath, overwrite, max_shard_size is None)
        if path is None:
            # max_shard_size is from Keras 3.10: passed on only when given.
            sharded = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
            return original(self, filepath, overwrite=overwrite, **sharded)
        _atomically(path, lambda tmp: original(self, tmp, overwrite=True))

    return save_weights


def _model_save(original):
    def save(self, filepath, overwrite=True, zipped=None, **kwargs):
        path = _atomic_target(self, filepath, overwrite, zipped is not False)
        if path is None:
            return original(self, filepath, overwrite=overwrite, zipped=zipped, **kwargs)
        _atomically(path, lambda tmp: original(self, tmp, overwrite=True, zipped=zipped, **kwargs))

    return save


# Installed by keras_replicator._compat.install(), undone by uninstall().
PATCHES = (
    ScopedPatch(model_checkpoint.ModelCheckpoint, "_save_model", _mc_save_model),
    ScopedPatch(backup_and_restore.BackupAndRestore, "_save_model", _br_save_model),
    ScopedPatch(backup_and_restore.BackupAndRestore, "on_train_end", _br_on_train_end),
    ScopedPatch(backup_and_restore.BackupAndRestore, "on_train_begin", _br_on_train_begin),
    ScopedPatch(keras_model.Model, "save_weights", _model_save_weights),
    ScopedPatch(keras_model.Model, "save", _model_save),
)
