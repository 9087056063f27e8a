"""Keras random ops draw independently on every replica; replica 0 draws what one device draws.

Reference: the same layers with the same seeds on one device (no strategy), and chance:
independent keep-masks of rate 0.5 agree on about half their elements (identical masks, what
Keras under a stock strategy draws, agree on all of them).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from keras_replicator.testing import replica_values
from tests.helpers import assert_chance_agreement, dropout_masks, regression_data


def _strategy(n: int) -> kr.ReplicatorStrategy:
    return kr.ReplicatorStrategy([f"/cpu:{i}" for i in range(n)])


def _random_layers():
    """Seeded and unseeded generators: noise, augmentation, keras.random with a SeedGenerator."""
    return {
        "noise": keras.layers.GaussianNoise(1.0, seed=3),
        "spatial": keras.layers.SpatialDropout1D(0.5),  # unseeded: a seed from Python's random
        "translate": keras.layers.RandomTranslation(0.25, 0.25, seed=5),
        "uniform": keras.random.SeedGenerator(11),
    }


def _draw(layers):
    images = tf.reshape(tf.range(8 * 16 * 16, dtype=tf.float32) % 17.0, [8, 16, 16, 1])
    return {
        "noise": layers["noise"](tf.zeros([8, 32]), training=True),
        "spatial": layers["spatial"](tf.ones([8, 4, 64]), training=True),
        "translate": layers["translate"](images, training=True),
        "uniform": keras.random.uniform([256], seed=layers["uniform"]),
    }


def _draws(strategy, steps=2, seed=0):
    """Per step: {name: [one array per local replica]}, or [the one-device array] without strategy."""
    keras.utils.set_random_seed(seed)
    if strategy is None:
        layers = _random_layers()
        step = tf.function(tf.autograph.experimental.do_not_convert(lambda: _draw(layers)))
        return [{k: [np.asarray(v)] for k, v in step().items()} for _ in range(steps)], layers
    with strategy.scope():
        layers = _random_layers()
    step = tf.function(tf.autograph.experimental.do_not_convert(
        lambda: strategy.run(_draw, args=(layers,))))
    return [
        {k: [np.asarray(r) for r in strategy.experimental_local_results(v)] for k, v in step().items()}
        for _ in range(steps)
    ], layers


def _assert_independent(a: dict, b: dict) -> None:
    """Two draws of `_draw` (two replicas, or two steps) are unrelated."""
    assert np.mean(a["noise"] == b["noise"]) < 0.01 and np.mean(a["uniform"] == b["uniform"]) < 0.01
    assert_chance_agreement(a["spatial"][:, 0] > 0, b["spatial"][:, 0] > 0)  # one mask entry per channel
    same_image = [np.array_equal(x, y) for x, y in zip(a["translate"], b["translate"])]
    assert sum(same_image) <= 1, same_image  # continuous shifts: equal only by accident


@pytest.mark.parametrize("n", [2, 4])
def test_every_op_draws_independently_per_replica_and_replica_0_as_one_device(n):
    masks = dropout_masks(_strategy(n), steps=2)
    one_device_masks = dropout_masks(None, steps=2)
    draws, layers = _draws(_strategy(n))
    one_device, one_device_layers = _draws(None)
    for step in range(2):
        for i in range(n):
            for j in range(i + 1, n):
                assert_chance_agreement(masks[step][i], masks[step][j])
                _assert_independent(*({k: v[r] for k, v in draws[step].items()} for r in (i, j)))
            assert_chance_agreement(masks[0][i], masks[1][i])  # step to step
        np.testing.assert_array_equal(masks[step][0], one_device_masks[step][0])
        for name, values in draws[step].items():
            np.testing.assert_array_equal(values[0], one_device[step][name][0], err_msg=name)
    for i in range(n):
        _assert_independent(*({k: v[i] for k, v in draws[s].items()} for s in (0, 1)))
    # The generators' state advanced as on one device, identically on every replica.
    for name in layers:
        states = replica_values(_state(layers[name]))
        want = _state(one_device_layers[name]).numpy()
        assert want[1] >= 2 and all(np.array_equal(s, want) for s in states), (name, states, want)


def _state(layer_or_generator):
    for attribute in ("seed_generator", "generator"):
        layer_or_generator = getattr(layer_or_generator, attribute, layer_or_generator)
    return layer_or_generator.state


def test_reproducible_with_a_seed_and_stock_mirrored_strategy_left_alone():
    first, _ = _draws(_strategy(2), seed=4)
    again, _ = _draws(_strategy(2), seed=4)
    other, _ = _draws(_strategy(2), seed=5)
    for step in range(2):
        for name in first[step]:
            for a, b in zip(first[step][name], again[step][name]):
                np.testing.assert_array_equal(a, b, err_msg=name)
    assert not np.array_equal(first[0]["spatial"][1], other[0]["spatial"][1])  # unseeded: from the seed

    # Stock MirroredStrategy keeps Keras's behaviour: one mask copied to every replica.
    stock = dropout_masks(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]), steps=1)[0]
    np.testing.assert_array_equal(stock[0], stock[1])


def test_generator_state_restores_and_the_stream_continues():
    strategy = _strategy(2)
    with strategy.scope():
        layer = keras.layers.Dropout(0.5, seed=7)
        resumed = keras.layers.Dropout(0.5, seed=99)
    ones = tf.ones([8, 256])

    @tf.function
    def step(layer):
        return strategy.run(lambda: layer(ones, training=True))

    step(layer)
    saved = replica_values(layer.seed_generator.state)[0]
    want = [np.asarray(v) for v in strategy.experimental_local_results(step(layer))]
    resumed.seed_generator.state.assign(saved)
    got = [np.asarray(v) for v in strategy.experimental_local_results(step(resumed))]
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)
    assert_chance_agreement(got[0] > 0, got[1] > 0)


class _MaskRecorder(keras.Model):
    """A `train_step` that keeps every replica's dropout mask of its last two steps."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(1)
        self.dropout = keras.layers.Dropout(0.5, seed=7)
        self.last = self.add_weight((2, 2, 128), initializer="zeros", trainable=False,
                                    aggregation="only_first_replica", name="last")

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        mask = self.dropout(tf.ones([1, 128]), training=True)
        masks = kr.all_gather(mask)  # [replicas, 128], the same on every replica
        self.last.assign(tf.stack([self.last[1], masks]))
        return {"kept": tf.reduce_mean(masks)}


def test_fit_with_steps_per_execution_draws_per_replica_and_per_step():
    strategy = _strategy(2)
    with strategy.scope():
        model = _MaskRecorder(name="recorder")
        model.compile(steps_per_execution=3)
    x, y = regression_data(64)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # 4 steps: an execution of 3, then 1
    previous, last = (m > 0 for m in replica_values(model.last)[0])
    for masks in (previous, last):
        assert_chance_agreement(masks[0], masks[1])
    assert_chance_agreement(previous[0], last[0])
    assert_chance_agreement(previous[1], last[1])


def _dropout_model(rate: float) -> keras.Model:
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="tanh"),
                             keras.layers.Dropout(rate), keras.layers.Dense(1)])


def test_dropout_model_matches_one_device_at_rate_0_and_at_inference():
    x, y = regression_data(64)
    weights = {}
    for where in ("one device", "4 replicas"):
        if where == "one device":
            model = _dropout_model(0.0)
            model.compile(keras.optimizers.SGD(0.05), "mse")
        else:
            with _strategy(4).scope():
                model = _dropout_model(0.0)
                model.compile(keras.optimizers.SGD(0.05), "mse")
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        weights[where] = model.get_weights()
    for a, b in zip(weights["one device"], weights["4 replicas"]):
        np.testing.assert_allclose(a, b, atol=1e-5)

    # Rate 0.5, trained weights: inference (dropout off) is the same on 4 replicas.
    reference = _dropout_model(0.5)
    reference.set_weights(weights["one device"])
    reference.compile(loss="mse")
    with _strategy(4).scope():
        replicated = _dropout_model(0.5)
        replicated.compile(loss="mse")
    replicated.set_weights(weights["one device"])
    np.testing.assert_allclose(replicated.predict(x, batch_size=16, verbose=0),
                               reference.predict(x, batch_size=16, verbose=0), atol=1e-6)
    np.testing.assert_allclose(replicated.evaluate(x, y, batch_size=16, verbose=0),
                               reference.evaluate(x, y, batch_size=16, verbose=0), rtol=1e-5)
