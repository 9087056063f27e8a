"""Ray Train's `TensorflowTrainer` with `ReplicatorStrategy`, on one local Ray instance on 127.0.0.1.

Two workers of one CPU each; the train loops are in tests/ray_train_job.py. Checked: the same
weights as the same job under ``keras-replicator launch`` (and one device); a worker SIGKILLed
mid-run with ``FailureConfig(max_failures=1)`` -> every epoch runs, resumed from Ray's
checkpoint (the same run: the launcher's comparison is of the resumed job); a Ray Data shard per worker fed to ``fit`` is seen exactly once over the job; an
elastic run (``num_workers=(1, 2)``) on two Ray nodes shrinks to one worker when a node is
removed and grows back when one is added, every epoch run once, from Ray's checkpoints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest

from keras_replicator import ray_train
from tests import ray_train_job
from tests.helpers import (
    LAUNCHED_JOB_BATCH,
    LAUNCHED_JOB_EXAMPLES,
    ROOT,
    dense_model,
    python_blocks,
    regression_data,
)

# The driver trains nothing (Ray's workers set their own devices). The shared run's setup took
# 7 min under a load average of about 30 on 2 cores shared with other jobs: past the suite's 600 s.
pytestmark = [pytest.mark.devices(1), pytest.mark.timeout(1500)]

EPOCHS = 3
WORKERS = 2
DATA_EXAMPLES, DATA_BATCH, DATA_EPOCHS = 48, 8, 2


def _descendants(pid: int) -> dict[int, str]:
    """Every live descendant of `pid`: {pid: command name}, from ps."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,comm="], capture_output=True, text=True).stdout
    children: dict[int, list[tuple[int, str]]] = {}
    for line in out.splitlines():
        p, pp, name = line.split(None, 2)
        children.setdefault(int(pp), []).append((int(p), name.strip()))
    found, todo = {}, [pid]
    while todo:
        for child, name in children.get(todo.pop(), []):
            found[child] = name
            todo.append(child)
    return found


@pytest.fixture(scope="module")
def ray():
    """One Ray instance for the module, on 127.0.0.1; nothing of it is left afterwards."""
    ray = ray_train.init_local(num_cpus=4)
    started: dict[int, str] = {}
    try:
        assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
        assert ray.util.get_node_ip_address() == "127.0.0.1"
        assert [n["NodeManagerAddress"] for n in ray.nodes()] == ["127.0.0.1"]
        # tests/conftest.py bounds the object store (Ray's default: 30% of the machine's memory).
        assert ray.cluster_resources()["object_store_memory"] <= int(os.environ["RAY_DEFAULT_OBJECT_STORE_MAX_MEMORY_BYTES"])
        started = _descendants(os.getpid())
        assert {"raylet", "gcs_server"} <= set(started.values()), started
        yield ray
    finally:
        started.update(_descendants(os.getpid()))
        ray.shutdown()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _alive(started):
            time.sleep(0.5)
        left = _alive(started)
        for pid in left:
            _kill(pid)
    assert not left, f"processes Ray left behind: {left}"
    assert not {"raylet", "gcs_server"} & set(_descendants(os.getpid()).values())


def _alive(pids: dict[int, str]) -> dict[int, str]:
    """Those of `pids` still running under the same name (re-parented ones too)."""
    alive = {}
    for pid, name in pids.items():
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == name[:15]:
                    alive[pid] = name
        except OSError:
            pass
    return alive


def _kill(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass


def _fit(loop, config: dict, storage, max_failures: int = 0, datasets=None):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    trainer = TensorflowTrainer(
        loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=WORKERS, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=str(storage), name="job",
                             failure_config=FailureConfig(max_failures=max_failures)),
        datasets=datasets,
    )
    return trainer.fit()


def _reports(out, attempt: int) -> list[dict]:
    reports = []
    for rank in range(WORKERS):
        with open(os.path.join(out, f"attempt{attempt}.worker{rank}.json")) as f:
            reports.append(json.load(f))
    return reports


class _Watched:
    """A command in its own session; its descendants are recorded while it runs and reaped after."""

    def __init__(self, command: list[str], cwd, env: dict[str, str]):
        self.proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.seen: dict[int, str] = {}
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        while self.proc.poll() is None:
            self.seen.update(_descendants(self.proc.pid))
            time.sleep(1)

    def finish(self, timeout: float) -> tuple[int, str, str, dict[int, str]]:
        """(exit code, stdout, stderr, processes it left behind, now killed)."""
        try:
            stdout, stderr = self.proc.communicate(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
            self._watcher.join()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and _alive(self.seen):
                time.sleep(0.5)
            left = _alive(self.seen)
            for pid in left:
                _kill(pid)
        return self.proc.returncode, stdout, stderr, left


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # the guide's program sets it itself
    return env


def _start_launcher(out) -> _Watched:
    """tests/launched_job.py under `keras-replicator launch --workers 2` (one device each)."""
    command = [sys.executable, "-m", "keras_replicator", "launch", "--workers", str(WORKERS),
               "--devices-per-worker", "1", "--timeout", "400", os.path.join(ROOT, "tests", "launched_job.py"),
               str(out), str(EPOCHS)]
    return _Watched(command, ROOT, _env())


def _start_guide(cwd) -> _Watched:
    """docs/ray.md's complete program as written, in a fresh interpreter (its own Ray instance)."""
    return _Watched([sys.executable, "-c", python_blocks("docs/ray.md")[0]], cwd, _env())


KILL_AT_EPOCH = 2


@pytest.fixture(scope="module")
def run(ray, tmp_path_factory):
    """One Ray Train run: the launcher's job, then `fit` on Ray Data shards, in the same workers.

    Worker 1 SIGKILLs itself at the start of epoch `KILL_AT_EPOCH` of the first attempt; with
    ``FailureConfig(max_failures=1)`` Ray starts a new group, which runs it all again from its
    checkpoint (one run for the launcher comparison and the resume: starting a worker group is
    what these runs cost). The same job under `keras-replicator launch`, and docs/ray.md's
    program, run alongside it.
    """
    tmp = tmp_path_factory.mktemp("ray_run")
    launched, guide_dir = tmp / "launched", tmp / "guide"
    launched.mkdir()
    guide_dir.mkdir()
    launcher, guide = _start_launcher(launched), _start_guide(guide_dir)
    try:
        rows = [{"x": np.array([i], np.float32), "y": np.array([0.5], np.float32)} for i in range(DATA_EXAMPLES)]
        config = {"out": str(tmp), "epochs": EPOCHS, "data_epochs": DATA_EPOCHS, "global_batch": DATA_BATCH,
                  "kill_at_epoch": KILL_AT_EPOCH}
        result = _fit(ray_train_job.regression_and_ray_data_loop, config, tmp / "storage", max_failures=1,
                      datasets={"train": ray.data.from_items(rows)})
    finally:
        launcher_end = launcher.finish(timeout=420)
        guide_end = guide.finish(timeout=420)
    code, _, stderr, left = launcher_end
    assert code == 0 and not left, (left, stderr[-3000:])
    with open(os.path.join(launched, "worker0.restart0.json")) as f:
        launched_weights = [np.asarray(w) for w in json.load(f)["weights"]]
    return tmp, result, launched_weights, (guide_end, guide.seen)


def _one_device_weights(epochs: int = EPOCHS) -> list[np.ndarray]:
    x, y = regression_data(LAUNCHED_JOB_EXAMPLES)
    model = dense_model()
    model.compile(keras.optimizers.SGD(0.05), "mse")
    model.fit(x, y, batch_size=LAUNCHED_JOB_BATCH, epochs=epochs, shuffle=False, verbose=0)
    return model.get_weights()


def _max_gap(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) for u, v in zip(a, b))


ELASTIC_EPOCHS, SHRINK_AT, GROW_AT = 6, 2, 3


def test_an_elastic_run_shrinks_when_a_node_goes_and_grows_when_one_comes(tmp_path):
    """Ray Train v2, `ScalingConfig(num_workers=(1, 2))`, on a 2-node Ray cluster on 127.0.0.1.

    Defined before the tests that start the module's Ray instance, so that it runs alone: its
    driver is a fresh interpreter (tests/ray_train_job.py `elastic_run`) that starts the nodes'
    processes itself, removes the node of one worker in epoch 2 and adds a node back after
    epoch 3. Nothing of it is left running afterwards.
    """
    out = tmp_path / "elastic"
    out.mkdir()
    code = (f"from tests.ray_train_job import elastic_run\n"
            f"elastic_run({str(out)!r}, {ELASTIC_EPOCHS}, {SHRINK_AT}, {GROW_AT}, 5.0)\n")
    driver = _Watched([sys.executable, "-c", code], ROOT, _env())
    returncode, _, stderr, left = driver.finish(timeout=900)
    assert returncode == 0, stderr[-4000:]
    assert {"raylet", "gcs_server"} <= set(driver.seen.values()) and not left, left
    with open(out / "result.json") as f:
        result = json.load(f)
    assert result["error"] is None and result["last_epoch"] == ELASTIC_EPOCHS - 1
    assert result["addresses"] == ["127.0.0.1", "127.0.0.1"]  # two nodes, both on loopback

    def group(workers: int, restored) -> list[dict]:
        reports = []
        for rank in range(workers):
            with open(out / f"elastic.of{workers}.from{restored}.worker{rank}.json") as f:
                reports.append(json.load(f))
        return reports

    first, shrunk, grown = group(2, None), group(1, SHRINK_AT), group(2, GROW_AT + 1)
    # Every epoch ran once: 2 workers, then 1 from the checkpoint of the epoch before the node
    # went, then 2 again from the last checkpoint of the one worker.
    assert [r["epochs_done"] for r in first] == [list(range(SHRINK_AT))] * 2
    assert shrunk[0]["epochs_done"] == list(range(SHRINK_AT, GROW_AT + 1))
    assert [r["epochs_done"] for r in grown] == [list(range(GROW_AT + 1, ELASTIC_EPOCHS))] * 2
    assert sorted(r["on_head"] for r in first) == [False, True] and shrunk[0]["on_head"]
    for reports, workers in ((first, 2), (shrunk, 1), (grown, 2)):
        for rank, report in enumerate(reports):
            assert (report["num_workers"], report["num_replicas"]) == (workers, workers)
            assert report["tf_config"]["task"]["index"] == rank
            assert all(a.startswith("127.0.0.1:") for a in report["tf_config"]["cluster"]["worker"])
    # The global batch is kept: 2, 1 and 2 replicas compute the same mean gradient.
    assert grown[0]["weights"] == grown[1]["weights"]
    reference = _one_device_weights(ELASTIC_EPOCHS)
    print(f"elastic Ray run: max |weights - one device| = {_max_gap(grown[0]['weights'], reference):.3g}; "
          f"shrink: node removed -> first step of 1 worker {shrunk[0]['first_step_at'] - result['events']['removed']:.1f} s; "
          f"grow: node added -> first step of 2 workers {grown[0]['first_step_at'] - result['events']['added']:.1f} s; "
          f"whole run {result['ended'] - result['started']:.0f} s")
    for got, want in zip(grown[0]["weights"], reference):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def fresh_interpreter():
    """What a fresh interpreter (no Ray imported, no loopback variable) printed, its lines in order:

    the Ray modules that importing keras_replicator and ray_train imported; then, Ray imported
    before init_local could set the loopback variable, whether Ray got initialized and the
    refusal; then docs/ray.md's elastic block built: its trainer's module and settings. One
    interpreter for both tests (one start of TensorFlow and Ray): building a trainer starts
    nothing, so the refused init_local before it changes nothing of what it builds.
    """
    code = ("import sys, keras_replicator\nfrom keras_replicator import ray_train\n"
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n"
            "import ray\n"
            "try:\n    ray_train.init_local(num_cpus=1)\nexcept RuntimeError as e:\n"
            "    print(ray.is_initialized(), e)\n"
            "from tests.helpers import python_blocks\n"
            "ns = {'train_loop': lambda config: None, 'dataset': None}\n"
            "exec(python_blocks('docs/ray.md')[1], ns)\n"
            "t = ns['trainer']\n"
            "print(type(t).__module__, t.scaling_config.num_workers, t.scaling_config.elasticity_enabled,\n"
            "      t.scaling_config.elastic_resize_monitor_interval_s, t.run_config.failure_config.max_failures,\n"
            "      t.train_loop_config['global_batch'], ray.is_initialized())\n")
    # A limit for a hang: the two tests' 300 s each, as it does the work of both.
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.splitlines()


def test_the_guides_elastic_trainer_is_a_v2_elastic_one(fresh_interpreter):
    """docs/ray.md's elastic block builds Ray Train v2's trainer (Ray 2.60's default), elastic."""
    module, low, high, elastic, interval, failures, batch, started = fresh_interpreter[2].split()
    assert module == "ray.train.v2.tensorflow.tensorflow_trainer" and (low, high) == ("(1,", "4)")
    assert (elastic, float(interval), int(failures)) == ("True", 60.0, 3)
    assert all(int(batch) % workers == 0 for workers in range(1, 5))  # every size of the run
    assert started == "False"  # building it started no Ray


def test_two_ray_workers_train_as_the_launcher_does(run):
    """Both attempts of the run (killed, resumed) set up like the launcher; the job ends at its weights."""
    out, result, launched, _ = run
    assert result.error is None
    first, resumed = _reports(out, 0), _reports(out, 1)
    for rank, report in [*enumerate(first), *enumerate(resumed)]:
        # Ray's backend gave each worker its TF_CONFIG on 127.0.0.1 and TF_USE_LEGACY_KERAS=1.
        assert report["tf_config"]["task"] == {"type": "worker", "index": rank}
        assert all(a.startswith("127.0.0.1:") for a in report["tf_config"]["cluster"]["worker"])
        assert report["worker_index"] == rank and report["num_workers"] == WORKERS
        assert report["legacy_keras_env"] == "1" and report["tf_keras_is_keras"]
    # A first start restores nothing and runs from epoch 0 (up to the kill).
    assert all(r["restored_epoch"] is None and r["epochs_run"] == list(range(KILL_AT_EPOCH)) for r in first)
    final = resumed[0]["weights"]
    np.testing.assert_array_equal(np.concatenate([np.ravel(w) for w in final]),
                                  np.concatenate([np.ravel(w) for w in resumed[1]["weights"]]))
    gap = _max_gap(final, launched)
    print(f"max |Ray - launcher| = {gap:.3g}; max |Ray - one device| = "
          f"{_max_gap(final, _one_device_weights()):.3g}")
    assert gap <= 1e-6
    for got, want in zip(final, _one_device_weights()):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
    # Ray's checkpoint is the chief's last epoch: the final weights, loadable into the model.
    model = dense_model()
    model.compile(keras.optimizers.SGD(0.05), "mse")
    with result.checkpoint.as_directory() as directory:
        model.load_weights(os.path.join(directory, ray_train.WEIGHTS_FILE))
    assert _max_gap(model.get_weights(), final) == 0.0
    assert result.metrics["epoch"] == EPOCHS - 1 and result.metrics["loss"] > 0


def test_a_killed_worker_resumes_from_the_checkpoint(run):
    """Worker 1 SIGKILLed at the start of epoch 2 of 3, ``max_failures=1``: resumed at epoch 2."""
    out, result, _, _ = run
    assert result.error is None
    # Neither worker of the first attempt finished: worker 1 died, and Ray stopped worker 0.
    assert not any(r["finished"] for r in _reports(out, 0))
    resumed = _reports(out, 1)
    restored = resumed[0]["restored_epoch"]
    print(f"the restart resumed at epoch {restored}")
    # From the checkpoint of epoch 1, the last report before the kill: the worker waited until Ray's
    # controller had registered it (with a fixed 5 s sleep, a busy machine once resumed at epoch 0's).
    assert restored == KILL_AT_EPOCH
    for report in resumed:
        assert report["finished"]
        assert report["restored_epoch"] == restored and report["epochs_run"] == list(range(restored, EPOCHS))
    assert resumed[0]["weights"] == resumed[1]["weights"]
    gap = _max_gap(resumed[0]["weights"], _one_device_weights())
    print(f"max |resumed Ray run - one device| = {gap:.3g}")
    for got, want in zip(resumed[0]["weights"], _one_device_weights()):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


def test_a_ray_data_shard_per_worker_is_seen_once(run):
    out, result, _, _ = run
    assert result.error is None
    reports = []
    for rank in range(WORKERS):
        with open(os.path.join(out, f"ray_data.worker{rank}.json")) as f:
            reports.append(json.load(f))
    for epoch in range(DATA_EPOCHS):
        per_worker = [r["ids_per_epoch"][epoch] for r in reports]
        everything = [i for ids in per_worker for i in ids]
        assert sorted(everything) == list(range(DATA_EXAMPLES)), per_worker  # once each, none missing
        assert all(len(ids) == DATA_EXAMPLES // WORKERS for ids in per_worker)
    assert reports[0]["loss"] == reports[1]["loss"]  # one job: the same reduced loss on both


def test_async_strategy_refuses_the_cluster_ray_describes(run):
    """Ray's TF_CONFIG has only "worker" tasks: AsyncReplicatorStrategy says what it needs."""
    out = run[0]
    for rank in range(WORKERS):
        with open(os.path.join(out, f"async.worker{rank}.json")) as f:
            error = json.load(f)["error"]
        assert 'needs one "chief"' in error and "['worker']" in error, error


def test_the_guides_program_runs_as_written(run):
    """docs/ray.md's complete program, run alongside the module's Ray run (its own Ray instance)."""
    (code, stdout, stderr, left), seen = run[3]
    assert code == 0, stderr[-3000:]
    assert {"raylet", "gcs_server"} <= set(seen.values()) and not left, left  # it started Ray, left nothing
    words = stdout.split()
    assert words[:2] == ["epoch", "3"], stdout
    loss, mse = float(words[3]), float(words[5])
    variance = float(np.var(np.sum(np.random.default_rng(0).normal(size=(512, 8)), axis=1)))
    print(f"guide: loss {loss}, mse {mse}, variance of y {variance:.3g}")
    assert mse < 0.5 * variance


def test_keras_replicator_imports_no_ray_and_names_the_extra(fresh_interpreter, monkeypatch):
    lines = fresh_interpreter
    assert lines[0] == "[]"  # importing keras_replicator and ray_train imported no Ray
    # Ray imported before init_local could set the loopback variable: refused, nothing started.
    assert lines[1].startswith("False Ray was imported before init_local()"), lines
    monkeypatch.setitem(sys.modules, "ray.train", None)  # as if ray[train] were not installed
    with pytest.raises(ImportError, match=r'pip install "ray\[train\]==2\.60\.0".*pip install "\.\[ray\]"'):
        ray_train.ReportCheckpoint()
    with pytest.raises(ValueError, match="checkpoint_every"):
        ray_train.ReportCheckpoint(checkpoint_every=-1)


class _FakeTrain:
    """What ReportCheckpoint uses of `ray.train`, in memory: reports kept, the last checkpoint served."""

    def __init__(self, root, checkpoint=None):
        self.root, self.reports, self.checkpoint = root, [], checkpoint
        fake = self

        class Checkpoint:
            def __init__(self, path):
                self.path = path

            @classmethod
            def from_directory(cls, directory):  # Ray copies it to storage; so do we
                import shutil

                path = os.path.join(fake.root, f"checkpoint{len(fake.reports)}")
                shutil.copytree(directory, path)
                return cls(path)

            def as_directory(self):
                import contextlib

                return contextlib.nullcontext(self.path)

        self.Checkpoint = Checkpoint

    def report(self, metrics, checkpoint=None):
        self.reports.append((metrics, checkpoint))

    def get_checkpoint(self):
        return self.checkpoint


def _adam_model():
    model = dense_model()
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


def _callback(fake) -> ray_train.ReportCheckpoint:
    callback = ray_train.ReportCheckpoint()
    callback._train = fake
    return callback


def test_report_checkpoint_resumes_weights_optimizer_and_epoch(tmp_path):
    """In one process with Ray's session faked: a resumed fit equals an uninterrupted one (Adam)."""
    from keras_replicator._compat import keras_initial_epoch

    x, y = regression_data(LAUNCHED_JOB_EXAMPLES)
    fit = {"batch_size": LAUNCHED_JOB_BATCH, "shuffle": False, "verbose": 0}
    reference = _adam_model()
    reference.fit(x, y, epochs=3, **fit)

    first = _FakeTrain(tmp_path)
    _adam_model().fit(x, y, epochs=2, callbacks=[_callback(first)], **fit)
    assert [m["epoch"] for m, _ in first.reports] == [0, 1]
    assert all(m["loss"] > 0 and c is not None for m, c in first.reports)

    resumed_train = _FakeTrain(tmp_path / "again", checkpoint=first.reports[-1][1])
    resumed, callback = _adam_model(), _callback(resumed_train)
    epochs = []
    record = keras.callbacks.LambdaCallback(on_epoch_begin=lambda epoch, logs: epochs.append(epoch))
    resumed.fit(x, y, epochs=3, callbacks=[callback, record], **fit)
    assert callback.restored_epoch == 2 and epochs == [2]
    # Adam's moments came back too: without them the third epoch would end elsewhere.
    assert int(resumed.optimizer.iterations) == int(reference.optimizer.iterations)
    for got, want in zip(resumed.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-6)

    # A BackupAndRestore placed before it restored a later epoch: Ray's older checkpoint is not loaded.
    later = _adam_model()
    before = [w.copy() for w in later.get_weights()]

    class LaterBackup(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            keras_initial_epoch.set_initial_epoch(self.model, 3)

    skipped = _callback(_FakeTrain(tmp_path / "skip", checkpoint=first.reports[-1][1]))
    later.fit(x, y, epochs=3, callbacks=[LaterBackup(), skipped], **fit)
    assert skipped.restored_epoch is None
    assert all(np.array_equal(a, b) for a, b in zip(before, later.get_weights()))
