"""Batches with fewer rows than replicas (issue 50): every family, row count and entry point, against one device."""

import warnings

import keras
import numpy as np
import pytest

import keras_replicator as kr
from tests import short_batches_cases as cases

pytestmark = pytest.mark.devices(4)


def _one_device(family: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "runs on one device": the reference does
        return cases.build(family)


def _compare(got: dict, want: dict, family: str, rows: int) -> None:
    np.testing.assert_allclose(got["predict"], want["predict"], rtol=1e-5, atol=1e-6)
    assert got["predict"].shape == want["predict"].shape
    np.testing.assert_allclose(got["evaluate"], want["evaluate"], rtol=1e-5, atol=1e-6)
    assert np.all(np.isfinite(got["fit_loss"]))
    if cases.fit_comparable(family, rows):
        np.testing.assert_allclose(got["fit_loss"], want["fit_loss"], rtol=1e-5, atol=1e-6)
        for g, w in zip(got["weights"], want["weights"], strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def strategy():
    return kr.ReplicatorStrategy()


@pytest.mark.parametrize("family", sorted(cases.FAMILIES))
def test_every_row_count_gives_one_devices_results(strategy, family):
    reference = _one_device(family)
    with strategy.scope():
        model = cases.build(family)
    initial = reference.get_weights()
    for rows, batch_size in cases.ROWS:
        want = cases.run_case(reference, family, rows, batch_size, initial)
        got = cases.run_case(model, family, rows, batch_size, initial)
        _compare(got, want, family, rows)


def test_mean_add_loss_of_two_rows_is_not_nan(strategy):
    # The second reproduction: 2 rows on 4 replicas, a mean in add_loss.
    with strategy.scope():
        inputs = keras.Input((3,))
        model = keras.Model(inputs, cases.MeanActivity()(keras.layers.Dense(3)(inputs)))
        model.compile(optimizer="sgd", loss="mse")
    x, y = np.full((2, 3), 0.5, "float32"), np.zeros((2, 3), "float32")
    loss = model.fit(x, y, verbose=0).history["loss"][0]
    assert np.isfinite(loss) and np.isfinite(model.evaluate(x, y, verbose=0))


def test_custom_loop_over_a_short_dataset_runs(strategy):
    # A custom loop gets the plain batches (re-cut, as before): no wrapper reaches it.
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices(np.ones((6, 3), "float32")).batch(6)
    seen = []
    for batch in strategy.experimental_distribute_dataset(dataset):
        sums = strategy.run(lambda b: tf.reduce_sum(b), args=(batch,))
        seen.append(float(strategy.reduce("SUM", sums, axis=None)))
    assert seen == [18.0]


def _applications():
    from keras_replicator.applications import d4pg, sngan

    tiny = sngan.SNGANConfig(image_size=16, ch=8, z_dim=8, g_first=2, g_multipliers=(2, 1),
                             d_multipliers=(1, 2), d_downsample=(True, False), channels=1)
    rng = np.random.default_rng(0)
    return {
        "resnet50": (lambda: kr.applications.resnet(kr.applications.RESNET50_BLOCKS, num_classes=10,
                                                    input_shape=(32, 32, 3), width=4),
                     rng.normal(size=(1, 32, 32, 3)).astype("float32")),
        "sngan_generator": (lambda: sngan.generator(tiny, 10),
                            [rng.normal(size=(1, 8)).astype("float32"), np.array([3], "int32")]),
        "sngan_discriminator": (lambda: sngan.discriminator(tiny, 10),
                                [rng.normal(size=(1, 16, 16, 1)).astype("float32"), np.array([3], "int32")]),
        "d4pg_policy": (lambda: d4pg.make_policy(5, [-1, -1], [1, 1]), rng.normal(size=(1, 5)).astype("float32")),
        "d4pg_critic": (lambda: d4pg.make_critic(5, 2),
                        [rng.normal(size=(1, 5)).astype("float32"), rng.normal(size=(1, 2)).astype("float32")]),
    }


@pytest.mark.parametrize("name", sorted(_applications()))
def test_predict_on_one_row_of_every_application_model_equals_one_device(strategy, name):
    make, x = _applications()[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        keras.utils.set_random_seed(3)
        reference = make()
        want = reference.predict(x, verbose=0)
    with strategy.scope():
        model = make()
    model.set_weights(reference.get_weights())
    got = model.predict(x, verbose=0)
    assert got.shape == want.shape and len(got) == 1
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
