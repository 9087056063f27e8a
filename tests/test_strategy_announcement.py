"""Our strategies name themselves in one line; TensorFlow's engine INFO lines stay hidden.

In Jupyter TensorFlow sets its logger to INFO, so its engine's lines ("Using
MirroredStrategy with devices ...", "Reduce to ... then broadcast ...") reached every
notebook reader. The job below does what a notebook does (TensorFlow's logger at INFO
before the strategy starts), in a fresh interpreter with 2 simulated devices.
"""

import logging
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.devices(1)  # the job runs in its own interpreter

JOB = r"""
import logging, sys
import tensorflow as tf
tf.get_logger().setLevel(logging.INFO)          # as TensorFlow does in an interactive session
import keras, numpy as np
import keras_replicator as kr
kr.simulate_devices(2)
strategy = kr.ReplicatorStrategy()

def fit_once():
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    model.fit(np.ones((8, 4)), np.ones((8, 1)), batch_size=4, verbose=0)

fit_once()
print("---- verbosity raised ----", file=sys.stderr, flush=True)
tf.get_logger().setLevel(logging.DEBUG)         # the user asks for TensorFlow's details
fit_once()
"""


def test_one_start_up_line_of_our_own_and_tensorflow_details_only_on_request():
    result = subprocess.run([sys.executable, "-c", JOB], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, env=_env())
    assert result.returncode == 0, result.stderr[-3000:]
    before, after = result.stderr.split("---- verbosity raised ----")
    ours = [line for line in before.splitlines() if line.startswith("keras_replicator:")]
    assert ours == ["keras_replicator: ReplicatorStrategy: 2 replica(s) on 2 local device(s): "
                    "CPU:0, CPU:1; all-reduce: CollectiveAllReduce in steps, "
                    "PackedReductionToOneDevice outside them"], before[-2000:]
    assert "INFO:tensorflow:" not in before and "MirroredStrategy" not in before, before[-2000:]
    assert "INFO:tensorflow:Reduce to" in after, after[-2000:]


def test_the_filter_passes_warnings_and_other_modules_and_everything_once_raised():
    import tensorflow as tf

    from keras_replicator._compat.tf_logging import EngineInfoFilter

    logger = logging.getLogger("tf_logging_test")
    logger.setLevel(logging.INFO)
    flt = EngineInfoFilter(logger)

    def record(level, path):
        return logging.LogRecord("tensorflow", level, path, 1, "m", None, None)

    engine = tf.__file__.replace("__init__.py", "python/distribute/mirrored_strategy.py")
    assert not flt.filter(record(logging.INFO, engine))
    assert flt.filter(record(logging.WARNING, engine))
    assert flt.filter(record(logging.INFO, "/home/me/train.py"))
    logger.setLevel(logging.DEBUG)
    assert flt.filter(record(logging.INFO, engine))


def _env():
    import os

    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("KR_TEST_DEVICES", None)
    return env
