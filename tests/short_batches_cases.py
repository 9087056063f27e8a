"""The short-batch matrix (issue 50), shared by tests/test_short_batches.py and its 2-worker job.

Model families x row counts x fit / evaluate / predict. `run_case` runs one cell
with the model of the current scope (a strategy's or one device's) and returns
what is compared: predict's rows, evaluate's loss and metric, fit's logged loss
and weights.
"""

from __future__ import annotations

import keras
import numpy as np
from keras import ops

import keras_replicator as kr

#: (rows, batch_size): fewer rows than 4 replicas, replicas - 1, replicas + 1, a last short batch.
ROWS = ((1, None), (3, None), (5, None), (10, 4))

#: The add_loss family's coefficient (keras-io's subclassing guide).
ADD_LOSS = 1e-2


class MeanActivity(keras.layers.Layer):
    """keras-io's subclassing guide: a mean of the activations as an `add_loss` term."""

    def __init__(self, coefficient=ADD_LOSS, **kwargs):
        super().__init__(**kwargs)
        self.coefficient = coefficient

    def call(self, inputs):
        self.add_loss(self.coefficient * ops.mean(inputs))
        return inputs


def _dense():
    inputs = keras.Input((3,))
    return keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Dense(4, activation="tanh")(inputs)))


def _conv_bn():
    return keras.Sequential([
        keras.Input((6, 6, 1)), keras.layers.Conv2D(2, 3), keras.layers.BatchNormalization(),
        keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(2),
    ])


def _global_bn():
    return keras.Sequential([
        keras.Input((3,)), keras.layers.Dense(4), kr.layers.GlobalBatchNormalization(),
        keras.layers.Dense(2),
    ])


def _recurrent(layer):
    def build():
        return keras.Sequential([keras.Input((5, 3)), layer(4), keras.layers.Dense(2)])

    return build


def _merge(layer):
    def build():
        inputs = keras.Input((3,))
        merged = layer()([keras.layers.Dense(2)(inputs), keras.layers.Dense(2)(inputs)])
        return keras.Model(inputs, keras.layers.Dense(2)(merged))

    return build


def _mha():
    inputs = keras.Input((4, 3))
    attended = keras.layers.MultiHeadAttention(2, 2)(inputs, inputs)
    return keras.Model(inputs, keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(attended)))


def _add_loss(coefficient):
    inputs = keras.Input((3,))
    hidden = MeanActivity(coefficient)(keras.layers.Dense(3)(inputs))
    return keras.Model(inputs, keras.layers.Dense(2)(hidden))


FAMILIES = {
    "dense": ((3,), _dense),
    "conv_bn": ((6, 6, 1), _conv_bn),
    "global_bn": ((3,), _global_bn),
    "lstm": ((5, 3), _recurrent(keras.layers.LSTM)),
    "gru": ((5, 3), _recurrent(keras.layers.GRU)),
    "add": ((3,), _merge(keras.layers.Add)),
    "concatenate": ((3,), _merge(keras.layers.Concatenate)),
    "mha": ((4, 3), _mha),
    "add_loss": ((3,), None),
}


#: The families of the 2-worker job: those whose results depend on counts summed over the
#: workers (plain batch norm's moving statistics weighted by rows, global batch norm's
#: statistics, the add_loss mean's weight), which also run the plain Dense layers, mse loss,
#: mae metric and predict of "dense". The other families differ in the layers a replica runs
#: on its padded slice, the same on any worker: tests/test_short_batches.py checks them all
#: on 4 replicas (each multi-worker cell costs ~1 s of CPU per call per worker).
MULTI_WORKER_FAMILIES = ("conv_bn", "global_bn", "add_loss")


def build(family: str) -> keras.Model:
    """The family's model (seeded), compiled; in the caller's scope."""
    keras.utils.set_random_seed(7)
    _, make = FAMILIES[family]
    model = _add_loss(ADD_LOSS) if family == "add_loss" else make()
    model.compile(keras.optimizers.SGD(0.1), "mse", metrics=["mae"])
    return model


def data(family: str, rows: int):
    shape, _ = FAMILIES[family]
    rng = np.random.default_rng(rows)
    return (rng.normal(size=(rows, *shape)).astype("float32"),
            rng.normal(size=(rows, 2)).astype("float32"))


def run_case(model: keras.Model, family: str, rows: int, batch_size, initial) -> dict:
    """predict, evaluate, then one epoch of fit from ``initial`` weights: what is compared."""
    x, y = data(family, rows)
    model.set_weights(initial)
    out = {"predict": model.predict(x, batch_size=batch_size, verbose=0)}
    out["evaluate"] = np.array(model.evaluate(x, y, batch_size=batch_size, verbose=0))
    history = model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0).history
    out["fit_loss"] = np.array([history["loss"][-1], history["mae"][-1]])
    out["weights"] = model.get_weights()
    return out


def fit_comparable(family: str, rows: int) -> bool:
    """Whether training equals one device's: plain batch norm normalises each replica's rows."""
    return family != "conv_bn" or rows == 1
