"""The grace period between SIGTERM and SIGKILL, fitted to how long a backup takes to save.

A preempted worker (SIGTERM) finishes its step, saves a backup and exits
(`keras_replicator._compat.preemption`); whoever sends SIGTERM (the launcher, Kubernetes
after ``terminationGracePeriodSeconds``, Slurm, a spot VM) sends SIGKILL after a grace
period. A SIGKILL during the save costs the work since the previous backup (backups
are committed atomically: `keras_replicator.backup_commits`), so the grace should cover
a step plus a save, with room for a loaded machine: the rule here is
``2 x (step + save) + 5`` seconds (`grace_for`).

The launcher does not know the save's duration in advance: it gives each worker a
file to record it in (``KERAS_REPLICATOR_SAVE_RECORD``: the chief writes it after
each backup, `keras_replicator.atomic_files.record_save`) and `SaveRecordWatch`
reads it while the job runs. Without ``--grace`` the launcher's grace (5 s at first)
grows to the rule's value for the longest save recorded; with ``--grace`` shorter
than that, it warns once.

Example:
    ```python
    from keras_replicator.launch.grace import grace_for

    print(grace_for(save_seconds=7.4))                    # 20
    print(grace_for(save_seconds=7.4, step_seconds=0.5))  # 21
    ```
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

from keras_replicator._validation import ArgumentError
from keras_replicator.atomic_files import read_save_record

DEFAULT_GRACE = 5.0  # seconds, before any save was measured (and the least the rule gives)
RULE = "2 x the save + 5 s"


def grace_for(save_seconds: float, step_seconds: float = 0.0) -> int:
    """The grace period (whole seconds) for a save and a step: ``2 x (step + save) + 5``.

    Example:
        ```python
        from keras_replicator.launch.grace import grace_for

        print(grace_for(30, step_seconds=10))   # 85
        ```

    Args:
        save_seconds: how long a backup takes to save.
        step_seconds: how long a training step takes (the one running at the SIGTERM finishes first).

    Returns:
        Seconds, rounded up.
    """
    if save_seconds < 0 or step_seconds < 0:
        raise ArgumentError(f"save_seconds and step_seconds must be >= 0, got {save_seconds!r}, {step_seconds!r}.")
    return int(math.ceil(2 * (save_seconds + step_seconds) + 5))


class SaveRecordWatch:
    """Reads the chief's record of its last save; adapts the grace (not given) or warns (given).

    Example:
        ```python
        import json, os, tempfile
        from keras_replicator.launch.grace import SaveRecordWatch

        path = os.path.join(tempfile.mkdtemp(), "save.json")
        watch = SaveRecordWatch(path, grace=None, say=print)
        json.dump({"seconds": 7.4, "bytes": 189_000_000}, open(path, "w"))
        watch.poll()   # prints that the grace is now 20 s
        print(watch.grace)   # 20.0
        ```

    Args:
        path: the record's file (``KERAS_REPLICATOR_SAVE_RECORD`` of the workers).
        grace: the grace the user gave (None: not given, `DEFAULT_GRACE` that grows).
        say: prints a launcher message.
    """

    def __init__(self, path: str, grace: float | None, say: Callable[[str], None]):
        self.path, self.given, self.say = path, grace is not None, say
        self.grace = float(DEFAULT_GRACE if grace is None else grace)
        self.longest = 0.0
        self._seen: float | None = None
        self._warned = False

    def poll(self) -> None:
        """Reads the record if it changed since the last poll."""
        try:
            changed = os.stat(self.path).st_mtime_ns
        except OSError:
            return
        if changed == self._seen:
            return
        self._seen = changed
        record = read_save_record(self.path)
        if record is None or float(record["seconds"]) <= self.longest:
            return
        self.longest = float(record["seconds"])
        needed = grace_for(self.longest)
        if self.given:
            if self.grace < needed and not self._warned:
                self._warned = True
                self.say(f"the last backup took {self.longest:.1f} s to save: --grace {self.grace:g} s is shorter "
                         f"than the rule's {needed} s ({RULE}); a SIGTERM's save may be killed midway (the "
                         "restart then resumes from the backup before it). Give --grace "
                         f"{needed} or more.")
        elif needed > self.grace:
            self.grace = float(needed)
            self.say(f"the last backup took {self.longest:.1f} s to save: the grace before SIGKILL is now "
                     f"{needed} s ({RULE}; --grace sets it)")
