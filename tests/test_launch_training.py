"""Real training through ``keras-replicator launch``: restarts resuming from a backup, several
hosts on 127.0.0.1, the launcher's device count winning over the script's, ``kr.save_model``,
``kr.num_replicas()`` and a job-wide ``Throughput``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import keras
import numpy as np

from keras_replicator.launch import free_ports
from tests.helpers import LAUNCHED_JOB_BATCH as BATCH
from tests.helpers import LAUNCHED_JOB_EXAMPLES as NUM_EXAMPLES
from tests.helpers import ROOT, dense_model, regression_data

JOB = os.path.join(ROOT, "tests", "launched_job.py")
TIMEOUT = 300


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3")


def _report(out_dir, worker: int, restart: int) -> dict:
    with open(os.path.join(out_dir, f"worker{worker}.restart{restart}.json")) as f:
        return json.load(f)


def _reference(epochs: int) -> list[np.ndarray]:
    x, y = regression_data(NUM_EXAMPLES)
    model = dense_model()
    model.compile(keras.optimizers.SGD(0.05), "mse")
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    return model.get_weights()


def _check_job(reports: list[dict], epochs: int, out_dir) -> None:
    for report in reports:
        # --devices-per-worker 2 won over the script's kr.simulate_devices(1): 2 workers x 2.
        assert report["replicas_in_scope"] == 4 and report["replicas_outside"] == 1
    assert [r["wrote"] for r in reports] == [True, False]  # only the chief wrote final.keras
    saved = keras.saving.load_model(os.path.join(out_dir, "final.keras"))
    assert os.listdir(out_dir).count("final.keras") == 1
    # One job figure, the same on every worker.
    assert reports[0]["examples_per_second"] == reports[1]["examples_per_second"]
    assert all(rate > 0 for rate in reports[0]["examples_per_second"])
    reference = _reference(epochs)
    for a, b, want, s in zip(reports[0]["weights"], reports[1]["weights"], reference, saved.get_weights()):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(s, a)
        np.testing.assert_allclose(a, want, atol=2e-5, rtol=1e-4)


def test_max_restarts_resumes_from_the_backup(tmp_path):
    command = [sys.executable, "-m", "keras_replicator", "launch", "--workers", "2", "--devices-per-worker", "2",
               "--max-restarts", "1", "--grace", "1", "--timeout", str(TIMEOUT), JOB, str(tmp_path), "4", "--crash"]
    result = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT + 60)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "[launcher] worker 1 exited with code 3; stopping the others" in output
    assert "[launcher] restarting every worker (restart 1 of 1)" in output
    # The script's own simulate_devices(1) said, once per start and worker, that the launcher's 2 wins.
    assert output.count("simulate_devices(1) ignored: the launcher's --devices-per-worker") == 4, output[-4000:]
    reports = [_report(tmp_path, i, 1) for i in range(2)]
    assert [r["epochs_run"] for r in reports] == [[2, 3], [2, 3]]  # resumed after epoch 1
    _check_job(reports, 4, tmp_path)


def test_an_elastic_job_goes_on_with_the_survivor_from_the_backup(tmp_path):
    """``--workers 1:2``: worker 1 dies in epoch 2, then fails at every restart; the job goes on alone."""
    command = [sys.executable, "-m", "keras_replicator", "launch", "--workers", "1:2", "--devices-per-worker", "2",
               "--max-restarts", "2", "--grace", "1", "--timeout", str(TIMEOUT), JOB, str(tmp_path), "4",
               "--crash", "--keep-failing"]
    result = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT + 60)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "[launcher] worker 1 exited with code 3; stopping the others" in output
    assert ("[launcher] worker 1 exited with code 4, the first to fail on 2 starts in a row: stopping the others "
            "and leaving it out; the job goes on with 1 worker(s) (at least 1)") in output
    assert "[launcher] restarting every worker (restart 2 of 2)" in output
    (report,) = [_report(tmp_path, 0, 2)]
    assert not os.path.exists(os.path.join(tmp_path, "worker1.restart2.json"))
    # The survivor alone: 1 worker x 2 replicas instead of 2 x 2, the global batch kept.
    assert (report["num_workers"], report["replicas_in_scope"], report["wrote"]) == (1, 2, True)
    # It resumed from the backup of 2 workers: epochs 0 and 1 were not run again.
    assert report["epochs_run"] == [2, 3]
    saved = keras.saving.load_model(os.path.join(tmp_path, "final.keras"))
    for a, s, want in zip(report["weights"], saved.get_weights(), _reference(4)):
        np.testing.assert_array_equal(s, a)
        np.testing.assert_allclose(a, want, atol=2e-5, rtol=1e-4)
    with open(os.path.join(tmp_path, "crashed_at")) as f:
        gap = report["first_step_at"] - float(f.read())
    print(f"elastic shrink: worker 1 died -> the survivor's first step after {gap:.1f} s")


def test_two_hosts_on_127_0_0_1(tmp_path):
    (port,) = free_ports(1)
    launchers = [
        subprocess.Popen(
            [sys.executable, "-m", "keras_replicator", "launch", "--hosts", "127.0.0.1:1,127.0.0.1:1",
             "--node-rank", str(rank), "--port", str(port), "--devices-per-worker", "2",
             "--timeout", str(TIMEOUT), JOB, str(tmp_path), "2"],
            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=TIMEOUT + 60)[0] for p in launchers]
    finally:
        for p in launchers:
            if p.poll() is None:
                p.send_signal(2)  # the launcher stops its workers
                p.wait(timeout=60)
    assert [p.returncode for p in launchers] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "[worker 0]" in outputs[0] and "[worker 1]" not in outputs[0]
    assert "[worker 1]" in outputs[1] and "[worker 0]" not in outputs[1]
    reports = [_report(tmp_path, i, 0) for i in range(2)]
    assert [r["epochs_run"] for r in reports] == [[0, 1], [0, 1]]
    _check_job(reports, 2, tmp_path)
