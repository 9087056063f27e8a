"""applications._runs: a run folder's files are replaced whole, or not at all."""

import os

import numpy as np
import pytest

from keras_replicator.applications import _runs

pytestmark = pytest.mark.devices(1)


def test_a_failed_write_leaves_the_old_file_and_a_skipped_one_replaces_nothing(tmp_path):
    path = str(tmp_path / "metrics.json")
    _runs.write_json(path, [1, 2])

    def fails(tmp):
        with open(tmp, "w") as f:
            f.write("[1, 2, 3")  # half written
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        _runs.write_atomically(path, fails)
    assert _runs.read_json(path) == [1, 2]
    assert os.listdir(tmp_path) == ["metrics.json"]  # the half-written file is gone
    assert _runs.write_atomically(path, lambda tmp: False) is False  # a non-chief worker
    assert _runs.read_json(path) == [1, 2]
    assert _runs.read_json(str(tmp_path / "absent.json"), default=[]) == []


def test_npz_and_csv_round_trip_without_temporary_files(tmp_path):
    arrays = {"learner/w": np.arange(6.0).reshape(2, 3), "env_steps": np.int64(800)}
    _runs.write_npz(str(tmp_path / "checkpoint.npz"), arrays)
    loaded = _runs.read_npz(str(tmp_path / "checkpoint.npz"))
    assert set(loaded) == set(arrays) and int(loaded["env_steps"]) == 800
    np.testing.assert_array_equal(loaded["learner/w"], arrays["learner/w"])
    rows = [{"env_steps": 400.0, "eval_return": -1200.5}, {"env_steps": 800.0, "eval_return": -300.25}]
    _runs.write_csv_rows(str(tmp_path / "returns.csv"), rows, ["env_steps", "eval_return"])
    assert _runs.read_csv_rows(str(tmp_path / "returns.csv")) == rows
    assert sorted(os.listdir(tmp_path)) == ["checkpoint.npz", "returns.csv"]
    assert _runs.read_npz(str(tmp_path / "none.npz")) is None and _runs.read_csv_rows(str(tmp_path / "x")) == []
