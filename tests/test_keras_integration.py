"""Keras 3 under ReplicatorStrategy: model kinds, custom steps and loops, saving."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from tests.helpers import image_data, regression_data, run_python


@pytest.fixture(scope="module")
def strategy():
    return kr.ReplicatorStrategy()


class Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(x))


def sequential():
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])


def functional():
    inputs = keras.Input((8,))
    return keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Dense(16, activation="relu")(inputs)))


@pytest.mark.parametrize("build", [sequential, functional, Subclassed], ids=["sequential", "functional", "subclassed"])
def test_compile_fit_evaluate_predict(strategy, build):
    x, y = regression_data(80)  # 80 is not a multiple of the batch: a partial last batch
    with strategy.scope():
        model = build()
        model.compile("adam", "mse", metrics=["mae"])
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    loss, mae = model.evaluate(x, y, batch_size=16, verbose=0)
    predictions = model.predict(x, batch_size=16, verbose=0)
    assert predictions.shape == (80, 1)
    np.testing.assert_allclose(loss, np.mean((predictions - y) ** 2), rtol=1e-4)
    kr.testing.assert_replicas_identical(model)


def test_keras_applications_model(strategy):
    x, y = image_data(16, size=32, classes=10)
    with strategy.scope():
        model = keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=10)
        model.compile("sgd", "sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert model.predict(x, batch_size=8, verbose=0).shape == (16, 10)
    # Includes plain BatchNormalization's moving statistics, kept in sync (see layers.py).
    kr.testing.assert_replicas_identical(model)


class TinyGAN(keras.Model):
    """A GAN whose train_step uses two optimizers, as the SN-GAN tutorial will."""

    def __init__(self):
        super().__init__()
        self.generator = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
        self.discriminator = keras.Sequential([keras.Input((2,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])

    def call(self, x):
        return self.discriminator(x)

    def compile(self, g_opt, d_opt):
        super().compile()
        self.g_opt, self.d_opt = g_opt, d_opt
        self.bce = keras.losses.BinaryCrossentropy(from_logits=True, reduction="sum")

    def train_step(self, real):
        batch = tf.shape(real)[0]
        z = tf.random.normal([batch, 4])
        global_batch = tf.cast(batch * kr.num_replicas(), tf.float32)
        with tf.GradientTape() as tape:
            fake = self.generator(z, training=True)
            d_loss = (self.bce(tf.ones([batch, 1]), self.discriminator(real, training=True))
                      + self.bce(tf.zeros([batch, 1]), self.discriminator(fake, training=True))) / global_batch
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_opt.apply(grads, self.discriminator.trainable_weights)
        with tf.GradientTape() as tape:
            fake = self.generator(z, training=True)
            g_loss = self.bce(tf.ones([batch, 1]), self.discriminator(fake, training=True)) / global_batch
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_opt.apply(grads, self.generator.trainable_weights)
        return {"d_loss": kr.all_reduce(d_loss), "g_loss": kr.all_reduce(g_loss)}


def test_custom_train_step_with_two_optimizers(strategy):
    real = np.random.default_rng(0).normal(loc=3.0, size=(64, 2)).astype("float32")
    with strategy.scope():
        gan = TinyGAN()
        gan.compile(keras.optimizers.Adam(1e-3), keras.optimizers.Adam(1e-3))
    history = gan.fit(real, batch_size=16, epochs=2, verbose=0)
    assert set(history.history) == {"d_loss", "g_loss"}
    assert all(np.isfinite(history.history["d_loss"]))
    assert int(gan.d_opt.iterations.numpy()) == int(gan.g_opt.iterations.numpy()) == 8
    kr.testing.assert_replicas_identical(gan)


def test_custom_loop_with_strategy_run_matches_one_device(strategy):
    x, y = regression_data(64)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)

    def build():
        keras.utils.set_random_seed(3)
        model = sequential()
        return model, keras.optimizers.SGD(0.05)

    with strategy.scope():
        model, opt = build()
        opt.build(model.trainable_variables)

    @tf.function
    def train_step(batch):
        def replica_step(xb, yb):
            with tf.GradientTape() as tape:
                per_example = tf.reduce_mean((model(xb, training=True) - yb) ** 2, axis=-1)
                loss = tf.reduce_sum(per_example) / 32.0  # global batch
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply(grads, model.trainable_variables)
            return loss
        return strategy.reduce("sum", strategy.run(replica_step, args=batch), axis=None)

    losses = [float(train_step(b)) for b in strategy.experimental_distribute_dataset(dataset)]

    ref, ref_opt = build()
    ref_losses = []
    for xb, yb in dataset:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((ref(xb) - yb) ** 2)
        ref_opt.apply(tape.gradient(loss, ref.trainable_variables), ref.trainable_variables)
        ref_losses.append(float(loss))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert kr.testing.max_weight_difference(model, ref) <= 1e-5


def test_save_and_reload_without_the_strategy(strategy, tmp_path):
    x, y = regression_data(32)
    with strategy.scope():
        model = functional()
        model.compile("adam", "mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    expected = model.predict(x, verbose=0)
    np.save(tmp_path / "x.npy", x)
    result = run_python(
        f"""
        import keras, numpy as np
        model = keras.models.load_model({path!r})
        np.save({str(tmp_path / 'out.npy')!r}, model.predict(np.load({str(tmp_path / 'x.npy')!r}), verbose=0))
        """
    )
    assert result.returncode == 0, result.stderr
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), expected, rtol=1e-5, atol=1e-6)
    # Also reloadable in this process, outside the scope, and trainable again.
    reloaded = keras.models.load_model(path)
    np.testing.assert_allclose(reloaded.predict(x, verbose=0), expected, rtol=1e-5, atol=1e-6)
    reloaded.fit(x, y, verbose=0)
