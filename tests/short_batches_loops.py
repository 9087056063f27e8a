"""Short batches beyond `fit` on arrays (issue 50): custom loops, batch norm's statistics, metrics.

Shared by tests/test_short_batches_loops.py (4 replicas) and, as a command, by its
one-device side in a fresh interpreter::

    python tests/short_batches_loops.py OUT.json

`cells(strategy)` runs every cell under ``strategy`` (None: one device) and returns
what is compared. On one device the loops iterate the plain batched dataset, where
every row is real (`kr.real_rows` all True, `kr.global_real_rows` the batch's rows).
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras import ops  # noqa: E402

import keras_replicator as kr  # noqa: E402

#: (rows, global batch) of the custom loops: fewer rows than 4 replicas; a last batch of 2.
LOOPS = ((3, 4), (10, 8))
#: Rows of one `fit` step for batch norm's statistics: 2 (2 padding replicas), 6 (2, 2, 1, 1), 1.
BN_ROWS = (1, 2, 6)
MOMENTUM = 0.5


def _data(rows: int, features: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed + rows)
    return (rng.normal(size=(rows, features)).astype("float32"),
            rng.normal(size=(rows, 2)).astype("float32"))


def _dense(seed: int = 5) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)])


def _masked_loss(model, x, y):
    """The documented custom-loop loss: the real rows' sum over the global batch's real rows."""
    per_example = tf.reduce_sum((model(x, training=True) - y) ** 2, axis=-1)
    real = tf.cast(kr.real_rows(x), per_example.dtype)
    return tf.reduce_sum(per_example * real) / tf.cast(kr.global_real_rows(x), per_example.dtype)


def _batches(strategy, dataset, batch: int, **kwargs):
    if strategy is None:
        return dataset.batch(batch)
    return strategy.distribute_dataset(dataset, global_batch_size=batch, padding=True, **kwargs)


def custom_loop(strategy, rows: int, batch: int) -> dict:
    """Two epochs of a GradientTape loop (the batch passed into a `tf.function`), then predictions."""
    scope = strategy.scope() if strategy else tf.distribute.get_strategy().scope()
    with scope:
        model = _dense()
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)
    run = strategy.run if strategy else (lambda fn, args: fn(*args))

    def step(batch):
        x, y = batch
        with tf.GradientTape() as tape:
            loss = _masked_loss(model, x, y)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    def predict(x, y):  # args=batch: the batch's components as arguments; padding rows left out
        return tf.boolean_mask(model(x), kr.real_rows(x))

    train = tf.function(lambda batch: run(step, args=(batch,)))
    x, y = _data(rows)
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    for _ in range(2):
        for element in _batches(strategy, dataset, batch):
            train(element)
    outputs = []
    for element in _batches(strategy, dataset, batch):
        got = run(predict, args=element)
        outputs += list(strategy.experimental_local_results(got)) if strategy else [got]
    return {"weights": [w.tolist() for w in model.get_weights()],
            "predict": np.concatenate([np.asarray(o) for o in outputs]).tolist()}


def padded_batch_loop(strategy) -> dict:
    """Sequences of varying length, `padded_batch` (unknown non-batch dimension): 5 rows in batches of 4."""
    scope = strategy.scope() if strategy else tf.distribute.get_strategy().scope()
    with scope:
        keras.utils.set_random_seed(2)
        model = keras.Sequential([keras.Input((None,), dtype="int32"), keras.layers.Embedding(8, 3),
                                  keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)])
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)
    run = strategy.run if strategy else (lambda fn, args: fn(*args))
    lengths = [3, 1, 4, 2, 5]
    sequences = [np.arange(1, n + 1) % 8 for n in lengths]
    targets = np.linspace(-1, 1, 10).reshape(5, 2).astype("float32")
    dataset = tf.data.Dataset.from_generator(
        lambda: iter(zip(sequences, targets)),
        output_signature=(tf.TensorSpec([None], tf.int64), tf.TensorSpec([2], tf.float32)),
    ).map(lambda s, t: (tf.cast(s, tf.int32), t)).padded_batch(4)

    def step(x, y):  # args=batch
        with tf.GradientTape() as tape:
            loss = _masked_loss(model, x, y)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    @tf.function
    def epoch(batches):  # `for` inside the function
        for element in batches:
            run(step, args=element)

    batches = dataset if strategy is None else strategy.distribute_dataset(
        dataset, global_batch_size=4, batched=True, padding=True)
    epoch(batches)
    return {"weights": [w.tolist() for w in model.get_weights()]}


def fit_of_padded_dataset(strategy) -> dict:
    """`model.fit` / `evaluate` of ``distribute_dataset(..., padding=True)``: 3 rows, global batch 4."""
    scope = strategy.scope() if strategy else tf.distribute.get_strategy().scope()
    with scope:
        keras.utils.set_random_seed(4)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), kr.layers.GlobalBatchNormalization(),
                                  keras.layers.Dense(2)])
        model.compile(keras.optimizers.SGD(0.1), "mse", metrics=["mae"])
    x, y = _data(3)
    if strategy is None:
        history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history
        evaluation = model.evaluate(x, y, batch_size=4, verbose=0)
    else:
        data = tf.data.Dataset.from_tensor_slices((x, y))
        history = model.fit(_batches(strategy, data, 4), epochs=2, verbose=0).history
        evaluation = model.evaluate(_batches(strategy, data, 4), verbose=0)
    return {"weights": [w.tolist() for w in model.get_weights()],
            "history": {k: [float(v) for v in vs] for k, vs in history.items()},
            "evaluate": [float(v) for v in evaluation]}


def batch_norm_statistics(strategy) -> dict:
    """Plain `BatchNormalization`'s moving statistics after one `fit` step of ``rows`` rows.

    On 4 replicas: the strategy's. On one device: the reference, each replica's own
    statistics (a fresh layer per slice of the batch, as the strategy splits it) weighted
    by the slice's rows: a padding replica counts nothing, a slice of k of n rows k / n.
    """
    out = {}
    for rows in BN_ROWS:
        x, y = _data(rows, seed=10)
        if strategy is not None:
            with strategy.scope():
                model = keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization(momentum=MOMENTUM),
                                          keras.layers.Dense(2)])
                model.compile("sgd", "mse")
            model.fit(x, y, batch_size=rows, epochs=1, shuffle=False, verbose=0)
            layer = model.layers[0]
            out[str(rows)] = [layer.moving_mean.numpy().tolist(), layer.moving_variance.numpy().tolist()]
            continue
        sizes = [rows // 4 + (j < rows % 4) for j in range(4)]
        starts = np.cumsum([0, *sizes])
        mean, variance = np.zeros(3), np.zeros(3)
        for j, size in enumerate(sizes):
            if size:
                layer = keras.layers.BatchNormalization(momentum=MOMENTUM)
                layer.build((None, 3))
                layer(x[starts[j]:starts[j] + size], training=True)
                mean += size / rows * layer.moving_mean.numpy()
                variance += size / rows * layer.moving_variance.numpy()
        out[str(rows)] = [mean.tolist(), variance.tolist()]
    return out


def confusion_metrics(strategy) -> dict:
    """`Precision`, `Recall`, `AUC` (and a weighted `Precision`) in evaluate and fit: 3 rows, 10 rows by 4."""
    scope = strategy.scope() if strategy else tf.distribute.get_strategy().scope()
    with scope:
        keras.utils.set_random_seed(6)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, activation="sigmoid")])
        model.compile(keras.optimizers.SGD(0.1), "binary_crossentropy",
                      metrics=[keras.metrics.Precision(), keras.metrics.Recall(),
                               keras.metrics.AUC(num_thresholds=20)],
                      weighted_metrics=[keras.metrics.Precision(name="weighted_precision")])
    out = {}
    initial = model.get_weights()
    for rows, batch in ((3, None), (10, 4)):
        rng = np.random.default_rng(rows)
        x = rng.normal(size=(rows, 3)).astype("float32")
        y = (rng.random(size=(rows, 1)) < 0.5).astype("float32")
        # The last row (the one a padding replica copies) is a confident false positive.
        x[-1], y[-1] = model.layers[0].kernel.numpy()[:, 0] * 10, 0.0
        weights = np.linspace(0.5, 2.0, rows).astype("float32")
        model.set_weights(initial)
        evaluation = model.evaluate(x, y, sample_weight=weights, batch_size=batch, verbose=0)
        history = model.fit(x, y, sample_weight=weights, batch_size=batch, shuffle=False, verbose=0).history
        out[str(rows)] = {"evaluate": [float(v) for v in evaluation],
                          "history": {k: [float(v) for v in vs] for k, vs in history.items()}}
    return out


class HandScaledTrainStep(keras.Model):
    """A `train_step` of its own that reduces its loss by hand (no `scale_loss`), as docs/input.md says."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            per_example = ops.mean((self(x, training=True) - y) ** 2, axis=-1)
            real = ops.cast(kr.real_rows(x), per_example.dtype)
            loss = ops.sum(per_example * real) / ops.cast(kr.global_real_rows(x), per_example.dtype)
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        return {"loss": loss}


class ComputeLossTrainStep(keras.Model):
    """keras-io's custom `train_step` calling `self.compute_loss` (no `scale_loss`)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        return {"loss": loss}


def custom_train_steps(strategy) -> dict:
    """Both custom `train_step`s, 3 rows in one batch and 10 rows in batches of 4, 2 epochs."""
    out = {}
    for kind in (HandScaledTrainStep, ComputeLossTrainStep):
        for rows, batch in ((3, None), (10, 4)):
            scope = strategy.scope() if strategy else tf.distribute.get_strategy().scope()
            with scope:
                keras.utils.set_random_seed(8)
                inputs = keras.Input((3,))
                model = kind(inputs, keras.layers.Dense(2)(keras.layers.Dense(4, activation="tanh")(inputs)))
                model.compile(keras.optimizers.SGD(0.1), "mse")
            x, y = _data(rows, seed=20)
            model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
            out[f"{kind.__name__}/{rows}"] = [w.tolist() for w in model.get_weights()]
    return out


def cells(strategy) -> dict:
    """Every cell under ``strategy`` (None: one device)."""
    out = {f"loop/{rows}": custom_loop(strategy, rows, batch) for rows, batch in LOOPS}
    out["padded_batch"] = padded_batch_loop(strategy)
    out["fit_of_padded"] = fit_of_padded_dataset(strategy)
    out["batch_norm"] = batch_norm_statistics(strategy)
    out["confusion"] = confusion_metrics(strategy)
    out["train_steps"] = custom_train_steps(strategy)
    return out


if __name__ == "__main__":
    with open(sys.argv[1], "w", encoding="utf-8") as f:
        json.dump(cells(None), f)
