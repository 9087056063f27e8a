"""Crash-consistent backups under AsyncReplicatorStrategy: a kill at any stage of a save resumes
from the last complete backup, as under the synchronous strategies
(tests/test_crash_consistent_backups.py).

Each job is a chief, a worker and a parameter server of ``tests/async_job.py backup`` (epochs
of 4 steps, SGD with momentum, `BackupAndRestore` after each epoch) on 127.0.0.1. The kill comes
from the test hook `keras_replicator.atomic_files.kill_point` (``KERAS_REPLICATOR_KILL_AT_SAVE``:
the chief SIGKILLs itself when the second backup's save of its start reaches the stage), and once
from the job itself in the middle of writing that backup's weights file: never from timing.
The whole job is then restarted with the same command and must restore exactly the weights and
the update count that the last committed backup holds (the chief recorded them at the end of
that epoch, before the save) and go on from that epoch. The kills come one after the other in
one chain of starts, so that each start (a process for every task: TensorFlow's start-up is
most of a start's cost) is both the restart after one kill and, one backup later, the next kill;
the last start runs the remaining epochs and ends with exit code 0. Asynchronous training
depends on timing, so each restart's weights are compared with the backup it restored, not with
an uninterrupted run. Every process is killed (its whole group) at the end.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from keras_replicator import atomic_files
from tests.helpers import committed_backup_metadata
from tests.test_async import Job

pytestmark = pytest.mark.devices(1)

STEPS = 4  # as in the job's backup mode
# Where a save can be killed, in order (tests/test_crash_consistent_backups.py's stages): before
# "committed" the restart resumes from the backup before the killed one, after it from that one.
STAGES = ("weights", "optimizer", "metadata", "commit", "renamed", "committed")
# And a kill that does not come from keras_replicator's hook: the job's own, in the middle of
# writing the start's second backup's weights file (Keras alone leaves that file torn, and the
# restart fails).
TORN = "torn"
KILLS = {**{s: {atomic_files.KILL_ENV: f"{s}:2"} for s in STAGES}, TORN: {"KR_TEST_TEAR_SAVE": "2"}}
# Each start commits one backup, then is killed in the next save: the chain's backups point one
# epoch further after each kill, two after "committed"; the last start runs the epoch after them.
EPOCHS = len(KILLS) + 2
SKIPPED = re.compile(r"BackupAndRestore: skipped (\d) backup\(s\) that are not whole \(([^)]*)\)")


def _arrays(path) -> tuple[list[np.ndarray], int]:
    with np.load(path) as f:
        weights = [f[name] for name in sorted((n for n in f.files if n != "iterations"), key=lambda n: int(n[1:]))]
        return weights, int(f["iterations"])


def _run(job: Job, kill: dict) -> tuple[int, str]:
    """Starts every task with ``kill`` in the environment; the chief's exit code and output."""
    for name in (*KILLS[STAGES[0]], *KILLS[TORN]):
        job.env.pop(name, None)
    job.env.update(kill)
    job.start_all()  # the same command, cluster and backup directory
    code = job.wait(timeout=400)
    job.stop()
    return code, job.last_output("chief", 0)


def _check_restart(job: Job, killed: str | None, pointer: int, backed_up, output: str) -> None:
    """The start after a kill in ``killed``'s stage (None: the first start) restored the last
    committed backup (of ``pointer`` epochs, holding ``backed_up``) exactly, went on from there,
    and named the interrupted save's folder in one warning."""
    restored = job.out / "restored-1.npz"
    if killed is None:  # a fresh start: nothing to restore
        restored.unlink()  # the next start writes its own
        return
    (weights, iterations), (backed_up_weights, backed_up_iterations) = _arrays(restored), backed_up
    # Exactly what the last whole backup holds: the weights, and the optimizer's update count.
    assert backed_up_iterations == pointer * STEPS and iterations == backed_up_iterations, (killed, iterations)
    gap = max(float(np.max(np.abs(a - b))) for a, b in zip(weights, backed_up_weights))
    assert gap == 0.0, (killed, gap)
    done = re.findall(r"^epoch (\d+) done", output, flags=re.M)
    assert done and int(done[0]) == pointer, (killed, done, output[-3000:])  # went on from that epoch
    warned = SKIPPED.findall(output)
    if killed == "committed":  # nothing torn: the older backup is only pruned at the next commit
        assert warned == [], (killed, output[-3000:])
    else:  # the interrupted save's folder (the backup numbered as the pointer's epochs), in one warning
        torn = f"backup-{pointer}" if killed == "renamed" else f"tmp-{pointer}-"
        assert len(warned) == 1 and warned[0][0] == "1" and f"/backup/{torn}" in warned[0][1], (killed, output[-3000:])
    restored.unlink()
    print(f"after the kill in {killed}: resumed at epoch {pointer} with {iterations} updates, as backed up")


# Eight starts of a 3-process job in one chain: a hang limit sized for a loaded machine (one run
# took 1057 s at a load average of 40; 600 s is pytest-timeout's default).
@pytest.mark.timeout(2400)
def test_a_kill_at_each_stage_of_an_async_save_resumes_from_the_last_committed_backup(tmp_path):
    """Each stage of `kill_point`, and a torn weights file, one after the other in one job."""
    job = Job(tmp_path, "backup", workers=1, ps=1, KR_TEST_FAILURE_TIMEOUT="30", KR_TEST_EPOCHS=str(EPOCHS))
    killed, pointer, backed_up = None, 0, None
    try:
        for stage, kill in KILLS.items():
            code, output = _run(job, kill)
            _check_restart(job, killed, pointer, backed_up, output)
            assert code == -9, (stage, code, output[-3000:])  # SIGKILLed in its second save
            # The commit is the pointer: before it the start's first backup is the latest, after it its second.
            resumed_at, pointer = pointer, committed_backup_metadata(job.out / "backup")["epoch"]
            assert pointer == resumed_at + (2 if stage == "committed" else 1), (stage, resumed_at, pointer)
            backed_up = _arrays(job.out / f"epoch{pointer - 1}.npz")  # what that backup holds
            killed = stage
        code, output = _run(job, {})
        _check_restart(job, killed, pointer, backed_up, output)
        assert code == 0, output[-3000:]
        report = job.report()
    finally:
        job.stop()
    assert report["epochs_run"] == list(range(pointer, EPOCHS)) and pointer < EPOCHS, report["epochs_run"]
    assert report["iterations"] == EPOCHS * STEPS
    assert not (job.out / "backup").exists()  # deleted at the end of training, as Keras does
