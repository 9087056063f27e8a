"""Checkpoints keep the unsharded format across meshes (issue 41, item 5).

One fresh interpreter with 8 simulated devices (`tests/sharded_checkpoint_job.py`)
trains a tiny model (vocabulary-split Embedding, column- then row-parallel Dense,
AdamW) one epoch on a (2, 4) mesh, saves it five ways (`model.save`,
`save_weights`, `ModelCheckpoint`, `BackupAndRestore`, `tf.train.Checkpoint`),
loads each on (4, 2), (1, 8), 8 plain replicas and one device (and one device's
files on (2, 4)), trains one more epoch, and compares weights and AdamW's
iterations, m and v with the same model trained two epochs on one device.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, launch_env

pytestmark = pytest.mark.devices(1)  # the job runs in its own interpreter, with 8 devices

WAYS = ("tf_checkpoint", "model_save", "save_weights", "model_checkpoint", "backup")
MESHES = ("4x2", "1x8", "replicas8", "one_device")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded_checkpoints")
    job = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "sharded_checkpoint_job.py"), str(out)],
                         capture_output=True, text=True, timeout=900, cwd=ROOT, env=launch_env())
    assert job.returncode == 0, job.stdout[-4000:] + job.stderr[-8000:]
    with open(out / "results.json") as f:
        return json.load(f)


def test_every_move_continues_to_the_uninterrupted_run(results):
    """Weights and AdamW's state (iterations, m, v) within 1e-5 of two epochs on one device."""
    assert results["2x4_after_one_epoch"] < 1e-5
    moves = [f"2x4->{mesh}:{way}" for mesh in MESHES for way in WAYS]
    moves += [f"one_device->2x4:{way}" for way in WAYS]
    assert {move: results[move] for move in moves if results[move] >= 1e-5} == {}
    assert results["untrained"] > 0.1  # a load that restored nothing would fail the check above


def test_a_mesh_writes_the_one_device_format(results):
    """Same keys and shapes as one device's files: tf.train.Checkpoint's and .weights.h5's."""
    assert results["same_format"] == {"tf_checkpoint": True, "weights_h5": True}


def test_a_checkpoint_that_does_not_fit_fails_before_any_step(results):
    """A wider column layer (24, saved 16) on (4, 2): a clear error, that kernel left as it was, files intact."""
    errors = results["wrong_shape"]
    assert "(32, 16)" in errors["save_weights"] and "(32, 24)" in errors["save_weights"]
    assert "'column/kernel'" in errors["save_weights"]
    assert errors["tf_checkpoint"].startswith("LayoutError: the checkpoint holds 'column/kernel' with shape (32, 16)")
    assert errors["save_weights_kernel_untouched"] and errors["tf_checkpoint_kernel_untouched"]
    assert errors["files_untouched"]
