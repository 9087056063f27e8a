"""Crash-consistent backups: a kill at any moment of a save loses at most the work since the last backup.

The kills come from the test hook `keras_replicator.atomic_files.kill_point`
(``KERAS_REPLICATOR_KILL_AT_SAVE``: the process SIGKILLs itself when a save reaches a
stage), or from the job itself in the middle of writing a file, or from the launcher
after its grace period: never from timing. Each killed job is restarted with the same
command and must end on the weights of an uninterrupted run of the same job, computed
in this process on the same 2 replicas (1e-6), having redone at most one backup
interval. The kills at each stage of a backup's save come one after the other in chains
of starts, each start the restart after one kill and, one backup later, the next kill.
Jobs run ``tests/backup_job.py`` in fresh processes on 127.0.0.1, started side by side;
every process is killed (its whole group) in ``finally``.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings

import keras
import numpy as np
import pytest

import keras_replicator as kr
from keras_replicator import launch as launcher
from tests.helpers import ROOT, committed_backup_metadata, dense_model, regression_data

pytestmark = pytest.mark.devices(2)

JOB = os.path.join(ROOT, "tests", "backup_job.py")
EXAMPLES, BATCH, EPOCHS, STEPS = 64, 8, 4, 8  # as in the job
ALL_STEPS = [(e, b) for e in range(EPOCHS) for b in range(STEPS)]
KILL_AT_SAVE = "KERAS_REPLICATOR_KILL_AT_SAVE"
# Where a save can be killed (keras_replicator.atomic_files.kill_point), in order; the kills land
# in a start's second backup: before "committed" the restart resumes from the first.
STAGES = ("weights", "optimizer", "metadata", "commit", "renamed", "committed")


def _env(**extra) -> dict[str, str]:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    for name in ("KR_TEST_DEVICES", "TF_CONFIG", "KERAS_REPLICATOR_DEVICES_PER_WORKER",
                 "KERAS_REPLICATOR_ON_SIGTERM", "KERAS_REPLICATOR_RESTART_COUNT",
                 "KERAS_REPLICATOR_KILL_AT_SAVE", "KERAS_REPLICATOR_SAVE_RECORD"):
        env.pop(name, None)
    return dict(env, **extra)


def _start(command, env) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _job(out_dir, *args, env) -> subprocess.Popen:
    return _start([sys.executable, JOB, str(out_dir), *args], env)


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _finish(process: subprocess.Popen, timeout=300) -> subprocess.CompletedProcess:
    try:
        output, _ = process.communicate(timeout=timeout)
    finally:
        _kill_group(process)
    return subprocess.CompletedProcess(process.args, process.returncode, output)


def _steps(out_dir, worker: int = 0) -> list[tuple[int, int]]:
    with open(os.path.join(out_dir, f"steps.worker{worker}.jsonl")) as f:
        return [tuple(json.loads(line)) for line in f]


def _make_model(strategy) -> keras.Model:
    with strategy.scope():
        model = dense_model()
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")
    return model


def _fit(model, callbacks=(), epochs=EPOCHS):
    x, y = regression_data(EXAMPLES)
    return model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=list(callbacks))


@pytest.fixture(scope="module")
def strategy():
    return kr.ReplicatorStrategy()


@pytest.fixture(scope="module")
def references(strategy) -> dict[int, list[np.ndarray]]:
    """The uninterrupted run's weights after each number of epochs, on this process's 2 replicas."""
    model = _make_model(strategy)
    after = {}
    _fit(model, [keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: after.update({e + 1: model.get_weights()}))],
         epochs=max(EPOCHS, CHAIN_EPOCHS))
    return after


@pytest.fixture(scope="module")
def reference(references) -> list[np.ndarray]:
    """The uninterrupted run's final weights (of the job's EPOCHS epochs)."""
    return references[EPOCHS]


def _gap(weights, reference) -> float:
    return max(float(np.max(np.abs(a - b))) for a, b in zip(weights, reference))


def _job_weights(out_dir, worker: int = 0) -> list[np.ndarray]:
    with np.load(os.path.join(out_dir, f"weights.worker{worker}.npz")) as arrays:
        return [arrays[f"w{i}"] for i in range(len(arrays.files))]


def _redone(steps) -> int:
    """Steps run more than once over the job's runs; every step must have run."""
    counts = collections.Counter(steps)
    assert sorted(counts) == ALL_STEPS, steps
    return sum(c - 1 for c in counts.values())


# The stages in chains of starts side by side: each start is the restart after the kill before it
# and, one backup later, the next kill; after the last kill a start runs to the end. A start is
# a process (TensorFlow's start-up is most of its cost): one per kill, and one per chain.
CHAINS = (STAGES[:3], STAGES[3:])
# Each start commits one backup, then is killed in the next save: a chain's backups point one epoch
# further after each kill, two after "committed"; the last start runs the epoch after them.
CHAIN_EPOCHS = max(len(c) + c.count("committed") for c in CHAINS) + 1
ALL_CHAIN_STEPS = [(e, b) for e in range(CHAIN_EPOCHS) for b in range(STEPS)]
SKIPPED = re.compile(r"BackupAndRestore: skipped (\d) backup\(s\) that are not whole \(([^)]*)\)")


@dataclasses.dataclass
class _Chain:
    """One chain's folder, and what its last start left: the stage killed, the backup pointer's epoch."""

    folder: pathlib.Path
    stages: list
    killed: str | None = None
    pointer: int = 0
    left: list = dataclasses.field(default_factory=list)  # the backup folder's names after the kill
    steps_before: int = 0  # lines in its steps file before this start
    finished: bool = False


def _start_next(chain: _Chain) -> subprocess.Popen:
    chain.steps_before = len(_steps(chain.folder)) if chain.killed else 0
    kill = {KILL_AT_SAVE: f"{chain.stages[0]}:2"} if chain.stages else {}
    return _job(chain.folder, "--epochs", str(CHAIN_EPOCHS), env=_env(**kill))


def _check_start(chain: _Chain, run: subprocess.CompletedProcess, reference) -> None:
    """What the chain's start just ended shows: the restart after the kill before it (if any),
    then its own kill, or for the last start the end of training."""
    resumed_at, steps = chain.pointer, _steps(chain.folder)[chain.steps_before:]
    if chain.killed is not None:  # the interrupted save's folder (numbered as the pointer's epochs), in one warning
        warned = SKIPPED.findall(run.stdout)
        if chain.killed == "committed":  # nothing torn: the older backup is only pruned at the next commit
            assert warned == [], (chain.killed, run.stdout[-3000:])
        else:
            torn = f"backup-{resumed_at}" if chain.killed == "renamed" else f"tmp-{resumed_at}-"
            assert len(warned) == 1 and warned[0][0] == "1" and f"/backup/{torn}" in warned[0][1], \
                (chain.killed, chain.left, run.stdout[-3000:])
    if not chain.stages:  # the chain's last start: on to the end, on the uninterrupted run's weights
        assert run.returncode == 0, (chain.killed, run.stdout[-3000:])
        assert steps == ALL_CHAIN_STEPS[resumed_at * STEPS:], (chain.killed, steps)
        gap = _gap(_job_weights(chain.folder), reference)
        assert gap <= 1e-6, (chain.folder.name, gap)
        assert not (chain.folder / "backup").exists()  # deleted at the end of training, as Keras does
        print(f"{chain.folder.name}: gap {gap:.2g} after the last restart")
        chain.finished = True
        return
    stage = chain.stages.pop(0)
    assert run.returncode == -signal.SIGKILL, (stage, run.stdout[-3000:])
    # It resumed at the last committed backup (at most one backup interval redone), and was killed
    # in its second save.
    assert steps == ALL_CHAIN_STEPS[resumed_at * STEPS:(resumed_at + 2) * STEPS], (chain.killed, stage, steps)
    # The commit is the pointer: before it the start's first backup is the latest, after it its second.
    chain.pointer = committed_backup_metadata(chain.folder / "backup")["epoch"]
    assert chain.pointer == resumed_at + (2 if stage == "committed" else 1), (stage, resumed_at, chain.pointer)
    chain.killed, chain.left = stage, sorted(os.listdir(chain.folder / "backup"))
    print(f"{stage}: left {chain.left}")


@pytest.mark.timeout(1500)  # two chains of four starts; 484 s at a load average of 40
def test_a_kill_at_each_stage_of_a_save_resumes_from_the_last_committed_backup(tmp_path, references):
    chains = [_Chain(tmp_path / f"chain{i}", list(stages)) for i, stages in enumerate(CHAINS)]
    for chain in chains:
        chain.folder.mkdir()
    while going := [chain for chain in chains if not chain.finished]:
        starts = [(chain, _start_next(chain)) for chain in going]
        try:
            runs = [(chain, _finish(p)) for chain, p in starts]
        finally:  # the side-by-side starts too, if one did not end
            for _, p in starts:
                _kill_group(p)
        for chain, run in runs:
            _check_start(chain, run, references[CHAIN_EPOCHS])
    # Every step ran: each start's steps are the ones from its chain's last commit on.


def _interrupted(strategy, backup_dir, at_epoch: int, **backup_args) -> None:
    """A fit stopped by an error when `at_epoch` begins (the backups of the epochs before it stay)."""

    class Stop(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == at_epoch:
                raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(_make_model(strategy), [keras.callbacks.BackupAndRestore(backup_dir, **backup_args), Stop()])


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _flip_bytes(path):
    with open(path, "r+b") as f:  # the file keeps its size and opens; the CRC-32 tells
        f.seek(os.path.getsize(path) - 600)
        data = f.read(16)
        f.seek(os.path.getsize(path) - 600)
        f.write(bytes(b ^ 0xFF for b in data))


def _metadata_of_another_step(path):
    other = path.replace("backup-2", "backup-1")
    shutil.copy(other, path)


@pytest.mark.parametrize("damage, file, why", [
    (_truncate, "latest.weights.h5", "its weights file has"),
    (_flip_bytes, "latest.weights.h5", "CRC-32 differs"),
    (_metadata_of_another_step, "training_metadata.json", "its metadata is backup 1's, not this folder's (2)"),
])
def test_a_damaged_backup_is_skipped_with_one_warning_and_the_previous_one_restored(
        tmp_path, strategy, reference, damage, file, why):
    backup_dir = str(tmp_path / "backup")
    _interrupted(strategy, backup_dir, 3, double_checkpoint=True)  # backups after epochs 1 and 2 kept
    assert sorted(os.listdir(backup_dir)) == ["backup-1", "backup-2", "committed.json"]
    os.makedirs(os.path.join(backup_dir, "tmp-3-0123abcd"))  # a save killed before its commit
    damage(os.path.join(backup_dir, "backup-2", file))
    model = _make_model(strategy)
    epochs_run = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = _fit(model, [keras.callbacks.BackupAndRestore(backup_dir, double_checkpoint=True),
                               keras.callbacks.LambdaCallback(on_epoch_begin=lambda e, logs: epochs_run.append(e))])
    messages = [str(w.message) for w in caught if "BackupAndRestore" in str(w.message)]
    assert len(messages) == 1, messages
    assert f"{backup_dir}/tmp-3-0123abcd: never committed" in messages[0]
    assert f"{backup_dir}/backup-2: " in messages[0] and why in messages[0], messages[0]
    assert messages[0].endswith(f"resuming from {backup_dir}/backup-1."), messages[0]
    assert epochs_run == [2, 3] and len(history.history["loss"]) == 2  # backup-1: after epoch 1
    assert _gap(model.get_weights(), reference) <= 1e-6


def test_the_only_backup_damaged_starts_over_with_the_warning(tmp_path, strategy, reference):
    backup_dir = str(tmp_path / "backup")
    _interrupted(strategy, backup_dir, 2)  # one backup kept (Keras's default)
    assert sorted(os.listdir(backup_dir)) == ["backup-1", "committed.json"]
    _truncate(os.path.join(backup_dir, "backup-1", "latest.weights.h5"))
    model = _make_model(strategy)
    with pytest.warns(RuntimeWarning, match=r"skipped 1 backup\(s\) .*backup-1: its weights file has .*; "
                                            r"no whole backup is left: training starts from the beginning"):
        history = _fit(model, [keras.callbacks.BackupAndRestore(backup_dir)])
    assert len(history.history["loss"]) == EPOCHS
    assert _gap(model.get_weights(), reference) <= 1e-6


def test_a_backup_keras_wrote_in_place_is_still_restored(tmp_path, strategy, reference):
    """A backup of Keras's own layout (before this protocol): restored, then replaced by committed ones."""
    backup_dir = tmp_path / "backup"
    _interrupted(strategy, str(backup_dir), 2)
    folder = backup_dir / json.loads((backup_dir / "committed.json").read_text())["backup"]
    for name in ("latest.weights.h5", "training_metadata.json"):
        shutil.move(folder / name, backup_dir / name)
    shutil.rmtree(folder)
    (backup_dir / "committed.json").unlink()
    model = _make_model(strategy)
    epochs_run = []
    _fit(model, [keras.callbacks.BackupAndRestore(str(backup_dir), delete_checkpoint=False),
                 keras.callbacks.LambdaCallback(on_epoch_begin=lambda e, logs: epochs_run.append(e))])
    assert epochs_run == [2, 3]
    assert _gap(model.get_weights(), reference) <= 1e-6
    assert sorted(os.listdir(backup_dir)) == ["backup-1", "committed.json"]  # the in-place files gone


def test_on_an_object_store_the_pointer_written_last_commits(strategy, reference):
    """``ram://`` (tf.io.gfile's in-memory file system) is a path Keras calls remote, as ``gs://``:
    no rename there; each backup is written in its folder and the pointer, written last, commits it."""
    import tensorflow as tf

    backup_dir = "ram://crash_consistent_backups/backup"
    _interrupted(strategy, backup_dir, 2)
    assert sorted(tf.io.gfile.listdir(backup_dir)) == ["backup-1", "committed.json"]
    tf.io.gfile.makedirs(backup_dir + "/backup-2")  # a save cut short: its weights only, half written
    with tf.io.gfile.GFile(backup_dir + "/backup-2/latest.weights.h5", "wb") as f:
        f.write(b"\x89HDF\r\n")
    model = _make_model(strategy)
    with pytest.warns(RuntimeWarning, match=r"skipped 1 backup\(s\) that are not whole \(ram://crash_consistent_"
                                            r"backups/backup/backup-2: never committed .*; resuming from "
                                            r"ram://crash_consistent_backups/backup/backup-1\."):
        history = _fit(model, [keras.callbacks.BackupAndRestore(backup_dir)])
    assert len(history.history["loss"]) == 2
    assert _gap(model.get_weights(), reference) <= 1e-6
    assert not tf.io.gfile.exists(backup_dir)


def test_model_checkpoint_killed_in_the_middle_of_writing_keeps_the_previous_best(tmp_path, strategy):
    run = _finish(_job(tmp_path, "--checkpoint-kill", "2", env=_env()))
    assert run.returncode == -signal.SIGKILL and "SIGKILL in the middle of write 2" in run.stdout, run.stdout[-3000:]
    best = tmp_path / "best.weights.h5"
    model = _make_model(strategy)
    with strategy.scope():
        model.optimizer.build(model.trainable_variables)
    model.load_weights(str(best))  # whole: the best of epoch 0 (epoch 1's never replaced it)
    with np.load(tmp_path / "epoch0.npz") as arrays:
        assert _gap(model.get_weights(), [arrays[f"w{i}"] for i in range(len(arrays.files))]) == 0
    with np.load(tmp_path / "epoch1.npz") as arrays:
        assert _gap(model.get_weights(), [arrays[f"w{i}"] for i in range(len(arrays.files))]) > 1e-3
    torn = [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
    assert len(torn) == 1 and torn[0].endswith("-best.weights.h5"), os.listdir(tmp_path)  # the half-written one
    model.save_weights(str(best))  # the next write of the best file removes it
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")], os.listdir(tmp_path)


def test_model_save_and_save_weights_write_through_a_temporary_file(tmp_path, strategy, monkeypatch):
    model = _make_model(strategy)
    _fit(model, epochs=1)
    seen = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (seen.append((os.path.basename(a), os.path.basename(b))),
                                                     real_replace(a, b))[1])
    model.save_weights(str(tmp_path / "w.weights.h5"))
    model.save(str(tmp_path / "m.keras"))
    assert [b for _, b in seen] == ["w.weights.h5", "m.keras"], seen
    assert all(re.fullmatch(r"\.tmp-[0-9a-f]{8}-" + re.escape(b), a) for a, b in seen), seen
    assert sorted(os.listdir(tmp_path)) == ["m.keras", "w.weights.h5"]
    loaded = keras.saving.load_model(str(tmp_path / "m.keras"))
    assert _gap(loaded.get_weights(), model.get_weights()) == 0


def test_a_worker_killed_during_a_sharded_save_restarts_with_the_other_and_resumes(tmp_path, reference):
    out = io.StringIO()
    env = _env(KERAS_REPLICATOR_KILL_AT_SAVE="weights:2", KR_TEST_FAILURE_TIMEOUT="10")
    code = launcher.launch(JOB, [str(tmp_path), "--shard", "--kill-worker", "1"], workers=2,
                           devices_per_worker=1, env=env, timeout=400, max_restarts=1, grace=1, output=out)
    output = out.getvalue()
    assert code == 0, output[-8000:]
    assert re.search(r"\[launcher\] worker 1 exited with code 137", output), output[-8000:]
    assert "[launcher] restarting every worker (restart 1 of 1)" in output
    # The chief had begun its folder for the second backup: skipped, named, and removed.
    assert re.search(r"\[worker 0\] .*BackupAndRestore: skipped 1 backup\(s\) that are not whole \(\S+/backup/"
                     r"tmp-1-[0-9a-f]+: never committed", output), output[-8000:]
    for worker in (0, 1):
        gap = _gap(_job_weights(tmp_path, worker), reference)
        assert gap <= 1e-6, (worker, gap)
        assert _redone(_steps(tmp_path, worker)) == STEPS  # epoch 1 again, nothing more
    print(f"2 workers, sharded optimizer state, worker 1 killed in the save: gap {gap:.2g}")


def test_a_grace_shorter_than_the_save_warns_and_the_relaunched_job_resumes(tmp_path, reference):
    """SIGTERM to the launcher (a preemption) during a save that takes 4 s more, with --grace 1 s:
    the save is SIGKILLed midway; launched again, the job resumes from the backup before it
    and ends on the uninterrupted run's weights."""
    def command(*extra):
        return [sys.executable, "-m", "keras_replicator", "launch", "--workers", "1", "--devices-per-worker", "2",
                "--grace", "1", "--timeout", "300", JOB, str(tmp_path), *extra]

    first = _start(command("--slow-save", "4"), _env())
    try:
        deadline = time.monotonic() + 200
        # The second backup's save (the end of epoch 1) has begun; the first one is committed.
        while not (tmp_path / "slow_save.2").exists():
            assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()[-4000:]
            time.sleep(0.05)
        first.send_signal(signal.SIGTERM)
    finally:
        stopped = _finish(first)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stdout[-4000:]
    assert re.search(r"\[launcher\] the last backup took [0-9.]+ s to save: --grace 1 s is shorter than the rule's "
                     r"\d+ s \(2 x the save \+ 5 s\)", stopped.stdout), stopped.stdout[-4000:]
    assert "SIGTERM (preemption): stopped" not in stopped.stdout  # killed during its save
    assert committed_backup_metadata(tmp_path / "backup")["epoch"] == 1
    again = _finish(_start(command(), _env()))
    assert again.returncode == 0, again.stdout[-4000:]
    assert "BackupAndRestore: skipped 1 backup(s) that are not whole" in again.stdout, again.stdout[-4000:]
    assert _redone(_steps(tmp_path)) == STEPS  # epoch 1 again: one backup interval
    assert _gap(_job_weights(tmp_path), reference) <= 1e-6


def test_the_launchers_grace_grows_to_fit_the_recorded_save_or_warns(tmp_path):
    from keras_replicator.atomic_files import SAVE_RECORD_ENV, record_save
    from keras_replicator.launch.environment import SAVE_RECORD_ENV as LAUNCHER_NAME
    from keras_replicator.launch.grace import SaveRecordWatch, grace_for

    assert SAVE_RECORD_ENV == LAUNCHER_NAME
    assert (grace_for(7.4), grace_for(7.4, step_seconds=0.5), grace_for(0)) == (20, 21, 5)
    path = str(tmp_path / "save.json")
    said = []
    default, given = SaveRecordWatch(path, None, said.append), SaveRecordWatch(path, 10, said.append)
    default.poll()
    assert (default.grace, said) == (5.0, [])  # nothing recorded yet
    os.environ[SAVE_RECORD_ENV] = path
    try:
        record_save(7.4, 189_000_000)  # what the chief does after each commit
    finally:
        del os.environ[SAVE_RECORD_ENV]
    default.poll()
    given.poll()
    given.poll()
    assert default.grace == 20.0 and given.grace == 10.0
    assert said == ["the last backup took 7.4 s to save: the grace before SIGKILL is now 20 s (2 x the save + 5 s; "
                    "--grace sets it)",
                    "the last backup took 7.4 s to save: --grace 10 s is shorter than the rule's 20 s (2 x the save "
                    "+ 5 s); a SIGTERM's save may be killed midway (the restart then resumes from the backup before "
                    "it). Give --grace 20 or more."]  # once


def test_k8s_sets_termination_grace_from_a_step_and_a_save_and_says_how():
    import yaml

    from keras_replicator.launch import k8s_manifest

    for kind, pods in (("jobset", lambda d: [r["template"]["spec"]["template"]["spec"]
                                             for r in d[0]["spec"]["replicatedJobs"]]),
                       ("tfjob", lambda d: [r["template"]["spec"] for r in d[0]["spec"]["tfReplicaSpecs"].values()])):
        text = k8s_manifest("train.py", workers=2, image="train:1", kind=kind, save_seconds=7.4, step_seconds=0.5)
        assert text.startswith("# terminationGracePeriodSeconds: 21 s = 2 x (a step 0.5 s + a backup save 7.4 s) "
                               "+ 5 s"), text[:300]
        assert [p["terminationGracePeriodSeconds"] for p in pods(list(yaml.safe_load_all(text)))] == [21], kind
    text = k8s_manifest("train.py", workers=2, image="train:1", grace=120)
    assert text.startswith("# terminationGracePeriodSeconds: 120 s, as given (--grace)")
    with pytest.raises(ValueError, match="save_seconds"):
        k8s_manifest("train.py", workers=2, image="train:1", save_seconds=-1)
