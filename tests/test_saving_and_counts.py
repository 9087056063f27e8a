"""`kr.save_model` and `kr.num_replicas()` on one machine (multi-worker: tests/test_launch_training.py)."""

from __future__ import annotations

import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from tests.conftest import NUM_DEVICES
from tests.helpers import dense_model, regression_data


def test_num_replicas_answers_the_strategy_count_in_its_scope():
    strategy = kr.ReplicatorStrategy()
    assert kr.num_replicas() == 1  # outside any strategy
    with strategy.scope():
        assert kr.num_replicas() == NUM_DEVICES == strategy.num_replicas_in_sync
        # In a replica function, the same; the primitives still act per replica.
        counts = strategy.experimental_local_results(strategy.run(lambda: tf.constant(kr.num_replicas())))
        assert [int(c) for c in counts] == [NUM_DEVICES] * NUM_DEVICES
        # Outside a replica function, broadcast/all_reduce act as on one replica (as before).
        assert float(kr.broadcast(tf.constant(3.0), source_replica=0)) == 3.0
        with pytest.raises(ValueError, match=re.escape("source_replica must be an integer in [0, 0], got 1")):
            kr.broadcast(tf.constant(3.0), source_replica=1)
    assert kr.num_replicas() == 1


@pytest.mark.core
def test_save_model_writes_on_one_machine(tmp_path):
    strategy = kr.ReplicatorStrategy()
    x, y = regression_data(32)
    with strategy.scope():
        model = dense_model()
        model.compile("sgd", "mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert kr.save_model(model, tmp_path / "m.keras") is True
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert kr.save_model(model, str(tmp_path / "m.weights.h5")) is True
    assert sorted(os.listdir(tmp_path)) == ["m.keras", "m.weights.h5"]
    with pytest.raises(kr.errors.ArgumentError, match="model must be a keras.Model, got str"):
        kr.save_model("model", tmp_path / "x.keras")
    with pytest.raises(kr.errors.ArgumentError, match="filepath must be a path, got ''"):
        kr.save_model(model, "")
