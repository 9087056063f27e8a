"""Replication is invisible to the maths: N replicas at global batch B == one device at B."""

import keras
import numpy as np
import pytest

import keras_replicator as kr
from tests.helpers import conv_model, dense_model, image_data, regression_data


def train(build, data, loss, strategy=None, steps_per_execution=1, optimizer="sgd"):
    x, y = data
    def make():
        model = build()
        opt = keras.optimizers.SGD(0.1, momentum=0.9) if optimizer == "sgd" else keras.optimizers.Adam(0.01)
        model.compile(opt, loss, steps_per_execution=steps_per_execution)
        return model
    if strategy is None:
        model = make()
    else:
        with strategy.scope():
            model = make()
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return model


CASES = {
    "dense": (dense_model, lambda: regression_data(64), "mse"),
    "conv": (conv_model, lambda: image_data(64), keras.losses.SparseCategoricalCrossentropy(from_logits=True)),
}


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_n_replicas_match_one_device(replicas, case, optimizer):
    build, data, loss = CASES[case]
    reference = train(build, data(), loss, optimizer=optimizer)
    strategy = kr.ReplicatorStrategy([f"/cpu:{i}" for i in range(replicas)])
    replicated = train(build, data(), loss, strategy, optimizer=optimizer)
    kr.testing.assert_replicas_identical(replicated)
    assert kr.testing.max_weight_difference(replicated, reference) <= 1e-5


@pytest.mark.parametrize("replicas", [2, 4])
def test_steps_per_execution_matches_one_step_at_a_time(replicas):
    # Stock MirroredStrategy fails here with "You must feed a value for placeholder tensor".
    build, data, loss = CASES["conv"]
    strategy = kr.ReplicatorStrategy([f"/cpu:{i}" for i in range(replicas)])
    one = train(build, data(), loss, strategy, steps_per_execution=1)
    many = train(build, data(), loss, strategy, steps_per_execution=4)
    kr.testing.assert_replicas_identical(many)
    assert kr.testing.max_weight_difference(many, one) <= 1e-6
    assert int(many.optimizer.iterations.numpy()) == 8  # 64 / 16 batches x 2 epochs


def test_steps_per_execution_evaluate_and_predict_match():
    build, data, loss = CASES["conv"]
    x, y = data()
    strategy = kr.ReplicatorStrategy()
    with strategy.scope():
        model = build()
        model.compile("sgd", loss, metrics=["accuracy"], steps_per_execution=3)
    reference = build()
    reference.compile("sgd", loss, metrics=["accuracy"])
    reference.set_weights(model.get_weights())
    np.testing.assert_allclose(
        model.evaluate(x, y, batch_size=16, verbose=0),
        reference.evaluate(x, y, batch_size=16, verbose=0), rtol=1e-5)
    np.testing.assert_allclose(
        model.predict(x, batch_size=16, verbose=0), reference.predict(x, batch_size=16, verbose=0),
        rtol=1e-5, atol=1e-6)
