"""Crash-consistent backups: each one a new folder, committed by a pointer written last.

The protocol of `tf.train.CheckpointManager` and Orbax, for the files of Keras's
`BackupAndRestore` (``latest.weights.h5``: the weights and the optimizer state;
``training_metadata.json``: the epoch, the step, where the data stands). In
``backup_dir``:

* a save writes its files into a new folder ``tmp-<n>-<random>/`` (on an object
  store, ``backup-<n>/`` directly), flushes them (`fsync`), and records in its
  metadata the backup's number ``n`` and the weights file's size and CRC-32;
* on a local or shared file system the folder is renamed ``backup-<n>/`` (atomic);
* the commit: ``committed.json``, naming ``backup-<n>``, replaces the previous one
  atomically (`atomic_files.write_atomically`; on an object store one upload, written
  last). Only then are the older backups deleted (all but the ``keep`` newest).

A kill at any moment leaves the previous committed backup as the latest: a restart
loses at most the work since it. On restore, `BackupDirectory.complete` lists the
backups whose files are whole (the metadata names the folder's own number, the
weights file's size and CRC-32 match), newest first, among those the pointer
committed (a folder numbered above the pointer's was never committed); everything
else is reported once by `skip_message` and removed by `remove_stale`.

Example:
    ```python
    import os, tempfile
    from keras_replicator.backup_commits import BackupDirectory

    backups = BackupDirectory(tempfile.mkdtemp())
    staging = backups.stage()
    with open(os.path.join(staging.path, "latest.weights.h5"), "wb") as f:
        f.write(b"weights")
    backups.commit(staging, {"epoch": 1, "batch": 0})
    print([b.number for b in backups.complete()])   # [0]
    ```
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import uuid
import zlib

from keras_replicator import atomic_files

WEIGHTS = "latest.weights.h5"  # Keras's own file names, inside each backup's folder
METADATA = "training_metadata.json"
POINTER = "committed.json"
COMMIT_KEY = "keras_replicator_commit"  # in the metadata: the backup's number, its weights' size and CRC-32
_COMMITTED = re.compile(r"^backup-(\d+)$")
_STAGING = re.compile(r"^tmp-(\d+)-[0-9a-f]+$")
_CHUNK = 1 << 22


def crc32(path: str) -> int:
    """The CRC-32 of a file's bytes (zlib's, read in 4 MiB chunks)."""
    value = 0
    with _open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            value = zlib.crc32(chunk, value)
    return value


def read_json(path: str):
    """The JSON at ``path`` (local or on an object store)."""
    with _open(path, "r") as f:
        return json.loads(f.read())


def _write_new(path: str, text: str) -> None:
    """Writes ``path`` whole: on an object store an upload replaces the object (what was there is
    removed first: some of tf.io.gfile's file systems, such as ``ram://``, append on "w")."""
    if atomic_files.is_remote(path):
        import tensorflow as tf

        if tf.io.gfile.exists(path):
            tf.io.gfile.remove(path)
    with _open(path, "w") as f:
        f.write(text)


def _open(path: str, mode: str):
    if atomic_files.is_remote(path):
        import tensorflow as tf  # only for object stores: tf.io.gfile reads them

        return tf.io.gfile.GFile(path, mode)
    return open(path, mode)


def _listdir(path: str) -> list[str]:
    if atomic_files.is_remote(path):
        import tensorflow as tf

        return [n.rstrip("/") for n in tf.io.gfile.listdir(path)] if tf.io.gfile.exists(path) else []
    return os.listdir(path) if os.path.isdir(path) else []


def _exists(path: str) -> bool:
    if atomic_files.is_remote(path):
        import tensorflow as tf

        return tf.io.gfile.exists(path)
    return os.path.exists(path)


def _size(path: str) -> int:
    if atomic_files.is_remote(path):
        import tensorflow as tf

        return tf.io.gfile.stat(path).length
    return os.path.getsize(path)


def _rmtree(path: str) -> None:
    if atomic_files.is_remote(path):
        import tensorflow as tf

        if tf.io.gfile.exists(path):
            tf.io.gfile.rmtree(path)
        return
    shutil.rmtree(path, ignore_errors=True)


def _join(folder: str, name: str) -> str:
    return f"{folder.rstrip('/')}/{name}" if atomic_files.is_remote(folder) else os.path.join(folder, name)


@dataclasses.dataclass(frozen=True)
class Staging:
    """A backup being written: its number and the folder its files go to."""

    number: int
    path: str

    @property
    def weights_path(self) -> str:
        return _join(self.path, WEIGHTS)

    @property
    def metadata_path(self) -> str:
        return _join(self.path, METADATA)


@dataclasses.dataclass(frozen=True)
class Backup(Staging):
    """A committed, whole backup: its number, folder (Keras's files, as `Staging`) and metadata
    (Keras's keys and ours)."""

    metadata: dict


class BackupDirectory:
    """The backups in one ``backup_dir``: stage, commit, list the whole ones, remove the rest.

    Example:
        ```python
        import tempfile
        from keras_replicator.backup_commits import BackupDirectory

        backups = BackupDirectory(tempfile.mkdtemp(), keep=2)
        for epoch in (1, 2, 3):
            staging = backups.stage()
            open(staging.weights_path, "wb").write(bytes([epoch]) * 100)
            backups.commit(staging, {"epoch": epoch})
        print([b.metadata["epoch"] for b in backups.complete()])   # [3, 2]
        ```

    Args:
        backup_dir: the folder (local, shared, or on an object store).
        keep: how many committed backups stay after a commit (at least 1; the
            previous one always stays until the new one is committed).
    """

    def __init__(self, backup_dir: str, keep: int = 1):
        self.backup_dir = os.fspath(backup_dir)
        self.keep = max(1, int(keep))
        self.remote = atomic_files.is_remote(self.backup_dir)
        self.skipped: list[tuple[str, str]] = []  # (path, why) found by the last `complete`

    def _path(self, name: str) -> str:
        return _join(self.backup_dir, name)

    def _numbers(self) -> dict[str, int]:
        """Every backup or staging folder's name -> its number."""
        found = {}
        for name in _listdir(self.backup_dir):
            match = _COMMITTED.match(name) or _STAGING.match(name)
            if match:
                found[name] = int(match.group(1))
        return found

    def pointer(self) -> dict | None:
        """The commit pointer's content (None: no commit yet, or unreadable)."""
        try:
            with _open(self._path(POINTER), "r") as f:
                value = json.loads(f.read())
            return value if isinstance(value, dict) and isinstance(value.get("number"), int) else None
        except (OSError, ValueError):
            return None
        except Exception as e:  # tf.io.gfile's NotFoundError on object stores
            if type(e).__name__ == "NotFoundError":
                return None
            raise

    def stage(self) -> Staging:
        """A new, empty folder for the next backup (numbered above every folder there)."""
        numbers = self._numbers()
        pointed = self.pointer()
        number = max([-1, *numbers.values(), pointed["number"] if pointed else -1]) + 1
        if self.remote:  # no rename on object stores: written in place, committed by the pointer
            path = self._path(f"backup-{number}")
            _rmtree(path)
            import tensorflow as tf

            tf.io.gfile.makedirs(path)
        else:
            os.makedirs(self.backup_dir, exist_ok=True)
            path = self._path(f"tmp-{number}-{uuid.uuid4().hex[:8]}")
            os.makedirs(path)
        return Staging(number, path)

    def commit(self, staging: Staging, metadata: dict) -> Backup:
        """Makes ``staging`` (its weights file written) the latest backup, with ``metadata``.

        Writes the metadata (with the commit record: the number, the weights' size and
        CRC-32), flushes the folder, renames it ``backup-<n>`` (local), replaces the
        pointer, then deletes all but the ``keep`` newest backups. `atomic_files.kill_point`
        marks each stage for the tests.
        """
        weights = staging.weights_path
        record = {"number": staging.number, "weights_bytes": _size(weights), "weights_crc32": crc32(weights)}
        metadata = {**metadata, COMMIT_KEY: record}
        _write_new(staging.metadata_path, json.dumps(metadata))
        atomic_files.kill_point("metadata")
        atomic_files.fsync_path(weights)
        atomic_files.fsync_path(staging.metadata_path)
        atomic_files.fsync_path(staging.path)
        atomic_files.kill_point("commit")
        final = self._path(f"backup-{staging.number}")
        if not self.remote:
            os.rename(staging.path, final)
            atomic_files.fsync_path(self.backup_dir)
            atomic_files.kill_point("renamed")
        pointer = {"number": staging.number, "backup": f"backup-{staging.number}",
                   "epoch": metadata.get("epoch"), "batch": metadata.get("batch")}
        if self.remote:  # one object, written last (without it, the newest whole backup is restored)
            _write_new(self._path(POINTER), json.dumps(pointer))
        else:
            atomic_files.write_json_atomically(self._path(POINTER), pointer)
        atomic_files.kill_point("committed")
        self.prune(staging.number)
        return Backup(staging.number, final, metadata)

    def prune(self, newest: int) -> None:
        """Deletes the committed backups older than the ``keep`` newest up to ``newest``, every
        other staging folder, and the files of a backup Keras wrote in place (before this protocol)."""
        numbers = self._numbers()
        kept = sorted((n for name, n in numbers.items() if _COMMITTED.match(name) and n <= newest),
                      reverse=True)[: self.keep]
        for name, number in numbers.items():
            if number not in kept:
                _rmtree(self._path(name))
        self._remove_in_place_files()

    def _remove_in_place_files(self) -> None:
        for name in (WEIGHTS, METADATA, f"{WEIGHTS}.bkp", f"{METADATA}.bkp"):
            path = self._path(name)
            if _exists(path):
                if self.remote:
                    import tensorflow as tf

                    tf.io.gfile.remove(path)
                else:
                    os.remove(path)
        if not self.remote:
            for name in _listdir(self.backup_dir):
                if atomic_files.is_temporary(name):  # the pointer's own temporary, left by a kill
                    os.remove(self._path(name))

    def _check(self, name: str, number: int) -> Backup | str:
        """The backup in folder ``name`` if whole, else why not."""
        path = self._path(name)
        try:
            with _open(_join(path, METADATA), "r") as f:
                metadata = json.loads(f.read())
        except Exception as e:  # OSError, ValueError; tf.io.gfile's errors on object stores
            return f"its metadata cannot be read ({type(e).__name__})"
        record = metadata.get(COMMIT_KEY) if isinstance(metadata, dict) else None
        if not isinstance(record, dict):
            return "its metadata has no commit record"
        if record.get("number") != number:
            return f"its metadata is backup {record.get('number')}'s, not this folder's ({number})"
        weights = _join(path, WEIGHTS)
        try:
            size = _size(weights)
            if size != record.get("weights_bytes"):
                return f"its weights file has {size} bytes, its metadata says {record.get('weights_bytes')}"
            if crc32(weights) != record.get("weights_crc32"):
                return "its weights file's CRC-32 differs from its metadata's (the file is corrupt)"
        except Exception as e:  # OSError; tf.io.gfile's NotFoundError on object stores
            return f"its weights file {WEIGHTS} cannot be read ({type(e).__name__})"
        return Backup(number, path, metadata)

    def complete(self) -> list[Backup]:
        """The whole, committed backups, newest first; what was found and not whole goes to `skipped`.

        A folder numbered above the pointer's was never committed (a kill before the
        pointer was written); without a pointer every whole ``backup-<n>`` counts.
        """
        pointed = self.pointer()
        limit = pointed["number"] if pointed else None
        self.skipped = []
        whole = []
        for name, number in sorted(self._numbers().items(), key=lambda item: -item[1]):
            path = self._path(name)
            if _STAGING.match(name) or (limit is not None and number > limit):
                self.skipped.append((path, "never committed (a save was interrupted)"))
                continue
            checked = self._check(name, number)
            if isinstance(checked, Backup):
                whole.append(checked)
            else:
                self.skipped.append((path, checked))
        if pointed is None and _exists(self._path(POINTER)):
            self.skipped.append((self._path(POINTER), "the commit pointer cannot be read"))
        return whole

    def in_place_backup(self) -> tuple[str, str] | None:
        """(weights, metadata) paths of a backup Keras wrote in place, without this protocol."""
        weights = self._path(WEIGHTS)
        return (weights, self._path(METADATA)) if _exists(weights) else None

    def skip_message(self, chosen: str | None) -> str | None:
        """The one warning for what `complete` skipped (None: nothing skipped)."""
        if not self.skipped:
            return None
        listed = "; ".join(f"{path}: {why}" for path, why in self.skipped)
        then = f"resuming from {chosen}" if chosen else "no whole backup is left: training starts from the beginning"
        return f"BackupAndRestore: skipped {len(self.skipped)} backup(s) that are not whole ({listed}); {then}."

    def remove_stale(self, chosen: int | None) -> None:
        """Removes every skipped folder (they are never whole); ``chosen`` and older whole ones stay."""
        for path, _ in self.skipped:
            name = os.path.basename(path.rstrip("/"))
            if name == POINTER:
                continue
            match = _COMMITTED.match(name) or _STAGING.match(name)
            if match and int(match.group(1)) != chosen:
                _rmtree(path)
