"""SN-GAN (tutorial 2): N replicas == one device, identical replicas, data, bad inputs."""

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from keras_replicator.applications import sngan

# 16x16, two up-blocks, two discriminator blocks: every part of the real model, tiny.
TINY = sngan.SNGANConfig(image_size=16, ch=8, z_dim=8, g_first=2, g_multipliers=(2, 1),
                         d_multipliers=(1, 2), d_downsample=(True, False), channels=1)


def _data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = np.tanh(rng.standard_normal((n, 16, 16, 1))).astype("float32")
    y = rng.integers(0, 10, n).astype("int32")
    return x, y


def _train(strategy=None, steps=3, n_dis=2, steps_per_execution=1, wrap=False, ema=0.9):
    def make():
        keras.utils.set_random_seed(0)
        gan = sngan.SNGAN(sngan.generator(TINY, 10), sngan.discriminator(TINY, 10),
                          num_classes=10, n_dis=n_dis, ema_decay=ema, seed=3)
        d_opt, g_opt = sngan.default_optimizer(1e-3), sngan.default_optimizer(1e-3)
        if wrap:
            d_opt = kr.optimizers.CrossReplicaOptimizer(d_opt)
        gan.compile(d_optimizer=d_opt, g_optimizer=g_opt, steps_per_execution=steps_per_execution)
        return gan
    if strategy is None:
        gan = make()
    else:
        with strategy.scope():
            gan = make()
    ds = sngan.digits_dataset(8, n_dis, data=_data(), shuffle=False)
    gan.fit(ds, steps_per_epoch=steps, epochs=1, verbose=0)
    return gan


def _weights(gan):
    """Weights, spectral-norm u, moving statistics and EMA (the model's whole state)."""
    return list(gan.generator.weights) + list(gan.discriminator.weights) + list(gan.ema_weights)


def _optimizer_state(gan):
    # A CrossReplicaOptimizer keeps its own variables besides the wrapped optimizer's: Adam's
    # own state is the wrapped one's, comparable with one device's plain Adam.
    d_optimizer = getattr(gan.d_optimizer, "inner_optimizer", gan.d_optimizer)
    return list(d_optimizer.variables) + list(gan.g_optimizer.variables)


def _assert_optimizers_close(a, b):
    # Adam's moments, to 1e-4 of each variable's largest entry (an entry near zero is the
    # difference of rounded gradients and has no relative precision).
    for x, y in zip(_optimizer_state(a), _optimizer_state(b), strict=True):
        x0, y0 = kr.testing.replica_values(x)[0], kr.testing.replica_values(y)[0]
        scale = max(float(np.max(np.abs(y0), initial=0.0)), 1e-12)
        assert np.max(np.abs(x0 - y0), initial=0.0) <= 1e-4 * scale, x.path


@pytest.fixture(scope="module")
def reference():
    return _train()


# 4 replicas with the plain step; 2 replicas with 3 steps per execution and the discriminator's
# Adam wrapped in CrossReplicaOptimizer (one run for both: the plain step on 2 replicas is the
# 4-replica path with a different N, and tracing costs in proportion to the replicas).
@pytest.mark.parametrize("replicas, steps_per_execution, wrap", [(4, 1, False), (2, 3, True)],
                         ids=["4-plain", "2-steps_per_execution-wrapped"])
def test_n_replicas_match_one_device(reference, replicas, steps_per_execution, wrap):
    strategy = kr.ReplicatorStrategy([f"/cpu:{i}" for i in range(replicas)])
    gan = _train(strategy, steps_per_execution=steps_per_execution, wrap=wrap)
    assert isinstance(gan.d_optimizer, kr.optimizers.CrossReplicaOptimizer) == wrap
    kr.testing.assert_replicas_identical(_weights(gan) + list(gan.d_optimizer.variables)
                                         + list(gan.g_optimizer.variables))
    assert kr.testing.max_weight_difference(_weights(gan), _weights(reference)) <= 1e-5
    _assert_optimizers_close(gan, reference)
    assert int(gan.g_optimizer.iterations.numpy()) == 3
    assert int(gan.d_optimizer.iterations.numpy()) == 6
    # The non-trainable state moved (so it was compared, not just its initial value).
    fresh = sngan.SNGAN(sngan.generator(TINY, 10), sngan.discriminator(TINY, 10), 10, ema_decay=0.9)
    for now, before in zip(_weights(gan), _weights(fresh)):
        if now.path.endswith("/u") or "moving" in now.path or "ema_" in now.path:
            assert not np.allclose(kr.testing.replica_values(now)[0], before.numpy()), now.path


def test_sampling_uses_ema_and_generator_saves(reference, tmp_path):
    z = np.random.default_rng(0).standard_normal((10, TINY.z_dim)).astype("float32")
    labels = np.arange(10, dtype="int32")
    sampler = reference.sampler()
    out = sampler([z, labels], training=False).numpy()
    np.testing.assert_allclose(reference([z, labels]).numpy(), out, rtol=1e-5, atol=1e-6)
    live = reference.generator([z, labels], training=False).numpy()
    assert np.max(np.abs(live - out)) > 1e-4  # EMA weights differ from the live ones
    assert out.shape == (10, 16, 16, 1) and np.all(np.abs(out) <= 1.0)
    sampler.save(tmp_path / "generator.keras")
    loaded = keras.saving.load_model(tmp_path / "generator.keras")
    np.testing.assert_allclose(loaded([z, labels]).numpy(), out, rtol=1e-5, atol=1e-6)


def test_ema_is_warmed_up_like_tensorflows_moving_average():
    keras.utils.set_random_seed(0)
    gan = sngan.SNGAN(sngan.generator(TINY, 10), sngan.discriminator(TINY, 10), num_classes=10,
                      n_dis=1, ema_decay=0.9, seed=3)
    gan.compile(d_optimizer=sngan.default_optimizer(1e-3), g_optimizer=sngan.default_optimizer(1e-3))
    ds = sngan.digits_dataset(8, 1, data=_data(), shuffle=False)
    expected = [w.numpy() for w in gan.generator.trainable_weights]  # the EMA starts there
    for t in (1, 2, 3):
        gan.fit(ds, steps_per_epoch=1, epochs=1, verbose=0)
        decay = min(0.9, (1 + t) / (10 + t))  # 0.18, 0.25, 0.31: the initial weights fade fast
        expected = [decay * e + (1 - decay) * w.numpy()
                    for e, w in zip(expected, gan.generator.trainable_weights)]
        for e, ema in zip(expected, gan.ema_weights):
            np.testing.assert_allclose(ema.numpy(), e, rtol=1e-5, atol=1e-6)


def test_configs():
    cfg = sngan.get_config("imagenet128")
    g, d = sngan.generator(cfg, 1000), sngan.discriminator(cfg, 1000)
    assert g.output_shape == (None, 128, 128, 3) and d.output_shape == (None, 1)
    convs = [layer for layer in g.layers if isinstance(layer, keras.layers.Conv2D)]
    assert [c.filters for c in convs if c.name.endswith("_c2")] == [1024, 512, 256, 128, 64]
    sn = [layer for layer in d.layers if isinstance(layer, kr.layers.SpectralNormalization)]
    assert {type(s.layer) for s in sn} == {keras.layers.Conv2D, keras.layers.Dense,
                                           keras.layers.Embedding}
    # Every discriminator weight lives under a spectral normalization.
    wrapped = {id(w) for s in sn for w in s.layer.weights}
    assert all(id(w) in wrapped for w in d.trainable_weights)
    assert not any(isinstance(layer, kr.layers.GlobalBatchNormalization) for layer in d.layers)
    cbn = [layer for layer in g.layers
           if isinstance(layer, kr.layers.ConditionalGlobalBatchNormalization)]
    assert len(cbn) == 10
    assert sngan.generator("small32", 10).output_shape == (None, 32, 32, 3)


@pytest.mark.parametrize("kwargs, match", [
    ({"image_size": 30}, "cannot be made"),
    ({"d_downsample": (False, True, False, False)}, "always downsamples"),
    ({"ch": 0}, "ch must be a positive integer"),
])
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(sngan.CONFIGS["small32"], **kwargs)


def test_bad_arguments():
    with pytest.raises(ValueError, match="Unknown SN-GAN configuration"):
        sngan.generator("cifar", 10)
    g, d = sngan.generator(TINY, 10), sngan.discriminator(TINY, 10)
    with pytest.raises(ValueError, match="n_dis must be a positive integer"):
        sngan.SNGAN(g, d, 10, n_dis=0)
    with pytest.raises(ValueError, match="ema_decay must be in"):
        sngan.SNGAN(g, d, 10, ema_decay=1.0)
    with pytest.raises(ValueError, match="generator must be a built keras.Model"):
        sngan.SNGAN(keras.layers.Dense(2), d, 10)
    gan = sngan.SNGAN(g, d, 10)
    with pytest.raises(ValueError, match="two different optimizers"):
        opt = sngan.default_optimizer()
        gan.compile(d_optimizer=opt, g_optimizer=opt)
    with pytest.raises(ValueError, match="no 'loss' argument"):
        gan.compile(loss="mse")
    with pytest.raises(ValueError, match="not divisible by the number of replicas"):
        sngan.digits_dataset(30, 5, num_replicas=4)


def test_digits():
    x, y = sngan.digits(32)
    assert x.shape == (1797, 32, 32, 1) and x.dtype == np.float32
    assert y.shape == (1797,) and set(np.unique(y)) == set(range(10))
    assert x.min() >= -1.0 and x.max() <= 1.0 and x.min() < -0.99 and x.max() > 0.9
    batch = next(iter(sngan.digits_dataset(8, 5, data=(x, y))))
    assert batch[0].shape == (40, 32, 32, 1)


def test_imagenet_through_mock_data():
    tfds = pytest.importorskip("tensorflow_datasets")
    strategy = kr.ReplicatorStrategy()
    with tfds.testing.mock_data(num_examples=20):
        train = sngan.imagenet_dataset(strategy, 4, n_dis=2, image_size=32)
    images, labels = next(iter(train))
    for image, label in zip(strategy.experimental_local_results(images),
                            strategy.experimental_local_results(labels)):
        assert image.shape == (2, 32, 32, 3) and image.dtype == tf.float32
        assert label.dtype == tf.int32 and label.shape == (2,)
        assert float(tf.reduce_min(image)) >= -1.0 and float(tf.reduce_max(image)) <= 1.0
    with pytest.raises(ValueError, match="not divisible"):
        sngan.imagenet_dataset(strategy, 6, n_dis=2)
