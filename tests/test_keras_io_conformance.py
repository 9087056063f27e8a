"""Real Keras programs in keras-io's patterns train under the strategy as on one device.

`tests/keras_io_programs.py` holds them (a siamese network with a contrastive
loss, the endpoint-layer pattern, knowledge distillation with its own
`compute_loss`, a VAE with its own `train_step`, a model of several inputs and
outputs with dict losses), written for the suite with small data. Each runs on
4 replicas in this process and on one device in a fresh interpreter: the final
weights within 1e-6, every logged value of `fit`'s history equal to 1e-5
relative. On main before `_compat/keras_losses.py` the siamese network and the
endpoint layer trained 4 times too strongly and too weakly.
"""

import os

import numpy as np
import pytest

import keras_replicator as kr
from tests import keras_io_programs as programs
from tests.helpers import ROOT, json_from_fresh_interpreter

JOB = os.path.join(ROOT, "tests", "keras_io_programs.py")


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    out = tmp_path_factory.mktemp("one_device") / "programs.json"
    with json_from_fresh_interpreter([JOB, str(out)], out, timeout=900) as result:
        yield result


# The VAE in the core subset: a model that needs a batch to build, whose build reads one from
# Keras's epoch iterator (its items are 2-tuples on Keras 3.8-3.10, 3-tuples on 3.11+).
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.core) if n == "vae" else n
                                  for n in sorted(programs.PROGRAMS)])
def test_program_matches_one_device(name, one_device):
    ours = programs.PROGRAMS[name](kr.ReplicatorStrategy())
    reference = one_device()[name]
    gap = max(float(np.max(np.abs(np.subtract(a, b)))) for a, b in zip(ours["weights"], reference["weights"]))
    assert gap <= 1e-6, f"{name}: weights {gap:.1e} from one device's"
    assert set(ours["history"]) == set(reference["history"])
    for key, values in reference["history"].items():
        np.testing.assert_allclose(ours["history"][key], values, rtol=1e-5, err_msg=f"{name}: {key}")
