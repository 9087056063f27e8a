"""`fit` under `ReplicatorStrategy` builds the loss and metrics without tracing the model again.

Keras 3.15 under a strategy traces a built model's whole forward pass once more before the
first step (and reads a batch through a new iterator at every `fit` call) only to build the
loss and metrics; keras_replicator builds them from the dataset's specs and the model's
outputs. Checked by counting the model's calls: one per replica (the step's trace), none
more, and none at a later `fit`; the weights equal one device's.
"""

import keras
import numpy as np
import pytest

import keras_replicator as kr

pytestmark = pytest.mark.devices(2)


class Counting(keras.layers.Layer):
    """Identity that counts its calls (Python: traces, not steps)."""

    calls = 0

    def call(self, x):
        type(self).calls += 1
        return x


def _model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = Counting()(keras.layers.Dense(8, activation="relu")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(3)(hidden))
    model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def test_fit_traces_the_model_once_and_matches_one_device():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = rng.integers(0, 3, 64)
    one = _model()
    one.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    strategy = kr.ReplicatorStrategy()
    with strategy.scope():
        model = _model()
    Counting.calls = 0
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert Counting.calls == 1  # the step's one trace for all replicas, no symbolic build
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert Counting.calls == 1  # nothing traced or built again
    for a, b in zip(one.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
    accuracy = model.evaluate(x, y, verbose=0, return_dict=True)["accuracy"]
    assert accuracy == pytest.approx(one.evaluate(x, y, verbose=0, return_dict=True)["accuracy"])
