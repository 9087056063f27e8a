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
