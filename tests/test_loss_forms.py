"""Every loss form Keras accepts trains under the strategy as on one device.

Each cell (`loss_forms_job.FORMS` x SGD and AdamW): the final weights within
1e-6 of one device's and every logged value of `fit`'s history (the loss, the
per-output losses, the metrics) equal to one device's to 1e-5 relative, on 4
replicas (this process) and, the SGD cells (`loss_forms_job.WORKER_OPTIMIZERS`:
why), on 2 workers x 2 replicas (one launched job). The
data's last batch has 14 rows: shares of 4, 4, 3, 3 on 4 replicas, so the
replicas' shares of the batch are checked as well as the forms. One device's
cells are computed once, in a fresh interpreter, while this process computes
its own.

Why (`_compat/keras_losses.py`): Keras's TensorFlow trainer scales each loss
for the replicas by assuming a mean that Keras reduces itself, over equal
shares. On main before the fix (and under stock `MirroredStrategy`) a loss
function returning a scalar trained 4 times too strongly, `add_loss` of a loss
object's result or of per-sample values 4 times too weakly, a custom
`compute_loss` reducing with `ops.mean` 4 times too strongly, and
`mean_with_sample_weight` and the short batch's unequal shares were off.
"""

import io
import json
import os

import numpy as np
import pytest

import keras_replicator as kr
from keras_replicator import launch as launcher
from tests import loss_forms_job as job
from tests.helpers import ROOT, json_from_fresh_interpreter, launch_env

JOB = os.path.join(ROOT, "tests", "loss_forms_job.py")
TOLERANCE = 1e-6
LOG_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """One device's cells, from a fresh interpreter started at once."""
    out = tmp_path_factory.mktemp("one_device") / "cells.json"
    with json_from_fresh_interpreter([JOB, "one", str(out)], out, timeout=900) as result:
        yield result


def mismatches(ours: dict, reference: dict) -> list[str]:
    """The cells where `ours` differs from one device's: weights beyond 1e-6, or a logged value."""
    bad = []
    assert set(ours) == set(reference)
    for cell, ref in sorted(reference.items()):
        got = ours[cell]
        gap = max(float(np.max(np.abs(np.subtract(a, b)))) for a, b in zip(got["weights"], ref["weights"]))
        if not gap <= TOLERANCE:
            bad.append(f"{cell}: weights {gap:.1e} apart")
        if set(got["history"]) != set(ref["history"]):
            bad.append(f"{cell}: logs {sorted(got['history'])}, one device {sorted(ref['history'])}")
            continue
        for key, values in ref["history"].items():
            if not np.allclose(got["history"][key], values, rtol=LOG_TOLERANCE, atol=0):
                bad.append(f"{cell}: {key} {got['history'][key]}, one device {values}")
    return bad


def test_four_replicas_match_one_device(one_device):
    ours = job.train_cells(kr.ReplicatorStrategy())
    bad = mismatches(ours, one_device())
    assert not bad, "; ".join(bad)


@pytest.mark.core
def test_activity_regularizer_matches_one_device(tmp_path):
    """An activity regularizer's term: a sum over the rows on Keras 3.8-3.14, a mean on 3.15.

    On Keras 3.10 before `keras_losses` told them apart, the term trained 4 times too
    weakly (weights 1.4e-2 from one device). One cell (L2 on the kernel, L1 on the
    activity, SGD), the short last batch's unequal shares included.
    """
    out = tmp_path / "one.json"
    with json_from_fresh_interpreter([JOB, "one", str(out), "regularizers/sgd"], out,
                                     timeout=600) as reference:
        ours = job.train_cells(kr.ReplicatorStrategy(), forms=("regularizers",), optimizers=("sgd",))
        bad = mismatches(ours, reference())
    assert not bad, "; ".join(bad)


def test_two_workers_of_two_replicas_match_one_device(tmp_path, one_device):
    out = io.StringIO()
    code = launcher.launch(JOB, ["workers", str(tmp_path)], workers=2, devices_per_worker=2,
                           env=launch_env(), timeout=900, output=out)
    assert code == 0, out.getvalue()[-3000:]
    workers = [json.loads((tmp_path / f"worker{i}.json").read_text()) for i in range(2)]
    assert workers[0] == workers[1], "the workers disagree"
    reference = {cell: found for cell, found in one_device().items()
                 if cell.split("/")[1] in job.WORKER_OPTIMIZERS}
    bad = mismatches(workers[0], reference)
    assert not bad, "; ".join(bad)
