"""Real Keras programs in the patterns of keras-io's examples, with small data (not a test module).

Each `PROGRAMS[name](strategy)` builds its model under `strategy` (None: one
device), trains it and returns its final weights and `fit`'s history. The
patterns, as keras-io writes them:

* `siamese`: a siamese network with a contrastive loss that returns
  `ops.mean(...)` (keras-io's `siamese_contrastive`);
* `endpoint`: the endpoint-layer pattern, a layer calling a `keras.losses`
  object and passing the result to `self.add_loss`, `compile` without a loss
  (keras-io's "training and evaluation with the built-in methods");
* `distillation`: knowledge distillation, a `Distiller` with its own
  `compute_loss` combining two `keras.losses` objects (`knowledge_distillation`);
* `vae`: a variational autoencoder with its own `train_step`, the
  KL term added by its sampling layer, the reconstruction loss from
  `self.compute_loss` (keras-io's `vae`, its losses through Keras; its
  sampling noise comes with the data);
* `multi_io`: a model of several inputs and outputs with dict losses and
  `loss_weights` (keras-io's functional API guide, the ticket classifier).

Usage: ``python tests/keras_io_programs.py OUT.json`` writes one device's results.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras import layers, ops  # noqa: E402

BATCH, EPOCHS = 16, 2


def _scope(strategy):
    return strategy.scope() if strategy is not None else contextlib.nullcontext()


def _result(model, history) -> dict:
    return {"weights": [w.tolist() for w in model.get_weights()],
            "history": {k: [float(v) for v in values] for k, values in history.history.items()}}


# --- siamese network, contrastive loss --------------------------------------------------


def contrastive_loss(margin=1):
    def contrastive_loss(y_true, y_pred):
        square_pred = ops.square(y_pred)
        margin_square = ops.square(ops.maximum(margin - (y_pred), 0))
        return ops.mean((1 - y_true) * square_pred + (y_true) * margin_square)

    return contrastive_loss


def euclidean_distance(vects):
    x, y = vects
    sum_square = ops.sum(ops.square(x - y), axis=1, keepdims=True)
    return ops.sqrt(ops.maximum(sum_square, keras.backend.epsilon()))


def siamese(strategy) -> dict:
    rng = np.random.default_rng(1)
    rows = 46  # the last batch of 14: unequal shares on 4 replicas
    a, b = (rng.standard_normal((rows, 10)).astype("float32") for _ in range(2))
    same = (rng.uniform(size=(rows, 1)) < 0.5).astype("float32")
    b = np.where(same > 0, a + 0.1 * b, b).astype("float32")
    keras.utils.set_random_seed(0)
    with _scope(strategy):
        inputs = layers.Input((10,))
        x = layers.Dense(16, activation="tanh")(inputs)
        embedding_network = keras.Model(inputs, layers.Dense(8, activation="tanh")(x))
        input_1, input_2 = layers.Input((10,)), layers.Input((10,))
        merge_layer = layers.Lambda(euclidean_distance, output_shape=(1,))(
            [embedding_network(input_1), embedding_network(input_2)])
        output_layer = layers.Dense(1, activation="sigmoid")(merge_layer)
        model = keras.Model(inputs=[input_1, input_2], outputs=output_layer)
        model.compile(loss=contrastive_loss(margin=1), optimizer="RMSprop", metrics=["accuracy"])
    history = model.fit([a, b], same, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return _result(model, history)


# --- the endpoint-layer pattern -------------------------------------------------------


class LogisticEndpoint(keras.layers.Layer):
    def __init__(self, name=None):
        super().__init__(name=name)
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    def call(self, targets, logits, sample_weights=None):
        # Compute the training-time loss value and add it to the layer using `self.add_loss()`.
        loss = self.loss_fn(targets, logits, sample_weights)
        self.add_loss(loss)
        # Return the inference-time prediction tensor (for `.predict()`).
        return ops.softmax(logits)


def endpoint(strategy) -> dict:
    rng = np.random.default_rng(2)
    data = {"inputs": rng.random((48, 3)).astype("float32"),
            "targets": rng.random((48, 10)).astype("float32")}
    keras.utils.set_random_seed(0)
    with _scope(strategy):
        inputs = keras.Input(shape=(3,), name="inputs")
        targets = keras.Input(shape=(10,), name="targets")
        logits = keras.layers.Dense(10)(inputs)
        predictions = LogisticEndpoint(name="predictions")(targets, logits)
        model = keras.Model(inputs=[inputs, targets], outputs=predictions)
        model.compile(optimizer="adam")  # No loss argument!
    history = model.fit(data, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return _result(model, history)


# --- knowledge distillation -----------------------------------------------------------


class Distiller(keras.Model):
    def __init__(self, student, teacher):
        super().__init__()
        self.teacher = teacher
        self.student = student

    def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha=0.1, temperature=3):
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn = student_loss_fn
        self.distillation_loss_fn = distillation_loss_fn
        self.alpha = alpha
        self.temperature = temperature

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        teacher_pred = self.teacher(x, training=False)
        student_loss = self.student_loss_fn(y, y_pred)
        distillation_loss = self.distillation_loss_fn(
            ops.softmax(teacher_pred / self.temperature, axis=1),
            ops.softmax(y_pred / self.temperature, axis=1),
        ) * (self.temperature**2)
        loss = self.alpha * student_loss + (1 - self.alpha) * distillation_loss
        return loss

    def call(self, x):
        return self.student(x)


def distillation(strategy) -> dict:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((62, 12)).astype("float32")  # a last batch of 14: unequal shares
    y = rng.integers(0, 5, 62)
    keras.utils.set_random_seed(0)
    with _scope(strategy):
        teacher = keras.Sequential([keras.Input((12,)), layers.Dense(32, activation="relu"), layers.Dense(5)],
                                   name="teacher")
        student = keras.Sequential([keras.Input((12,)), layers.Dense(8, activation="relu"), layers.Dense(5)],
                                   name="student")
        teacher.trainable = False
        distiller = Distiller(student=student, teacher=teacher)
        distiller.compile(
            optimizer=keras.optimizers.Adam(),
            metrics=[keras.metrics.SparseCategoricalAccuracy()],
            student_loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            distillation_loss_fn=keras.losses.KLDivergence(),
            alpha=0.1,
            temperature=10,
        )
    history = distiller.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return _result(distiller, history)


# --- a variational autoencoder with its own train_step --------------------------------


class Sampling(layers.Layer):
    """Uses (z_mean, z_log_var) to sample z; adds the KL divergence, a mean over the batch.

    The noise comes with the data: replicas draw their own random numbers, which one
    device draws for the whole batch differently (docs/index.md), and this program
    checks the losses.
    """

    def call(self, inputs):
        z_mean, z_log_var, epsilon = inputs
        kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
        self.add_loss(ops.mean(ops.sum(kl_loss, axis=1)))
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


def reconstruction_loss(data, reconstruction):
    return ops.sum(keras.losses.binary_crossentropy(data, reconstruction), axis=1)


class VAE(keras.Model):
    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker]

    def call(self, data):
        return self.decoder(self.encoder(data)[2])

    def train_step(self, data):
        data, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            total_loss = self.compute_loss(x=data, y=data["images"], y_pred=reconstruction)
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        return {"loss": self.total_loss_tracker.result()}


def vae(strategy) -> dict:
    rng = np.random.default_rng(4)
    data = {"images": (rng.uniform(size=(64, 6, 1)) < 0.3).astype("float32"),  # 4 batches of 16
            "noise": rng.standard_normal((64, 2)).astype("float32")}
    keras.utils.set_random_seed(0)
    with _scope(strategy):
        encoder_inputs = {"images": keras.Input(shape=(6, 1), name="images"),
                          "noise": keras.Input(shape=(2,), name="noise")}
        x = layers.Flatten()(encoder_inputs["images"])
        x = layers.Dense(8, activation="relu")(x)
        z_mean = layers.Dense(2, name="z_mean")(x)
        z_log_var = layers.Dense(2, name="z_log_var")(x)
        z = Sampling()([z_mean, z_log_var, encoder_inputs["noise"]])
        encoder = keras.Model(encoder_inputs, [z_mean, z_log_var, z], name="encoder")
        latent_inputs = keras.Input(shape=(2,))
        x = layers.Dense(8, activation="relu")(latent_inputs)
        decoder_outputs = layers.Reshape((6, 1))(layers.Dense(6, activation="sigmoid")(x))
        decoder = keras.Model(latent_inputs, decoder_outputs, name="decoder")
        model = VAE(encoder, decoder)
        model.compile(optimizer=keras.optimizers.Adam(), loss=reconstruction_loss)
    history = model.fit(data, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return _result(model, history)


# --- several inputs and outputs, dict losses -----------------------------------------


def multi_io(strategy) -> dict:
    num_tags, num_words, num_departments, rows = 6, 40, 4, 62  # a last batch of 14
    rng = np.random.default_rng(5)
    title_data = rng.integers(0, num_words, size=(rows, 5))
    body_data = rng.integers(0, num_words, size=(rows, 12))
    tags_data = rng.integers(0, 2, size=(rows, num_tags)).astype("float32")
    priority_targets = rng.random(size=(rows, 1)).astype("float32")
    dept_targets = rng.integers(0, 2, size=(rows, num_departments)).astype("float32")
    keras.utils.set_random_seed(0)
    with _scope(strategy):
        title_input = keras.Input(shape=(None,), name="title")
        body_input = keras.Input(shape=(None,), name="body")
        tags_input = keras.Input(shape=(num_tags,), name="tags")
        title_features = layers.GlobalAveragePooling1D()(layers.Embedding(num_words, 8)(title_input))
        body_features = layers.GlobalAveragePooling1D()(layers.Embedding(num_words, 4)(body_input))
        x = layers.concatenate([title_features, body_features, tags_input])
        priority_pred = layers.Dense(1, name="priority")(x)
        department_pred = layers.Dense(num_departments, name="department")(x)
        model = keras.Model(inputs=[title_input, body_input, tags_input],
                            outputs={"priority": priority_pred, "department": department_pred})
        model.compile(
            optimizer=keras.optimizers.RMSprop(1e-3),
            loss={"priority": keras.losses.BinaryCrossentropy(from_logits=True),
                  "department": keras.losses.CategoricalCrossentropy(from_logits=True)},
            loss_weights={"priority": 1.0, "department": 0.2},
        )
    history = model.fit(
        {"title": title_data, "body": body_data, "tags": tags_data},
        {"priority": priority_targets, "department": dept_targets},
        batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return _result(model, history)


PROGRAMS = {"siamese": siamese, "endpoint": endpoint, "distillation": distillation, "vae": vae,
            "multi_io": multi_io}


if __name__ == "__main__":
    results = {name: program(None) for name, program in PROGRAMS.items()}
    with open(sys.argv[1], "w") as f:
        json.dump(results, f)
