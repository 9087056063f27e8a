"""Crash-consistent backups under AsyncReplicatorStrategy: a kill at any stage of a save resumes
from the last complete backup, as under the synchronous strategies
(tests/test_crash_consistent_backups.py).

Each job is a chief, a worker and a parameter server of ``tests/async_job.py backup`` (4 epochs
of 4 steps, SGD with momentum, `BackupAndRestore` after each epoch) on 127.0.0.1. The kill comes
from the test hook `keras_replicator.atomic_files.kill_point` (``KERAS_REPLICATOR_KILL_AT_SAVE``:
the chief SIGKILLs itself when the second backup's save reaches the stage), and once from the job
itself in the middle of writing that backup's weights file: never from timing.
The whole job is then restarted with the same command and must restore exactly the weights and
the update count that the last committed backup holds (the chief recorded them at the end of
that epoch, before the save), run the remaining epochs, and end with exit code 0. Asynchronous
training depends on timing, so the restart's weights are compared with the backup it restored,
not with an uninterrupted run. Every process is killed (its whole group) at the end.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from keras_replicator import atomic_files
from tests.helpers import committed_backup_metadata
from tests.test_async import Job

pytestmark = pytest.mark.devices(1)

STEPS, EPOCHS = 4, 4  # as in the job's backup mode
# Where a save can be killed, in order (tests/test_crash_consistent_backups.py's stages); the kills
# land in the second backup (the end of epoch 1): before "committed" the restart resumes from the first.
STAGES = ("weights", "optimizer", "metadata", "commit", "renamed", "committed")
# And a kill that does not come from keras_replicator's hook: the job's own, in the middle of
# writing the second backup's weights file (Keras alone leaves that file torn, and the restart fails).
TORN = "torn"
KILLS = {**{s: {atomic_files.KILL_ENV: f"{s}:2"} for s in STAGES}, TORN: {"KR_TEST_TEAR_SAVE": "2"}}
SIDE_BY_SIDE = 4  # jobs at once (3 processes each)


def _arrays(path) -> tuple[list[np.ndarray], int]:
    with np.load(path) as f:
        weights = [f[name] for name in sorted((n for n in f.files if n != "iterations"), key=lambda n: int(n[1:]))]
        return weights, int(f["iterations"])


def _run_stages(tmp_path, stages) -> dict:
    for s in stages:
        (tmp_path / s).mkdir()
    jobs = {s: Job(tmp_path / s, "backup", workers=1, ps=1, KR_TEST_FAILURE_TIMEOUT="30", **KILLS[s])
            for s in stages}
    found = {}
    try:
        for job in jobs.values():
            job.start_all()
        for stage, job in jobs.items():
            code = job.wait(timeout=400)
            assert code == -9, (stage, code, job.output("chief", 0)[-3000:])  # SIGKILLed in the save
            job.stop()
            pointer = committed_backup_metadata(job.out / "backup")["epoch"]
            backed_up = _arrays(job.out / f"epoch{pointer - 1}.npz")  # what that backup holds
            (job.out / "restored-1.npz").unlink()
            for name in KILLS[stage]:
                job.env.pop(name)
            found[stage] = {"pointer": pointer, "backed_up": backed_up}
        for job in jobs.values():
            job.start_all()  # the same command, cluster and backup directory
        for stage, job in jobs.items():
            code = job.wait(timeout=400)
            found[stage].update(code=code, output=job.output("chief", 0),
                                restored=_arrays(job.out / "restored-1.npz"),
                                report=job.report() if code == 0 else None,
                                backup_left=(job.out / "backup").exists())
    finally:
        for job in jobs.values():
            job.stop()
    return found


def test_a_kill_at_each_stage_of_an_async_save_resumes_from_the_last_committed_backup(tmp_path):
    """Each stage of `kill_point`, and a torn weights file."""
    found, kills = {}, list(KILLS)
    for i in range(0, len(kills), SIDE_BY_SIDE):
        found.update(_run_stages(tmp_path, kills[i:i + SIDE_BY_SIDE]))
    # The commit is the pointer: before it the backup of epoch 0 is the latest, after it epoch 1's.
    assert {s: f["pointer"] for s, f in found.items()} == {**dict.fromkeys(KILLS, 1), "committed": 2}
    failed = [s for s, f in found.items() if f["code"] != 0]
    assert failed == [], {s: found[s]["output"][-3000:] for s in failed}  # 0 failed restarts
    for stage, f in found.items():
        pointer, report = f["pointer"], f["report"]
        (weights, iterations), (backed_up, backed_up_iterations) = f["restored"], f["backed_up"]
        # Exactly what the last whole backup holds: the weights, and the optimizer's update count.
        assert backed_up_iterations == pointer * STEPS and iterations == backed_up_iterations, stage
        gap = max(float(np.max(np.abs(a - b))) for a, b in zip(weights, backed_up))
        assert gap == 0.0, (stage, gap)
        assert report["epochs_run"] == list(range(pointer, EPOCHS)), (stage, report["epochs_run"])
        assert report["iterations"] == EPOCHS * STEPS, stage
        warned = re.findall(r"BackupAndRestore: skipped (\d) backup\(s\) that are not whole \(([^)]*)\)",
                            f["output"])
        if stage == "committed":  # nothing torn: the older backup is only pruned at the next commit
            assert warned == [], (stage, f["output"][-3000:])
        else:  # the interrupted save's folder, named, in one warning
            torn = "backup-1" if stage == "renamed" else "tmp-1-"
            assert len(warned) == 1 and warned[0][0] == "1" and f"/backup/{torn}" in warned[0][1], \
                (stage, f["output"][-3000:])
        assert not f["backup_left"], stage  # deleted at the end of training, as Keras does
        print(f"{stage}: resumed at epoch {pointer} with {iterations} updates, as backed up")
