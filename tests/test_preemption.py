"""Preemption and a silent worker: SIGTERM saves at an agreed step and the restart resumes there.

Each test runs ``tests/preemption_job.py`` (a dense model, 3 epochs of 8 steps,
``keras.callbacks.BackupAndRestore``) in fresh processes on 127.0.0.1 and
compares the final weights with an uninterrupted one-device Keras run in this
process. The job logs every step it runs, so the test counts the steps done twice.
Every process is killed (its whole group) in ``finally``.
"""

from __future__ import annotations

import collections
import functools
import io
import json
import os
import re
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

from keras_replicator import launch as launcher
from tests.helpers import ROOT, committed_backup_metadata, dense_model, regression_data

# The jobs run in their own processes; this process only holds the one-device reference. In
# the 2-device process, which runs beside the 1-device one, its waiting overlaps other tests.
pytestmark = pytest.mark.devices(2)

JOB = os.path.join(ROOT, "tests", "preemption_job.py")
EXAMPLES, BATCH, EPOCHS, STEPS = 64, 8, 3, 8  # as in the job
ALL_STEPS = [[e, b] for e in range(EPOCHS) for b in range(STEPS)]


def _env(**extra) -> dict[str, str]:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    for name in ("KR_TEST_DEVICES", "TF_CONFIG", "KERAS_REPLICATOR_DEVICES_PER_WORKER",
                 "KERAS_REPLICATOR_ON_SIGTERM", "KERAS_REPLICATOR_RESTART_COUNT"):
        env.pop(name, None)
    return dict(env, **extra)


def _start(args, env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, JOB, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finish(process: subprocess.Popen, timeout=300) -> subprocess.CompletedProcess:
    try:
        output, _ = process.communicate(timeout=timeout)
    finally:
        _kill_group(process.pid)
        process.wait()
    return subprocess.CompletedProcess(process.args, process.returncode, output)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _steps(out_dir, worker: int = 0) -> list[list[int]]:
    with open(out_dir / f"steps.worker{worker}.jsonl") as f:
        return [json.loads(line) for line in f]


@functools.cache  # one fit for the module's tests (they only read it)
def _reference_weights() -> list[np.ndarray]:
    x, y = regression_data(EXAMPLES)
    model = dense_model()
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return model.get_weights()


def _check_weights(out_dir, worker: int, reference) -> float:
    with np.load(out_dir / f"weights.worker{worker}.npz") as arrays:
        got = [arrays[f"w{i}"] for i in range(len(reference))]
    gap = max(float(np.max(np.abs(a - b))) for a, b in zip(got, reference))
    assert gap <= 1e-5, gap
    return gap


def _exactly_once(steps) -> None:
    counts = collections.Counter(map(tuple, steps))
    assert sorted(counts) == [tuple(s) for s in ALL_STEPS], steps
    assert max(counts.values()) == 1, [s for s, c in counts.items() if c > 1]  # no step done twice


def test_sigterm_in_one_process_saves_mid_epoch_and_the_rerun_resumes_at_that_step(tmp_path):
    saving, fatal = tmp_path / "save", tmp_path / "fatal"
    saving.mkdir()
    fatal.mkdir()
    # Run 1: 2 replicas; SIGTERM while batch 3 of epoch 1 runs: that step finishes, then save and 143.
    # Alongside, the same job with SIGTERM made fatal: it ends at once, nothing saved.
    processes = [_start([str(saving), "--sigterm-at", "0", "1", "3"], _env()),
                 _start([str(fatal), "--sigterm-at", "0", "1", "3"], _env(KERAS_REPLICATOR_ON_SIGTERM="fatal"))]
    try:
        reference = _reference_weights()
    finally:
        first, killed = [_finish(p) for p in processes]
    assert first.returncode == 143, first.stdout[-4000:]
    assert "SIGTERM (preemption): stopped after step 4 of epoch 1, saved to" in first.stdout
    metadata = committed_backup_metadata(saving / "backup")
    assert metadata["epoch"] == 1 and metadata["keras_replicator_step_in_epoch"] == 4, metadata
    assert _steps(saving) == ALL_STEPS[:STEPS + 4]

    assert killed.returncode == -signal.SIGTERM, killed.stdout[-4000:]
    assert "sending SIGTERM" in killed.stdout and "preemption" not in killed.stdout
    assert _steps(fatal) == ALL_STEPS[:STEPS + 3]  # the step that was running never finished
    metadata = committed_backup_metadata(fatal / "backup")  # Keras's own epoch-end backup only
    assert {k: v for k, v in metadata.items() if not k.startswith("keras_replicator_")} == {"epoch": 1, "batch": 0}

    # Run 2 (a restart): resumes at step 4 of epoch 1; every step once over both runs.
    second = _finish(_start([str(saving)], _env(KERAS_REPLICATOR_RESTART_COUNT="1")))
    assert second.returncode == 0, second.stdout[-4000:]
    assert "SIGTERM handler after fit: <Handlers.SIG_DFL: 0>" in second.stdout  # put back after fit
    _exactly_once(_steps(saving))
    gap = _check_weights(saving, 0, reference)
    print(f"weight gap to an uninterrupted run: {gap:.2g}")
    assert not (saving / "backup").exists()


def test_sigterm_to_one_worker_stops_both_after_the_same_step_and_the_launcher_restarts(tmp_path):
    out = io.StringIO()
    code = launcher.launch(JOB, [str(tmp_path), "--sigterm-at", "1", "1", "3"], workers=2, devices_per_worker=1,
                           env=_env(), timeout=400, max_restarts=1, output=out)
    output = out.getvalue()
    assert code == 0, output[-8000:]
    stops = re.findall(r"\[worker (\d)\] keras_replicator: SIGTERM \(preemption\): stopped after (step \d+ of "
                       r"epoch \d+), (saved to '[^']+')", output)
    assert sorted(w for w, *_ in stops) == ["0", "1"], output[-8000:]
    assert stops[0][1:] == stops[1][1:]  # the same step on both workers
    # Seen at the end of step 4 (batch 3): the proposal is the next step, which a peer may have begun.
    assert stops[0][1] == "step 5 of epoch 1"
    assert re.search(r"\[launcher\] worker \d exited with code 143", output), output[-8000:]
    assert "[launcher] restarting every worker (restart 1 of 1)" in output
    reference = _reference_weights()
    for worker in (0, 1):
        _exactly_once(_steps(tmp_path, worker))
        gap = _check_weights(tmp_path, worker, reference)
    print(f"stopped {stops[0][1]}; weight gap to an uninterrupted run: {gap:.2g}")


def test_a_silent_worker_ends_the_job_by_its_failure_timeout_named_and_nothing_is_left(tmp_path):
    """A SIGSTOPped worker: the heartbeat (``failure_timeout=30``) ends the job with WorkerLostError.

    The bound separates the outcomes by construction, not by the machine's speed: detected, the job
    ends about 30 s after the stop plus the teardown (which a busy machine slows); undetected, it
    would hang until the launcher's own 600 s timeout. The cause is checked by the error's text.
    """
    command = [sys.executable, "-m", "keras_replicator", "launch", "--workers", "2", "--devices-per-worker", "1",
               "--timeout", "600", JOB, str(tmp_path), "--silent"]
    process = subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    pids = []
    try:
        deadline = time.monotonic() + 200
        while not (tmp_path / "steps.worker1.jsonl").exists() and time.monotonic() < deadline:
            assert process.poll() is None, process.stdout.read()[-4000:]
            time.sleep(0.2)
        pids = [int((tmp_path / f"pid.worker{i}").read_text()) for i in range(2)]
        os.kill(pids[1], signal.SIGSTOP)  # alive, but silent: no heartbeat, no collective
        stopped = time.monotonic()
        output, _ = process.communicate(timeout=500)
        ended = time.monotonic() - stopped
    finally:
        for pid in (process.pid, *pids):
            _kill_group(pid)
        process.wait()
    print(f"a silent worker ended the job after {ended:.1f} s")
    assert ended < 240, output[-4000:]  # the launcher's 600 s timeout would come far later
    assert process.returncode not in (0, None)
    assert "keras_replicator.errors.WorkerLostError: Lost worker 1 (/job:worker/task:1 at 127.0.0.1:" in output, \
        output[-4000:]
    for pid in pids:  # the launcher killed the stopped worker (SIGKILL works on a stopped process)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_on_sigterm_is_checked_before_any_work(monkeypatch):
    import keras_replicator as kr

    with pytest.raises(ValueError, match="on_sigterm must be one of 'save', 'fatal'; got 'ignore'"):
        kr.ReplicatorStrategy(on_sigterm="ignore")
    monkeypatch.setenv("KERAS_REPLICATOR_ON_SIGTERM", "sometimes")
    with pytest.raises(ValueError, match=r"KERAS_REPLICATOR_ON_SIGTERM must be one of \['save', 'fatal'\]"):
        kr.ReplicatorStrategy()
    monkeypatch.setenv("KERAS_REPLICATOR_ON_SIGTERM", "fatal")
    assert kr.ReplicatorStrategy(devices=["/cpu:0"]).on_sigterm == "fatal"
