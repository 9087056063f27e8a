"""SpectralNormalization: the paper's maths, identical replicas, saving, config, bad inputs."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr


def test_sigma_converges_to_largest_singular_value():
    rng = np.random.default_rng(0)
    layer = kr.layers.SpectralNormalization(keras.layers.Conv2D(5, 3))
    x = rng.standard_normal((2, 8, 8, 3)).astype("float32")
    for _ in range(40):
        layer(x, training=True)
    w = layer.layer.kernel.numpy().reshape(-1, 5)
    sigma, _ = kr.layers.spectral_norm_sigma(w, layer.u.numpy())
    np.testing.assert_allclose(float(sigma), np.linalg.svd(w, compute_uv=False)[0], rtol=1e-4)


def test_output_is_the_layer_with_its_kernel_divided_by_sigma():
    rng = np.random.default_rng(1)
    layer = kr.layers.SpectralNormalization(keras.layers.Dense(4, use_bias=True))
    x = rng.standard_normal((3, 6)).astype("float32")
    layer.build((None, 6))
    layer.layer.bias.assign(rng.standard_normal(4).astype("float32"))
    u0 = layer.u.numpy()
    w = layer.layer.kernel.numpy()
    # One power iteration from u0, as the layer does, in NumPy.
    v = u0 @ w.T
    v /= np.linalg.norm(v) + 1e-12
    u1 = v @ w
    u1 /= np.linalg.norm(u1) + 1e-12
    sigma = ((v @ w) @ u1.T).item()
    expected = x @ (w / sigma) + layer.layer.bias.numpy()
    np.testing.assert_allclose(layer(x, training=False).numpy(), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(layer.u.numpy(), u0)  # inference does not update u
    np.testing.assert_allclose(layer(x, training=True).numpy(), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(layer.u.numpy(), u1, rtol=1e-5)
    np.testing.assert_array_equal(layer.layer.kernel.numpy(), w)  # the kernel is not overwritten


def test_gradient_flows_through_sigma():
    # sum(x @ W / sigma), sigma = v W u^T with u, v held constant:
    # dW = outer(sum_x, 1) / sigma - sum(x @ W) / sigma^2 * outer(v, u).
    rng = np.random.default_rng(2)
    layer = kr.layers.SpectralNormalization(keras.layers.Dense(3, use_bias=False))
    x = rng.standard_normal((5, 4))
    layer.build((None, 4))
    u0 = layer.u.numpy().astype(np.float64)
    with tf.GradientTape() as tape:
        y = tf.reduce_sum(layer(x.astype("float32"), training=True))
    (grad,) = tape.gradient(y, [layer.layer.kernel.value])
    w = layer.layer.kernel.numpy().astype(np.float64)
    v = u0 @ w.T
    v /= np.linalg.norm(v)
    u = v @ w
    u /= np.linalg.norm(u)
    sigma = ((v @ w) @ u.T).item()
    xs = x.sum(0)
    expected = np.outer(xs, np.ones(3)) / sigma - (xs @ w).sum() / sigma**2 * np.outer(v, u)
    np.testing.assert_allclose(grad.numpy(), expected, rtol=1e-4, atol=1e-5)
    # A kernel-overwriting variant (keras.layers.SpectralNormalization) would give the first term only.
    assert np.max(np.abs(expected - np.outer(xs, np.ones(3)) / sigma)) > 1e-2


def _critic():
    return keras.Sequential([
        keras.Input((8, 8, 3)),
        kr.layers.SpectralNormalization(keras.layers.Conv2D(4, 3)),
        keras.layers.Flatten(),
        kr.layers.SpectralNormalization(keras.layers.Dense(1)),
    ])


def _fit(model, x, y):
    model.compile(keras.optimizers.Adam(0.01), "mse")
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return model


def test_replicated_u_identical_matches_one_device_and_is_saved(tmp_path):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((32, 8, 8, 3)).astype("float32")
    y = rng.standard_normal((32, 1)).astype("float32")
    keras.utils.set_random_seed(0)
    reference = _fit(_critic(), x, y)
    strategy = kr.ReplicatorStrategy()
    with strategy.scope():
        keras.utils.set_random_seed(0)
        replicated = _critic()
        _fit(replicated, x, y)
    kr.testing.assert_replicas_identical(replicated)  # u included, bit for bit
    assert kr.testing.max_weight_difference(replicated, reference) <= 1e-5
    u = replicated.layers[0].u
    assert len(kr.testing.replica_values(u)) == strategy.num_replicas_in_sync
    path = tmp_path / "critic.keras"
    replicated.save(path)
    restored = keras.saving.load_model(path)
    np.testing.assert_array_equal(restored.layers[0].u.numpy(), kr.testing.replica_values(u)[0])
    np.testing.assert_allclose(restored.predict(x, verbose=0), replicated.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)


def test_config_round_trip():
    layer = kr.layers.SpectralNormalization(keras.layers.Embedding(10, 6), power_iterations=2,
                                            epsilon=1e-8, name="sn")
    config = keras.saving.serialize_keras_object(layer)
    assert config["registered_name"] == "keras_replicator>SpectralNormalization"
    clone = keras.saving.deserialize_keras_object(config)
    assert (clone.power_iterations, clone.epsilon, clone.name) == (2, 1e-8, "sn")
    assert isinstance(clone.layer, keras.layers.Embedding)
    ids = np.array([1, 2, 3])
    clone(ids), layer(ids)
    clone.set_weights(layer.get_weights())
    np.testing.assert_allclose(clone(ids).numpy(), layer(ids).numpy())


@pytest.mark.parametrize("kwargs, match", [
    ({"layer": "dense"}, "wraps a Keras layer"),
    ({"power_iterations": 0}, "power_iterations must be a positive integer"),
    ({"epsilon": -1.0}, "epsilon must be a positive number"),
])
def test_bad_arguments(kwargs, match):
    args = {"layer": keras.layers.Dense(2), **kwargs}
    with pytest.raises(ValueError, match=match):
        kr.layers.SpectralNormalization(**args)


def test_layer_without_kernel_is_refused():
    layer = kr.layers.SpectralNormalization(keras.layers.ReLU())
    with pytest.raises(ValueError, match="neither"):
        layer(np.zeros((1, 2), "float32"))
