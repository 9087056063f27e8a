"""Resuming exactly after a preemption: a reshuffling pipeline, and on another number of replicas.

Each test runs ``tests/resume_job.py`` (a small MLP without dropout, a learning-rate
schedule, ``BackupAndRestore``; 3 epochs of 6 steps, global batch 16) in fresh processes
on 127.0.0.1: a real SIGTERM mid-epoch 1 (exit 143), then a restart on the same or
another shape. Every replica logs the ids of the examples of each step; the reference is
an uninterrupted run of the same job in this process, under a ``ReplicatorStrategy`` of
this process's 2 replicas: with the global batch kept, 2, 4 or any number of replicas
compute the same mean gradient (no dropout, no batch norm), and the same data order
(tf.data's seeds are drawn per iterator, which ``fit`` makes alike on any shape). The
resumed runs must read the reference's examples at every step (its epoch orders: every
example once per epoch) and end at its weights within 1e-5.
"""

from __future__ import annotations

import collections
import io
import os
import re
import shutil
import subprocess
import sys

import keras
import numpy as np
import pytest

from keras_replicator import launch as launcher
from tests import resume_job
from tests.helpers import ROOT
from tests.test_preemption import _env, _finish

# The jobs run in their own processes; this process holds the 2-replica reference.
pytestmark = pytest.mark.devices(2)

JOB = os.path.join(ROOT, "tests", "resume_job.py")
STEPS_PER_EPOCH = resume_job.EXAMPLES // resume_job.BATCH
ALL_STEPS = list(range(resume_job.EPOCHS * STEPS_PER_EPOCH))


def _start(out_dir, args, env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, JOB, str(out_dir), "--input", "shuffled", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _ids_by_step(out_dir) -> dict[int, list[int]]:
    """Step -> the ids its replicas read (every worker's log), sorted; a step logged twice is kept twice."""
    steps: dict[int, list[int]] = collections.defaultdict(list)
    for name in sorted(os.listdir(out_dir)):
        if name.startswith("ids.worker"):
            with open(os.path.join(out_dir, name)) as f:
                for line in f:
                    step, ids = re.fullmatch(r"(\d+) \[([\d ]*)\]\n?", line).groups()
                    steps[int(step)].extend(int(i) for i in ids.split())
    return {step: sorted(ids) for step, ids in sorted(steps.items())}


def _weights(out_dir, worker=0) -> list[np.ndarray]:
    with np.load(os.path.join(out_dir, f"weights.worker{worker}.npz")) as arrays:
        return [arrays[f"w{i}"] for i in range(len(arrays.files))]


def _gap(a, b) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


def _check_against(out_dir, reference, workers=1) -> float:
    """The resumed run read the reference's examples at every step, and ended at its weights."""
    got, expected = _ids_by_step(out_dir), reference["ids"]
    assert sorted(got) == ALL_STEPS, sorted(got)  # every step once: none redone, none skipped
    for epoch in range(resume_job.EPOCHS):  # every example once per epoch
        ids = [i for s in ALL_STEPS[epoch * STEPS_PER_EPOCH:][:STEPS_PER_EPOCH] for i in got[s]]
        assert sorted(ids) == list(range(resume_job.EXAMPLES)), (epoch, ids)
    assert got == expected  # the uninterrupted run's examples at each step (its epoch orders)
    gaps = [_gap(_weights(out_dir, w), reference["weights"]) for w in range(workers)]
    assert max(gaps) <= 1e-5, gaps
    return max(gaps)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, in this process: its ids per step and final weights."""
    import keras_replicator as kr

    out = tmp_path_factory.mktemp("reference")
    strategy = kr.ReplicatorStrategy()
    with strategy.scope():
        model = resume_job.build_model(str(out / "ids.worker0.txt"))
    resume_job.fit(model, "shuffled")
    ids = _ids_by_step(out)
    # Reshuffled: epoch 1 reads another order than epoch 0 (else this test would prove nothing).
    assert ids[0] != ids[STEPS_PER_EPOCH]
    return {"ids": ids, "weights": model.get_weights()}


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    """A 2-replica run of the shuffled job, SIGTERMed while batch 2 of epoch 1 runs: its folder.

    Its optimizer state is sharded over the 2 replicas; the backup has the unsharded format,
    so the tests resume it unsharded (same shape) and sharded over 4 replicas (grow).
    """
    out = tmp_path_factory.mktemp("preempted")
    first = _finish(_start(out, ["--devices", "2", "--sigterm-at", "0", "1", "2"],
                           _env(KR_TEST_SHARD_OPTIMIZER_STATE="1")))
    assert first.returncode == 143, first.stdout[-4000:]
    assert "stopped after step 3 of epoch 1" in first.stdout, first.stdout[-4000:]
    assert sorted(_ids_by_step(out)) == ALL_STEPS[:STEPS_PER_EPOCH + 3]
    return out


def _first_step(output: str) -> str:
    """The resumed run's "first step (epoch e, batch b) T s after the start" (resume_job.py)."""
    found = re.findall(r"first step \(epoch \d+, batch \d+\) [\d.]+ s after the start", output)
    assert found, output[-4000:]
    return found[-1]


def _copy(folder, tmp_path):
    shutil.copytree(folder, tmp_path / "run")
    return tmp_path / "run"


def test_a_reshuffling_pipeline_resumes_on_the_same_shape_with_the_uninterrupted_orders(
        preempted, reference, tmp_path):
    out = _copy(preempted, tmp_path)
    second = _finish(_start(out, ["--devices", "2"], _env(KERAS_REPLICATOR_RESTART_COUNT="1")))
    assert second.returncode == 0, second.stdout[-4000:]
    gap = _check_against(out, reference)
    print(f"same shape (2 replicas), reshuffling pipeline: weight gap {gap:.2g}; {_first_step(second.stdout)}")


def test_growing_from_2_to_4_replicas_refuses_3_first_then_resumes_exactly(preempted, reference, tmp_path):
    out = _copy(preempted, tmp_path)
    logged = _ids_by_step(out)
    three = _finish(_start(out, ["--devices", "3"], _env(KERAS_REPLICATOR_RESTART_COUNT="1")))
    assert three.returncode != 0
    assert ("keras_replicator.errors.ResumeError: The backup was written on 2 replicas with a global batch of "
            "16; this run has 3 replicas, which cannot share 16 examples per step equally") in three.stdout, \
        three.stdout[-4000:]
    for choice in ("resume on a number of replicas that divides 16 (1, 2, 4, 8, 16)",
                   "change the global batch to a multiple of 3 (15 or 18)",
                   "kr.optimizers.CrossReplicaOptimizer(optimizer, accumulation_steps=k)"):
        assert choice in three.stdout, three.stdout[-4000:]
    assert _ids_by_step(out) == logged  # refused before any step
    four = _finish(_start(out, ["--devices", "4"],
                          _env(KERAS_REPLICATOR_RESTART_COUNT="1", KR_TEST_SHARD_OPTIMIZER_STATE="1")))
    assert four.returncode == 0, four.stdout[-4000:]
    assert "finished on 4 replicas, optimizer state sharded" in four.stdout
    gap = _check_against(out, reference)
    print(f"grow 2 -> 4 replicas, reshuffling pipeline: weight gap {gap:.2g}; {_first_step(four.stdout)}")


def test_shrinking_a_preempted_2_x_2_job_to_1_x_2_resumes_exactly(reference, tmp_path):
    out = io.StringIO()
    code = launcher.launch(JOB, [str(tmp_path), "--input", "shuffled", "--sigterm-at", "1", "1", "2"], workers=2,
                           devices_per_worker=2, env=_env(), timeout=400, max_restarts=0, output=out)
    output = out.getvalue()
    assert code == 143, output[-8000:]
    stops = re.findall(r"\[worker (\d)\] keras_replicator: SIGTERM \(preemption\): stopped after (step \d+ of "
                       r"epoch \d+)", output)
    assert sorted(w for w, _ in stops) == ["0", "1"] and stops[0][1] == stops[1][1], output[-8000:]
    done = sorted(_ids_by_step(tmp_path))
    assert STEPS_PER_EPOCH < len(done) < 2 * STEPS_PER_EPOCH and done == ALL_STEPS[:len(done)], done  # mid-epoch 1

    out = io.StringIO()
    code = launcher.launch(JOB, [str(tmp_path), "--input", "shuffled"], workers=1, devices_per_worker=2,
                           env=_env(), timeout=400, output=out)
    assert code == 0, out.getvalue()[-8000:]
    assert "finished on 2 replicas" in out.getvalue()
    gap = _check_against(tmp_path, reference)
    print(f"shrink 2 x 2 -> 1 x 2 after {stops[0][1]}, reshuffling pipeline: weight gap {gap:.2g}; "
          f"{_first_step(out.getvalue())}")


class _CrashAtEpoch(keras.callbacks.Callback):
    """Raises when `epoch` begins: a failure after the backup of the epoch before it."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("crash")


@pytest.mark.parametrize("stop", ["sigterm_mid_epoch", "crash_after_an_epoch"])
def test_a_per_worker_input_fn_resumes_in_process_with_its_epoch_orders(tmp_path, stop):
    import keras

    import keras_replicator as kr

    strategy = kr.ReplicatorStrategy()

    def run(folder, callbacks=()):
        folder.mkdir(exist_ok=True)
        with strategy.scope():
            model = resume_job.build_model(str(folder / "ids.worker0.txt"))
        backup = keras.callbacks.BackupAndRestore(str(folder / "backup"))
        # Validation makes an iterator of its own after epoch 0: the backup must still record the training's.
        resume_job.fit(model, "input_fn", [backup, *callbacks], strategy, validation_data=resume_job.shuffled_dataset())
        return model.get_weights()

    expected = {"ids": None, "weights": run(tmp_path / "reference")}
    expected["ids"] = _ids_by_step(tmp_path / "reference")
    if stop == "sigterm_mid_epoch":
        # SIGTERM in this process: the step finishes, the backup is written mid-epoch 1, SystemExit(143).
        with pytest.raises(SystemExit) as stopped:
            run(tmp_path / "run", [resume_job.SigtermAt(strategy, (0, 1, 2))])
        assert stopped.value.code == 143
    else:  # Keras's own backup at the end of epoch 1, then a crash: the restart resumes at epoch 2
        with pytest.raises(RuntimeError, match="crash"):
            run(tmp_path / "run", [_CrashAtEpoch(2)])
    # A new model and a new pipeline (the input_fn called again): as after a restart.
    weights = run(tmp_path / "run")
    np.savez(tmp_path / "run" / "weights.worker0.npz", **{f"w{i}": w for i, w in enumerate(weights)})
    print(f"input_fn, same shape, {stop}: weight gap {_check_against(tmp_path / 'run', expected):.2g}")


def test_the_position_is_checked_against_the_new_shape():
    from keras_replicator import resume
    from keras_replicator.errors import ResumeError

    saved = {"epoch_draw": 3, "replicas": 4, "workers": 2, "global_batch": 64, "input_pipelines": 2,
             "global_order": True}
    shrink = resume.InputPosition(global_batch=64, input_pipelines=1, global_order=True)
    assert resume.plan(saved, 5, replicas=2, workers=1, position=shrink) == resume.Resumption(5, 3)
    # A global batch of 32 (with accumulation_steps=2, say): 5 steps of 64 are 10 of 32.
    halved = resume.InputPosition(global_batch=32, input_pipelines=1, global_order=True)
    assert resume.plan(saved, 5, replicas=2, workers=1, position=halved).step == 10
    with pytest.raises(ResumeError, match="5 steps of 64 examples .320 examples. into its epoch; this run's global "
                                          "batch of 48 cannot start a step there"):
        resume.plan(saved, 5, replicas=2, workers=1, position=resume.InputPosition(48, 1, True))
    with pytest.raises(ResumeError, match="this run has 3 replicas, which cannot share 64 examples"):
        resume.plan(saved, 5, replicas=3, workers=1, position=shrink)
    # Per-worker input (file sharding) on another number of workers: the rest of the epoch is not exact.
    per_worker = dict(saved, global_order=False)
    inexact = resume.plan(per_worker, 5, replicas=2, workers=1, position=resume.InputPosition(64, 1, True)).inexact
    assert "read per worker by 2 pipelines" in inexact and "shard_policy='data'" in inexact
    assert resume.plan(per_worker, 0, replicas=2, workers=1, position=shrink).inexact is None  # an epoch's end
