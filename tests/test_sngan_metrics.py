"""FID and Inception Score: NumPy/SciPy references, replicated sampling, InceptionV3 path."""

import keras
import numpy as np
import pytest
import scipy.linalg
import tensorflow as tf

import keras_replicator as kr
from keras_replicator.applications import sngan
from keras_replicator.applications.sngan import metrics


def _scipy_fid(mu1, s1, mu2, s2):
    covmean = scipy.linalg.sqrtm(s1 @ s2).real
    return float(np.sum((mu1 - mu2) ** 2) + np.trace(s1 + s2 - 2 * covmean))


def _random_cov(rng, d):
    a = rng.standard_normal((d, d))
    return a @ a.T / d + 0.1 * np.eye(d)


@pytest.mark.parametrize("d", [1, 5, 40])
def test_frechet_distance_matches_scipy(d):
    rng = np.random.default_rng(d)
    mu1, mu2 = rng.standard_normal(d), rng.standard_normal(d)
    s1, s2 = _random_cov(rng, d), _random_cov(rng, d)
    np.testing.assert_allclose(metrics.frechet_distance(mu1, s1, mu2, s2),
                               _scipy_fid(mu1, s1, mu2, s2), rtol=1e-6, atol=1e-8)
    assert abs(metrics.frechet_distance(mu1, s1, mu1, s1)) < 1e-8


def test_frechet_distance_of_known_gaussians_from_samples():
    # N(0, diag(a)) vs N(m, diag(b)): |m|^2 + sum (sqrt(a) - sqrt(b))^2.
    rng = np.random.default_rng(0)
    a, b, m = np.array([1.0, 4.0, 0.25]), np.array([4.0, 1.0, 0.25]), np.array([1.0, -2.0, 0.5])
    exact = m @ m + np.sum((np.sqrt(a) - np.sqrt(b)) ** 2)
    x = rng.standard_normal((200_000, 3)) * np.sqrt(a)
    y = rng.standard_normal((200_000, 3)) * np.sqrt(b) + m
    fid = metrics.frechet_distance(*metrics.gaussian_statistics(x), *metrics.gaussian_statistics(y))
    np.testing.assert_allclose(fid, exact, rtol=0.02)
    np.testing.assert_allclose(metrics.frechet_distance(np.zeros(3), np.diag(a), m, np.diag(b)),
                               exact, rtol=1e-12)


def test_inception_score_extremes():
    k = 7
    assert metrics.inception_score(np.full((70, k), 1 / k))[0] == pytest.approx(1.0)
    one_hot = np.eye(k)[np.arange(70) % k]
    assert metrics.inception_score(one_hot)[0] == pytest.approx(k, rel=1e-6)
    mean, std = metrics.inception_score(one_hot, splits=10)
    assert mean == pytest.approx(k, rel=1e-6) and std < 1e-6


def test_class_diversity_per_class_against_numpy():
    rng = np.random.default_rng(0)
    real = rng.normal(size=(40, 16, 16, 1)).astype("float32")
    real_labels = np.arange(40) % 2
    samples = real.copy()
    samples[real_labels == 1] = samples[1]  # class 1 collapsed to one image
    ratios = metrics.class_diversity(samples, real_labels, real, real_labels)
    assert ratios[0] == pytest.approx(1.0) and ratios[1] == pytest.approx(0.0)
    # Halving the samples' spread halves the ratio, measured 8x8 (2x2 means) as in NumPy.
    ratios = metrics.class_diversity(0.5 * real, real_labels, real, real_labels)
    np.testing.assert_allclose(ratios, 0.5, rtol=1e-5)
    other = rng.uniform(size=(40, 16, 16, 1)).astype("float32")

    def spread(images):  # mean pairwise distance of 2x2 means
        a = images.reshape(len(images), 8, 2, 8, 2).mean((2, 4)).reshape(len(images), -1)
        return np.mean([np.linalg.norm(a[i] - a[j]) for i in range(len(a)) for j in range(i + 1, len(a))])

    ratios = metrics.class_diversity(other, real_labels, real, real_labels, per_class=5)
    want = [spread(other[real_labels == c][:5]) / spread(real[real_labels == c][:5]) for c in (0, 1)]
    np.testing.assert_allclose(ratios, want, rtol=1e-5)
    with pytest.raises(ValueError, match="class 0: need at least 2 samples and 2 real images, got 1"):
        metrics.class_diversity(samples[:2], real_labels[:2], real, real_labels)


def test_bad_inputs():
    with pytest.raises(ValueError, match="Shapes do not match"):
        metrics.frechet_distance(np.zeros(2), np.eye(2), np.zeros(3), np.eye(3))
    with pytest.raises(ValueError, match="splits"):
        metrics.inception_score(np.ones((3, 2)) / 2, splits=4)
    with pytest.raises(ValueError, match="weights file not found"):
        metrics.inception_extractor("/nonexistent/inception.h5")
    with pytest.raises(ValueError, match="input_size must be an integer >= 75"):
        metrics.inception_extractor(None, input_size=32)


TINY = sngan.SNGANConfig(image_size=16, ch=8, z_dim=8, g_first=2, g_multipliers=(2, 1),
                         d_multipliers=(1, 2), d_downsample=(True, False), channels=3)


def test_generated_features_are_gathered_from_every_replica():
    strategy = kr.ReplicatorStrategy([f"/cpu:{i}" for i in range(4)])
    with strategy.scope():
        keras.utils.set_random_seed(0)
        generator = sngan.generator(TINY, 10)
        extractor = metrics.classifier_extractor(metrics.digits_classifier(16, 10, 3))
    labels = np.array([3, 1, 4, 1, 5, 9, 2, 6], np.int32)
    feats, probs, got = metrics.generated_features(
        strategy, generator, extractor, num_samples=20, num_classes=10, per_replica_batch=3,
        seed=5, labels=labels)
    assert feats.shape == (20, 64) and probs.shape == (20, 10)
    np.testing.assert_array_equal(got, labels[np.arange(20) % 8])
    # Replica r of round k drew z from the key (seed, k * 65536 + r): recompute on one device.
    zs = [tf.random.stateless_normal([3, 8], [5, k * 65536 + r]) for k in range(2) for r in range(4)]
    z = np.concatenate(zs)[:20]
    expected = extractor(generator([z, got], training=False), training=False)
    np.testing.assert_allclose(feats, expected[0].numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(probs, expected[1].numpy(), rtol=1e-4, atol=1e-6)


def test_inception_extractor_from_a_weights_file_at_small_size(tmp_path):
    # No download here: a random InceptionV3 saved to a file stands for the published one.
    keras.utils.set_random_seed(0)
    net = keras.applications.InceptionV3(weights=None, input_shape=(75, 75, 3))
    path = str(tmp_path / "inception_v3.weights.h5")
    net.save_weights(path)
    extractor = metrics.inception_extractor(path, input_size=75)
    images = np.random.default_rng(0).uniform(-1, 1, (4, 32, 32, 3)).astype("float32")
    # The loaded network applied to the same resized images, in inference mode.
    expected = net(keras.layers.Resizing(75, 75)(images), training=False).numpy()
    weights = [w.numpy() for w in extractor.weights]
    for kwargs in ({}, {"training": False}, {"training": True}):
        # Always inference: batch norm on its moving statistics, which never move (without
        # this, a call without `training` normalized by the batch: probabilities off by 1e-2).
        features, probs = extractor(images, **kwargs)
        assert features.shape == (4, 2048) and probs.shape == (4, 1000)
        np.testing.assert_allclose(np.sum(probs, 1), 1.0, rtol=1e-5)
        np.testing.assert_allclose(probs.numpy(), expected, rtol=1e-5, atol=1e-7)
    for before, w in zip(weights, extractor.weights):
        np.testing.assert_array_equal(before, w.numpy())
