"""Files that appear whole or not at all: a temporary file beside the target, fsync, `os.replace`.

The one place keras_replicator makes a write crash-consistent: the backups
(`backup_commits`), `ModelCheckpoint`, `kr.save_model` and the applications' run
folders (`applications._runs`) all write through `write_atomically`. The content
goes to a temporary file in the target's folder (same file system: the rename is
atomic), is flushed to the disk (`fsync`), then `os.replace` puts it in place and
the folder itself is flushed, so after a crash or a SIGKILL at any moment the
target is the old file or the new one, never part of one (POSIX rename semantics;
what `tf.train.CheckpointManager` does for its `checkpoint` state file).

On object stores (``gs://`` and the other paths `keras.src.utils.file_utils` calls
remote) an object is written whole by one upload and there is no rename: the target
is written directly.

Two records for the tests and the launcher live here too:

* `kill_point(stage)`: a test hook. With ``KERAS_REPLICATOR_KILL_AT_SAVE="stage[:n]"``
  in the environment, the process SIGKILLs itself the n-th time (default: first)
  a save reaches ``stage`` (on the first start only: not after a launcher's restart,
  ``KERAS_REPLICATOR_RESTART_COUNT`` > 0). A kill at a chosen moment, not by timing.
* `record_save(seconds, path)`: how long the last backup took to save, written
  where the launcher reads it (``KERAS_REPLICATOR_SAVE_RECORD``, which it sets), so
  that it can fit its grace period to the save.

Example:
    ```python
    import os, tempfile
    from keras_replicator import atomic_files

    path = os.path.join(tempfile.mkdtemp(), "notes.txt")

    def write(tmp):
        with open(tmp, "w") as f:
            f.write("whole")

    atomic_files.write_atomically(path, write)
    print(open(path).read())   # whole
    ```
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import uuid
from collections.abc import Callable
from typing import Any

# "gs://...", "s3://...", and the other prefixes Keras's file_utils treats as remote.
_REMOTE = re.compile(r"^(/cns|/cfs|/gcs|/hdfs|/readahead|/placer|/tfhub|.*://).*$")
KILL_ENV = "KERAS_REPLICATOR_KILL_AT_SAVE"
SAVE_RECORD_ENV = "KERAS_REPLICATOR_SAVE_RECORD"
_RESTART_ENV = "KERAS_REPLICATOR_RESTART_COUNT"  # launch.environment's name (no import: no cycle)
_reached: dict[str, int] = {}


def is_remote(path: str) -> bool:
    """Whether ``path`` is on an object store (no rename, no fsync): Keras's `file_utils` rule."""
    return bool(_REMOTE.match(str(path)))


def fsync_path(path: str) -> None:
    """Flushes a local file or folder to the disk (a no-op on object stores and where not allowed)."""
    if is_remote(path):
        return
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) if os.path.isdir(path) else os.O_RDONLY
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a folder: the rename is still atomic
        pass
    finally:
        os.close(fd)


def temporary_path(path: str) -> str:
    """A fresh temporary name beside ``path``, with the same extension (Keras's savers pick the
    format from it): ``folder/.tmp-<random>-name``."""
    folder, name = os.path.split(os.fspath(path))
    return os.path.join(folder, f".tmp-{uuid.uuid4().hex[:8]}-{name}")


_TEMPORARY = re.compile(r"^\.tmp-[0-9a-f]{8}-(.+)$")


def is_temporary(name: str) -> bool:
    """Whether the file name ``name`` is one of `temporary_path`'s (left by a killed write)."""
    return bool(_TEMPORARY.match(name))


def _remove_stale_temporaries(path: str) -> None:
    """Removes the temporaries of ``path`` that killed writes left beside it."""
    folder, name = os.path.split(path)
    for other in os.listdir(folder or "."):
        match = _TEMPORARY.match(other)
        if match and match.group(1) == name:
            try:
                os.remove(os.path.join(folder, other))
            except OSError:  # another writer's, gone already
                pass


def write_atomically(path: str, write: Callable[[str], Any]) -> bool:
    """``write(tmp)``, then ``tmp`` replaces ``path`` in one step (after an fsync).

    ``write`` is given a temporary path in ``path``'s folder and writes the whole
    content there. ``write`` returning ``False`` means it wrote nothing (a worker
    other than the chief, whose saves go elsewhere): then nothing is replaced and
    this returns ``False``; else ``True``. If ``write`` raises, the temporary file
    is removed and ``path`` is left as it was. After the replacement, the temporaries
    of ``path`` that killed writes left are removed.

    Example:
        ```python
        import json, os, tempfile
        from keras_replicator.atomic_files import write_atomically

        path = os.path.join(tempfile.mkdtemp(), "state.json")
        write_atomically(path, lambda tmp: json.dump({"step": 3}, open(tmp, "w")))
        print(json.load(open(path)))   # {'step': 3}
        ```

    Args:
        path: the file to write (local, or on an object store: then written directly).
        write: called with the path to write the content to.

    Returns:
        Whether ``path`` was written.
    """
    path = os.fspath(path)
    if is_remote(path):  # an object appears whole at the end of its upload; no rename there
        return write(path) is not False
    tmp = temporary_path(path)
    try:
        if write(tmp) is False:
            return False
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.remove(tmp)  # half written: the old file stays, and nothing else
        raise
    fsync_path(os.path.dirname(path) or ".")
    _remove_stale_temporaries(path)
    return True


def write_json_atomically(path: str, value: Any) -> None:
    """``value`` as JSON at ``path``, atomically (through `write_atomically`)."""

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(value, f)
            f.flush()

    write_atomically(path, write)


def kill_point(stage: str) -> None:
    """The test hook: SIGKILLs this process if ``KERAS_REPLICATOR_KILL_AT_SAVE`` names ``stage``.

    ``"stage"`` or ``"stage:n"`` (the n-th time a save reaches ``stage`` in this process,
    counted from 1). Acts on a job's first start only (``KERAS_REPLICATOR_RESTART_COUNT``
    unset or 0), so that a restarted job runs on.
    """
    spec = os.environ.get(KILL_ENV)
    if not spec or os.environ.get(_RESTART_ENV, "0") not in ("", "0"):
        return
    name, _, nth = spec.partition(":")
    if name != stage:
        return
    _reached[stage] = _reached.get(stage, 0) + 1
    if _reached[stage] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # the signal is delivered before this returns


def record_save(seconds: float, nbytes: int) -> None:
    """Writes how long the last backup took (and its size) where the launcher reads it.

    The path is ``KERAS_REPLICATOR_SAVE_RECORD`` (set by ``keras-replicator launch``);
    nothing is written without it.
    """
    path = os.environ.get(SAVE_RECORD_ENV)
    if path:
        try:
            write_json_atomically(path, {"seconds": round(float(seconds), 3), "bytes": int(nbytes),
                                         "time": time.time()})
        except OSError:  # the launcher's folder went away: the record is advice, never a failure
            pass


def read_save_record(path: str) -> dict | None:
    """The record `record_save` wrote at ``path`` (None: none yet, or unreadable)."""
    try:
        with open(path) as f:
            record = json.load(f)
        return record if isinstance(record, dict) and "seconds" in record else None
    except (OSError, ValueError):
        return None
