"""The cells of tests/test_loss_forms.py: one training per loss form x optimizer (not a test module).

Usage::

    python tests/loss_forms_job.py one OUT.json        # one device, no strategy (the reference)
    python tests/loss_forms_job.py one OUT.json regularizers/sgd   # one device, those cells only
    python tests/loss_forms_job.py stock OUT.json sgd  # stock tf.distribute.MirroredStrategy, 4 CPU devices
    python tests/loss_forms_job.py workers OUT_DIR     # each of 2 launched workers x 2 devices (SGD)

Each cell trains a small regression (or, for `class_weight`, a classification)
on 62 rows, batches of 16 (the last one has 14 rows: on 4 replicas, shares of
4, 4, 3, 3), 2 epochs, and records the final weights and `fit`'s history. The
test module imports `train_cells` for 4 replicas in its own process. The 2 workers
train the SGD cells (`WORKER_OPTIMIZERS`).
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
from keras import ops  # noqa: E402

ROWS, BATCH, EPOCHS, FEATURES = 62, 16, 2, 8
OPTIMIZERS = ("sgd", "adamw")
# The 2-worker job's. What the workers change is the loss's side (rows and totals counted over
# both workers, a global sum of sample weights, the logged values reduced over them); the
# optimizer then applies the same summed gradients as on 4 replicas of one process. SGD moves
# the weights by the gradient itself (AdamW's step hides its scale): without the fix, every SGD
# cell of benchmarks/results/loss_forms.md fails (weights 5e-3 or more apart, or the logged
# loss), and one AdamW cell passes (custom_train_step: 5.1e-7, the same logs).
WORKER_OPTIMIZERS = ("sgd",)


def _data(rows: int = ROWS):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, FEATURES)).astype("float32")
    y = (x @ rng.standard_normal((FEATURES, 1)) + rng.standard_normal((rows, 1))).astype("float32")
    weights = rng.uniform(0.2, 2.0, rows).astype("float32")
    return x, y, weights


def scalar_mse(y_true, y_pred):
    """A loss function returning a scalar (a mean over the batch), as contrastive losses do."""
    return ops.mean(ops.square(y_true - y_pred))


def per_sample_mse(y_true, y_pred):
    return ops.mean(ops.square(y_true - y_pred), axis=-1)


class PerSampleActivity(keras.layers.Layer):
    """`add_loss` of a per-sample tensor (one device sums it)."""

    def call(self, h):
        self.add_loss(0.01 * ops.sum(ops.square(h), axis=-1))
        return h


class MeanActivity(keras.layers.Layer):
    """`add_loss` of a scalar mean over the batch."""

    def call(self, h):
        self.add_loss(0.1 * ops.mean(ops.square(h)))
        return h


class LossObjectEndpoint(keras.layers.Layer):
    """keras-io's endpoint layer: `add_loss` of a `keras.losses` object's result."""

    def call(self, targets, predictions):
        self.add_loss(keras.losses.MeanSquaredError()(targets, predictions))
        return predictions


class MeanEndpoint(keras.layers.Layer):
    """`add_loss` of a hand-written mean: the model's only loss (`compile(loss=None)`)."""

    def call(self, targets, predictions):
        self.add_loss(ops.mean(ops.square(targets - predictions)))
        return predictions


class CustomComputeLoss(keras.Model):
    """Keras's `compute_loss` docstring pattern: a mean, plus `self.losses`."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = ops.mean(ops.square(y_pred - y))
        if self.losses:
            loss = loss + ops.sum(self.losses)
        return loss


class CustomTrainStep(keras.Model):
    """keras-io's "customizing fit" pattern: `train_step` calling `self.compute_loss`."""

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def _hidden(inputs, **kwargs):
    return keras.layers.Dense(4, activation="tanh", **kwargs)(inputs)


def _regression(layer=None, cls=keras.Model, **dense):
    inputs = keras.Input((FEATURES,))
    h = _hidden(inputs, **dense)
    if layer is not None:
        h = layer()(h)
    return cls(inputs, keras.layers.Dense(1)(h))


def _endpoint(layer):
    inputs, targets = keras.Input((FEATURES,)), keras.Input((1,))
    predictions = keras.layers.Dense(1)(_hidden(inputs))
    return keras.Model([inputs, targets], layer()(targets, predictions))


def _two_outputs():
    inputs = keras.Input((FEATURES,))
    h = _hidden(inputs)
    return keras.Model(inputs, {"a": keras.layers.Dense(1, name="a")(h), "b": keras.layers.Dense(1, name="b")(h)})


def _two_outputs_list():
    inputs = keras.Input((FEATURES,))
    h = _hidden(inputs)
    return keras.Model(inputs, [keras.layers.Dense(1, name="a")(h), keras.layers.Dense(1, name="b")(h)])


# Logged as one device logs them only when the replicas' shares are equal (64 rows: 4
# batches of 16): a train_step's own `Mean` of its loss counts each replica's value once;
# reduction="none" logs per-sample values weighted by the batch size, which one device
# counts B x B times per step, the replicas b_r x b_r each.
EQUAL_SHARES = ("custom_train_step", "object_none")


def _form(name: str):
    """(model builder, compile's loss arguments, fit's data arguments) of the loss form `name`."""
    x, y, weights = _data(64 if name in EQUAL_SHARES else ROWS)
    plain = dict(x=x, y=y)
    mse = keras.losses.MeanSquaredError
    if name == "fn_per_sample":
        return _regression, dict(loss=per_sample_mse), plain
    if name == "fn_scalar":
        return _regression, dict(loss=scalar_mse), plain
    if name.startswith("object_"):
        reduction = name[len("object_"):]
        data = dict(plain, sample_weight=weights) if reduction == "mean_with_sample_weight" else plain
        return _regression, dict(loss=mse(reduction=reduction)), data
    if name == "add_loss_per_sample":
        return lambda: _regression(PerSampleActivity), dict(loss="mse"), plain
    if name == "add_loss_scalar_mean":
        return lambda: _regression(MeanActivity), dict(loss="mse"), plain
    if name == "add_loss_loss_object":
        return lambda: _endpoint(LossObjectEndpoint), dict(loss=None), dict(x=(x, y), y=None)
    if name == "add_loss_only":
        return lambda: _endpoint(MeanEndpoint), dict(loss=None), dict(x=(x, y), y=None)
    if name == "custom_compute_loss":
        return lambda: _regression(MeanActivity, cls=CustomComputeLoss), dict(), plain
    if name == "custom_train_step":
        return lambda: _regression(cls=CustomTrainStep), dict(loss=scalar_mse), plain
    if name == "regularizers":
        regularized = dict(kernel_regularizer=keras.regularizers.L2(0.01),
                           activity_regularizer=keras.regularizers.L1(0.01))
        return lambda: _regression(**regularized), dict(loss="mse"), plain
    if name == "sample_weight":
        return _regression, dict(loss="mse"), dict(plain, sample_weight=weights)
    if name == "class_weight":
        labels = (y > 0).astype("int32")
        inputs = keras.Input((FEATURES,))
        build = lambda: keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(_hidden(inputs)))  # noqa: E731
        return build, dict(loss="binary_crossentropy", metrics=["accuracy"]), dict(
            x=x, y=labels, class_weight={0: 1.0, 1: 3.0})
    if name == "dict_losses":
        return _two_outputs, dict(loss={"a": "mse", "b": scalar_mse}, loss_weights={"a": 1.0, "b": 0.5}), dict(
            x=x, y={"a": y, "b": -y})
    if name == "list_losses":
        return _two_outputs_list, dict(loss=[mse(), keras.losses.MeanAbsoluteError(reduction="sum")],
                                       loss_weights=[0.3, 1.0]), dict(x=x, y=[y, -y])
    raise ValueError(name)


FORMS = ("fn_per_sample", "fn_scalar", "object_sum_over_batch_size", "object_sum",
         "object_mean_with_sample_weight", "object_none", "add_loss_per_sample", "add_loss_scalar_mean",
         "add_loss_loss_object", "add_loss_only", "custom_compute_loss", "custom_train_step",
         "regularizers", "sample_weight", "class_weight", "dict_losses", "list_losses")


# Losses summed over the rows: SGD's step divided by the batch, or it diverges (and
# amplifies rounding differences).
SUMMED = ("object_sum", "object_none")


def make_optimizer(kind: str, form: str = "") -> keras.optimizers.Optimizer:
    if kind == "sgd":
        return keras.optimizers.SGD(0.05 / BATCH if form in SUMMED else 0.05)
    return keras.optimizers.AdamW(0.01, weight_decay=0.01)


def train_cell(strategy, form: str, optimizer: str) -> dict:
    build, compile_args, data = _form(form)
    keras.utils.set_random_seed(0)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = build()
        model.compile(make_optimizer(optimizer, form), **compile_args)
    history = model.fit(**data, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0).history
    return {"weights": [w.tolist() for w in model.get_weights()],
            "history": {k: [float(v) for v in values] for k, values in history.items()}}


def train_cells(strategy=None, forms=FORMS, optimizers=OPTIMIZERS) -> dict:
    """{"form/optimizer": {"weights": [...], "history": {...}}} for every cell."""
    return {f"{form}/{opt}": train_cell(strategy, form, opt) for form in forms for opt in optimizers}


def main(argv: list[str]) -> None:
    mode, out, *optimizers = argv
    if mode == "one":
        cells = [cell.split("/") for cell in optimizers]  # (here: cells, "form/optimizer")
        results = ({f"{f}/{o}": train_cell(None, f, o) for f, o in cells} if cells else train_cells())
        with open(out, "w") as f:
            json.dump(results, f)
        return
    if mode == "stock":
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
        strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(4)])
        with open(out, "w") as f:
            json.dump(train_cells(strategy, optimizers=optimizers or OPTIMIZERS), f)
        return
    import keras_replicator as kr

    strategy = kr.ReplicatorStrategy()  # the launcher's cluster: 2 workers x 2 devices
    results = train_cells(strategy, optimizers=WORKER_OPTIMIZERS)
    with open(os.path.join(out, f"worker{strategy.worker_index}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1:])
