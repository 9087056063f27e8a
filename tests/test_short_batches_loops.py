"""Short batches beyond `fit` on arrays (issue 50), on 4 replicas against one device.

Custom loops over ``distribute_dataset(..., padding=True)`` (a dataset with fewer
examples than replicas, a last batch of 2, `padded_batch` sequences), `fit` of such
a dataset, plain batch norm's moving statistics, confusion-matrix metrics and
custom `train_step`s: every cell of tests/short_batches_loops.py equals one
device's, computed in a fresh interpreter started at once. Without ``padding``, a
custom loop's batch that would leave a replica without examples is an error.

Before the fix (main at aae1a69): a custom loop on 3 examples gave replica 3 an
empty batch, the `padded_batch` loop's last batch left 3 replicas empty, the moving
statistics counted the padding replicas' copies of a row (2 rows: the mean of
row 0 and three copies of row 1), and `Precision`/`AUC` counted those copies.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from tests import short_batches_loops as job
from tests.helpers import ROOT, json_from_fresh_interpreter

pytestmark = pytest.mark.devices(4)

JOB = os.path.join(ROOT, "tests", "short_batches_loops.py")


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    out = tmp_path_factory.mktemp("one_device") / "cells.json"
    with json_from_fresh_interpreter([JOB, str(out)], out, timeout=600) as result:
        yield result


@pytest.fixture(scope="module")
def ours():
    return job.cells(kr.ReplicatorStrategy())


def _close(got, want, what: str, tolerance: float = 1e-6) -> None:
    if isinstance(want, dict):
        assert set(got) == set(want), what
        for key in want:
            _close(got[key], want[key], f"{what}/{key}", tolerance)
        return
    try:
        want_array = np.asarray(want, dtype="float64")
    except ValueError:  # arrays of several shapes (a model's weights): one by one
        assert len(got) == len(want), what
        for i, (g, w) in enumerate(zip(got, want)):
            _close(g, w, f"{what}/{i}", tolerance)
        return
    assert np.shape(got) == want_array.shape, what
    np.testing.assert_allclose(got, want_array, rtol=1e-5, atol=tolerance, err_msg=what)


@pytest.mark.parametrize("cell", ["loop/3", "loop/10", "padded_batch", "fit_of_padded"])
def test_custom_loops_and_fit_of_a_padded_dataset_equal_one_device(ours, one_device, cell):
    _close(ours[cell], one_device()[cell], cell)


def test_batch_norm_moving_statistics_weigh_each_replica_by_its_rows(ours, one_device):
    _close(ours["batch_norm"], one_device()["batch_norm"], "batch_norm")


def test_confusion_matrix_metrics_leave_padding_rows_out(ours, one_device):
    _close(ours["confusion"], one_device()["confusion"], "confusion", tolerance=1e-5)


def test_custom_train_steps_without_scale_loss_train_as_one_device(ours, one_device):
    _close(ours["train_steps"], one_device()["train_steps"], "train_steps")


@pytest.mark.parametrize("case", ["tiny", "padded_batch"])
def test_a_batch_smaller_than_the_replicas_leaves_one_empty_unless_padded(case):
    # Without padding (the default, for loops that unpack `for x, y in ...`) TensorFlow's split is
    # kept: every row once, the last replicas empty. With padding=True every replica gets rows,
    # and `kr.real_rows` counts the real ones: the same rows once.
    strategy = kr.ReplicatorStrategy()
    if case == "tiny":
        dataset = tf.data.Dataset.from_tensor_slices(np.ones((3, 2), "float32"))
        options = {"global_batch_size": 4}
    else:  # 5 sequences in batches of 4: the last batch (1 row) cannot be re-cut
        dataset = tf.data.Dataset.range(1, 6).map(lambda n: tf.range(n)).padded_batch(4)
        options = {"global_batch_size": 4, "batched": True}

    def rows_per_replica(padding):
        counts = []
        for batch in strategy.distribute_dataset(dataset, padding=padding, **options):
            if padding:
                rows = strategy.run(lambda b: (tf.shape(b)[0], tf.reduce_sum(tf.cast(kr.real_rows(b), tf.int32))),
                                    args=(batch,))
            else:
                rows = strategy.run(lambda b: (tf.shape(b)[0], tf.shape(b)[0]), args=(batch,))
            counts.append([(int(a), int(r)) for a, r in zip(*(strategy.experimental_local_results(v) for v in rows))])
        return counts

    plain, padded = rows_per_replica(False), rows_per_replica(True)
    last = plain[-1]
    assert sum(r for _, r in last) == (3 if case == "tiny" else 1)
    assert any(a == 0 for a, _ in last), last
    assert all(a >= 1 for step in padded for a, _ in step), padded
    assert [sum(r for _, r in step) for step in padded] == [sum(r for _, r in step) for step in plain]
