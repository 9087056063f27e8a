"""`python -m keras_replicator.applications.sngan`: outputs, resume, clear errors, and the
same run on 2 workers x 2 devices through the launcher."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import ROOT, run_python


def _command(*args, timeout=600, launch=()):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
    env.pop("KR_TEST_DEVICES", None)
    launcher = [sys.executable, "-m", "keras_replicator", "launch", *launch, "-m"] if launch else [
        sys.executable, "-m"]
    return subprocess.run([*launcher, "keras_replicator.applications.sngan", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def _common(out):
    # 2 replicas (the default is 4): tracing the step costs in proportion to the replicas, and
    # 2 workers x 1 device against 2 devices in one process is the multi-worker case.
    return ["--dataset", "digits", "--out", out, "--ch", "8", "--global-batch-size", "8",
            "--n-dis", "1", "--eval-every", "2", "--eval-samples", "40", "--verbose", "0",
            "--replicas", "2"]


def _generator_weights(path):
    import keras

    import keras_replicator  # noqa: F401 (registers the layers)
    return [np.asarray(w) for w in keras.saving.load_model(path).weights]


@pytest.mark.parametrize("args, message", [
    (["--dataset", "mnist"], "unknown dataset 'mnist'"),
    (["--dataset", "digits", "--global-batch-size", "30"], "is not divisible by --replicas 4"),
    (["--dataset", "digits", "--image-size", "64"], "cannot be made by configuration 'small16'"),
    (["--dataset", "digits", "--config", "cifar"], "Unknown SN-GAN configuration 'cifar'"),
    (["--dataset", "digits", "--steps", "0"], "must be at least 1"),
])
def test_bad_input_is_refused_clearly(tmp_path, capsys, args, message):
    # In this process: every one of these is refused while the arguments are checked, before
    # the command touches TensorFlow (a fresh interpreter per case cost 6 s each).
    from keras_replicator.applications.sngan.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not os.listdir(tmp_path)  # refused before any work


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    """2 steps, then resumed to 4, in one process of 2 replicas; what the first run left."""
    out = str(tmp_path_factory.mktemp("one_process") / "run")
    run = {"out": out, "first": _command(*_common(out), "--steps", "2"), "second": None}
    if run["first"].returncode == 0:
        run["first_metrics"] = json.load(open(os.path.join(out, "metrics.json")))
        run["first_state"] = json.load(open(os.path.join(out, "checkpoint", "state.json")))
        run["first_checkpoint"] = sorted(os.listdir(os.path.join(out, "checkpoint")))
        run["judge"] = os.stat(os.path.join(out, "classifier.keras")).st_mtime_ns
        run["second"] = _command(*_common(out), "--steps", "4")
    return run


def test_trains_writes_outputs_and_resumes(one_process_run):
    out, first, second = (one_process_run[k] for k in ("out", "first", "second"))
    assert first.returncode == 0, first.stderr[-3000:]
    assert "resuming" not in first.stdout
    history = one_process_run["first_metrics"]
    assert [h["step"] for h in history] == [2]
    assert all(np.isfinite(h["fid"]) and h["inception_score"] >= 1.0 for h in history)
    assert all(0.0 <= h["class_accuracy"] <= 1.0 for h in history)
    # Diversity per class, and the worst class reported on its own.
    assert all(len(h["class_diversity"]) == 10 and h["worst_class_diversity"] > 0.0
               and h["worst_class_diversity"] == pytest.approx(min(h["class_diversity"]), abs=1e-4)
               for h in history)
    assert "worst_class_diversity" in first.stdout and "class_diversity [" in first.stdout
    # Training time excludes the classifier, the evaluation and the checkpoint.
    assert 0.0 < history[0]["train_seconds"] < history[0]["seconds"]
    assert one_process_run["first_state"] == {"step": 2, "weights": "gan-2.weights.h5"}
    assert one_process_run["first_checkpoint"] == ["gan-2.weights.h5", "state.json"]
    judge = one_process_run["judge"]

    # A finished run continues with a larger --steps: from step 2, two more updates (one
    # evaluation interval; the restored optimizers count the steps).
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming from step 2" in second.stdout
    assert "step 2:" not in second.stdout and "step 4:" in second.stdout
    history = json.load(open(os.path.join(out, "metrics.json")))
    assert [h["step"] for h in history] == [2, 4]
    # Summed over the resume: the first run's time plus this interval's, within this run's.
    added = history[1]["train_seconds"] - history[0]["train_seconds"]
    assert 0.0 < added < history[1]["seconds"], history
    assert json.load(open(os.path.join(out, "checkpoint", "state.json")))["step"] == 4
    assert os.stat(os.path.join(out, "classifier.keras")).st_mtime_ns == judge  # the same judge

    check = run_python(f"""
        import keras, numpy as np
        import keras_replicator
        g = keras.saving.load_model({os.path.join(out, "generator.keras")!r})
        z = np.random.default_rng(0).standard_normal((5, 64)).astype("float32")
        x = np.asarray(g([z, np.arange(5, dtype="int32")]))
        assert x.shape == (5, 16, 16, 1) and np.all(np.abs(x) <= 1.0), (x.shape, x.min(), x.max())
        print("ok")
    """)
    assert check.returncode == 0 and "ok" in check.stdout, check.stderr[-3000:]
    from PIL import Image
    assert Image.open(os.path.join(out, "samples.png")).size == (160, 160)


def test_two_workers_through_the_launcher_train_the_same_gan(tmp_path, one_process_run):
    """`keras-replicator launch -m ...`: 2 workers x 1 device, 2 steps then resumed to 4."""
    out = str(tmp_path / "run")
    launch = ["--workers", "2", "--devices-per-worker", "1", "--timeout", "500"]
    first = _command(*_common(out), "--steps", "2", launch=launch)
    assert first.returncode == 0, (first.stdout + first.stderr)[-5000:]
    second = _command(*_common(out), "--steps", "4", launch=launch)
    assert second.returncode == 0, (second.stdout + second.stderr)[-5000:]
    # Both workers resumed from the chief's checkpoint; only the chief reported the step.
    assert "[worker 0] resuming from step 2" in second.stdout
    assert "[worker 1] resuming from step 2" in second.stdout
    assert "[worker 0] step 4:" in second.stdout and "[worker 1] step 4:" not in second.stdout
    # Only the chief wrote to --out.
    assert sorted(os.listdir(out)) == ["checkpoint", "classifier.keras", "generator.keras",
                                       "metrics.json", "samples.png"]
    assert sorted(os.listdir(os.path.join(out, "checkpoint"))) == ["gan-4.weights.h5", "state.json"]
    assert [h["step"] for h in json.load(open(os.path.join(out, "metrics.json")))] == [2, 4]
    # 2 workers x 1 device train the GAN that 2 devices of one process train: the same
    # global batches, the same steps (EMA weights, conditional batch norm statistics).
    reference_out, reference = one_process_run["out"], one_process_run["second"]
    assert reference is not None and reference.returncode == 0
    mine = _generator_weights(os.path.join(out, "generator.keras"))
    theirs = _generator_weights(os.path.join(reference_out, "generator.keras"))
    assert len(mine) == len(theirs)
    for a, b in zip(mine, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_a_global_batch_the_launched_job_cannot_split_is_refused(tmp_path):
    out = str(tmp_path / "run")
    result = _command("--dataset", "digits", "--out", out, "--global-batch-size", "6",
                      "--replicas", "2", launch=["--workers", "2", "--devices-per-worker", "2"])
    assert result.returncode == 2, result.stdout[-3000:]
    assert "is not divisible by the job's 4 replicas (2 workers x 2)" in result.stdout
    assert not os.path.exists(out)
