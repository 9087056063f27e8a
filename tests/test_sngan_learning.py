"""SN-GAN learns digits on 4 replicas with the command's defaults: samples of class c look like
c, and every class is diverse (the command's own report, metrics.json)."""

import json
import os

import keras
import pytest

from keras_replicator.applications.sngan import builder, data
from keras_replicator.applications.sngan.__main__ import _parser, config_from_args

# The run `python -m keras_replicator.applications.sngan --dataset digits --out DIR` makes
# (small16, global batch 128, n_dis 1, Adam 1e-3, EMA 0.999 warmed up, 600 updates, 4 replicas),
# built from the command line's own defaults by its own builder, in this process (only the
# progress printing is off: --verbose 0). Its own report, metrics.json at step 600, is checked.
# Measured with the defaults, the command's report at step 600 (EMA generator, 4 simulated
# replicas, the 2-core machine shared with other runs):
#   seed 0: class accuracy 0.99, worst-class diversity 0.69 (class 0); again 0.994, 0.71 (class 0);
#   seed 1: class accuracy 0.995, worst-class diversity 0.69 (class 9);
#   seed 2: class accuracy 0.987, worst-class diversity 0.70 (class 9; 0.54 at 400 updates).
# Every class of every seed >= 0.6 of real digits' within-class diversity (every class in
# docs/sngan.md). This test: 8.8 min under a load of 7-9 (evaluating at step 600 only), about
# 2 min idle.
ARGS = ["--dataset", "digits", "--verbose", "0"]


# The command's own 600 updates at batch 128: about 2 min on a quiet machine, 8-15 min when the
# 2 cores are shared with a suite run (above the default 600 s timeout).
@pytest.mark.timeout(1500)
def test_command_defaults_learn_every_digit_on_four_replicas(tmp_path):
    config = config_from_args([*ARGS, "--out", str(tmp_path)], _parser())
    assert (config.replicas, config.steps, config.ema_decay) == (4, 600, 0.999)  # the defaults
    builder.run(config)  # 4 replicas: this process's 4 simulated devices
    record = json.load(open(os.path.join(tmp_path, "metrics.json")))[-1]
    print({k: record[k] for k in ("step", "class_accuracy", "worst_class_diversity",
                                  "class_diversity", "fid", "train_seconds", "seconds")})
    assert record["step"] == 600
    # The judge: the run's classifier of real digits (one device) knows the real digits.
    x, y = data.digits(16)
    judge = keras.saving.load_model(os.path.join(tmp_path, "classifier.keras"))
    assert judge.evaluate(x, y, verbose=0)[1] > 0.97
    # Samples of class c are named c (held-out latents, classes drawn uniformly).
    assert record["class_accuracy"] >= 0.95, record
    # Within-class diversity (8x8) over real digits', per class: every class at least 0.6 (a
    # class collapsing to a few images scores far lower; held-out real digits score 0.93+).
    assert len(record["class_diversity"]) == 10
    assert record["worst_class_diversity"] >= 0.6, record
