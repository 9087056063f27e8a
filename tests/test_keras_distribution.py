"""Keras's `keras.distribution.set_distribution` on TensorFlow (`keras_replicator.keras_distribution`), 4 devices.

A script written for JAX's distribution API (no strategy in it) is run after
`set_distribution(DataParallel(...))` and compared with the same model under
`kr.ReplicatorStrategy()`'s scope (the same weights: the same engine) and on one
device (weights to 1e-5: the replicas' partial sums are added in another order).
Under `ModelParallel(layout_map=...)`, an MLP and a transformer block (Embedding,
MultiHeadAttention, FFN, output projection) against one device.
"""

from __future__ import annotations

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from keras_replicator._compat import keras_trainer
from keras_replicator.errors import ArgumentError

X = np.random.default_rng(0).normal(size=(96, 8)).astype("float32")
Y = np.random.default_rng(1).normal(size=(96, 2)).astype("float32")


def jax_style_script(epochs=2):
    """What a Keras user writes for JAX: no strategy, no scope."""
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(2)])
    model.compile(keras.optimizers.Adam(0.01), "mse")
    history = model.fit(X, Y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    return model, history.history["loss"]


def max_difference(a, b):
    return max(float(np.abs(u - v).max()) for u, v in zip(a.get_weights(), b.get_weights(), strict=True))


def replicated_over(model, layer=None):
    value = (model.get_layer(layer) if layer else model.layers[0]).kernel.value
    return tuple(v.device for v in value.values) if isinstance(value, tf.distribute.DistributedValues) else ()


@pytest.fixture(autouse=True)
def no_distribution_left():
    yield
    keras.distribution.set_distribution(None)
    assert not tf.distribute.has_strategy()


@pytest.fixture(scope="module")
def one_device():
    return jax_style_script()


def test_jax_script_under_data_parallel_trains_as_the_strategys_scope(one_device):
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    model, losses = jax_style_script()
    assert model.distribute_strategy is kr.keras_distribution.strategy_for(keras.distribution.distribution())
    assert len(replicated_over(model)) == 4
    keras.distribution.set_distribution(None)

    strategy = kr.ReplicatorStrategy()
    with strategy.scope():
        keras.utils.set_random_seed(7)
        reference = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                      keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(2)])
        reference.compile(keras.optimizers.Adam(0.01), "mse")
    ref_losses = reference.fit(X, Y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]
    assert max_difference(model, reference) <= 1e-6
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)

    model_1, losses_1 = one_device
    assert max_difference(model, model_1) <= 1e-5
    np.testing.assert_allclose(losses, losses_1, rtol=1e-5)
    # evaluate and predict run replicated too, over the whole data.
    np.testing.assert_allclose(model.predict(X, batch_size=16, verbose=0),
                               model_1.predict(X, batch_size=16, verbose=0), atol=1e-5)
    np.testing.assert_allclose(model.evaluate(X, Y, batch_size=16, verbose=0),
                               model_1.evaluate(X, Y, batch_size=16, verbose=0), rtol=1e-5)


def test_named_devices_and_the_distributions_scope(one_device):
    data_parallel = keras.distribution.DataParallel(devices=["cpu:2", "cpu:3"])
    with data_parallel.scope():
        model, _ = jax_style_script()
    assert [d.rsplit(":", 2)[-2:] for d in replicated_over(model)] == [["CPU", "2"], ["CPU", "3"]]
    assert keras.distribution.distribution() is None and not tf.distribute.has_strategy()
    assert max_difference(model, one_device[0]) <= 1e-5


def test_set_distribution_none_returns_to_plain_keras(one_device):
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    replicated, _ = jax_style_script(epochs=1)
    keras.distribution.set_distribution(None)
    plain, _ = jax_style_script()
    assert not replicated_over(plain) and not tf.distribute.has_strategy()
    # Nor does fit warn "runs on one device" for the distribution's strategy (the user's own
    # strategies, made in this process by other tests, still count).
    assert replicated.distribute_strategy not in keras_trainer._strategies
    assert max_difference(plain, one_device[0]) == 0.0
    # A model built under the distribution keeps its strategy, as it keeps its sharding on JAX.
    replicated.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert len(replicated_over(replicated)) == 4


def test_a_tf_data_dataset_and_clear_session(one_device):
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(2)])
    model.compile(keras.optimizers.Adam(0.01), "mse")
    model.fit(tf.data.Dataset.from_tensor_slices((X, Y)).batch(16), epochs=2, shuffle=False, verbose=0)
    assert len(replicated_over(model)) == 4
    assert max_difference(model, one_device[0]) <= 1e-5
    # clear_session forgets Keras's distribution and TensorFlow's scope alike: plain Keras.
    keras.utils.clear_session()
    assert keras.distribution.distribution() is None and not tf.distribute.has_strategy()
    plain, _ = jax_style_script(epochs=1)
    assert not replicated_over(plain)
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    again, _ = jax_style_script(epochs=1)
    assert len(replicated_over(again)) == 4


def test_the_same_devices_give_the_same_strategy():
    first = kr.keras_distribution.strategy_for(keras.distribution.DataParallel())
    again = kr.keras_distribution.strategy_for(keras.distribution.DataParallel(
        devices=keras.distribution.list_devices()))
    assert first is again and first.num_replicas_in_sync == 4


@pytest.mark.parametrize("make, message", [
    (lambda: keras.distribution.DataParallel(devices=["cpu:0", "cpu:9"]),
     "'cpu:9' is not a device of this process"),
    (lambda: keras.distribution.DataParallel(devices=["gpu:0"]), "'gpu:0' is not a device"),
    (lambda: "data parallel", "takes keras.distribution.DataParallel, ModelParallel or None"),
], ids=["unknown_device", "no_gpu", "not_a_distribution"])
def test_what_cannot_run_is_an_error_that_changes_nothing(make, message):
    with pytest.raises(ArgumentError, match=message):
        keras.distribution.set_distribution(make())
    assert keras.distribution.distribution() is None and not tf.distribute.has_strategy()


def model_parallel_script(epochs=2):
    """Keras's tensor-parallel example for JAX: a column- then a row-parallel Dense."""
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="column"),
                              keras.layers.Dense(2, name="row")])
    model.compile(keras.optimizers.SGD(0.05), "mse")
    history = model.fit(X, Y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    return model, history.history["loss"]


def test_model_parallel_script_trains_as_one_device():
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], [f"cpu:{i}" for i in range(4)])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*column/kernel"] = (None, "model")
    layout_map[".*column/bias"] = ("model",)
    layout_map[".*row/kernel"] = ("model", None)
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
    model, losses = model_parallel_script()
    strategy = model.distribute_strategy
    assert (strategy.num_replicas_in_sync, strategy.devices_per_replica) == (2, 2)
    assert strategy is kr.keras_distribution.strategy_for(keras.distribution.distribution())
    assert sorted(w.path.split("/", 1)[1] for w in model.weights if "_shard" in w.path) == [
        "column/bias_shard0", "column/bias_shard1", "column/kernel_shard0", "column/kernel_shard1",
        "row/kernel_shard0", "row/kernel_shard1"]
    keras.distribution.set_distribution(None)
    reference, ref_losses = model_parallel_script()
    assert max_difference(model, reference) <= 1e-5
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


V, T, D, HEADS = 32, 6, 16, 4
IDS = np.random.default_rng(2).integers(0, V, (48, T))
NEXT = np.roll(IDS, -1, axis=1)


def transformer_script(epochs=2):
    """A transformer block written for JAX's distribution API: embedding, attention, FFN, output projection."""
    keras.utils.set_random_seed(7)
    ids = keras.Input((T,), dtype="int32")
    x = keras.layers.Embedding(V, D, name="token")(ids)
    a = keras.layers.MultiHeadAttention(HEADS, D // HEADS, name="mha")(x, x, use_causal_mask=True)
    x = keras.layers.LayerNormalization(name="norm")(x + a)
    f = keras.layers.Dense(32, activation="gelu", name="ffn_in")(x)
    x = x + keras.layers.Dense(D, name="ffn_out")(f)
    model = keras.Model(ids, keras.layers.Dense(V, name="logits")(x))
    model.compile(keras.optimizers.AdamW(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(IDS, NEXT, batch_size=8, epochs=epochs, shuffle=False, verbose=0)
    return model, history.history["loss"]


def megatron_layout_map(mesh):
    """Megatron's splits in Keras's vocabulary, as a JAX user writes them."""
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*token/embeddings"] = ("model", None)                     # by vocabulary
    layout_map[".*mha/(query|key|value)/kernel"] = (None, "model", None)   # by heads
    layout_map[".*mha/(query|key|value)/bias"] = ("model", None)
    layout_map[".*mha/attention_output/kernel"] = ("model", None, None)    # row-parallel
    layout_map[".*ffn_in/kernel"] = (None, "model")                        # column-parallel
    layout_map[".*ffn_in/bias"] = ("model",)
    layout_map[".*ffn_out/kernel"] = ("model", None)                       # row-parallel
    layout_map[".*logits/kernel"] = (None, "model")
    return layout_map


@pytest.fixture(scope="module")
def transformer_one_device():
    return transformer_script()


@pytest.mark.parametrize("shape", [(2, 2), (1, 4)], ids=["2x2", "1x4"])
def test_transformer_script_under_model_parallel_trains_as_one_device(shape, transformer_one_device, monkeypatch):
    """The JAX-style transformer script after set_distribution(ModelParallel(layout_map=...)):
    every rule's variable sharded over the model axis, attention computed by heads, weights and
    losses as one device's after 12 AdamW steps."""
    from keras_replicator._compat import keras_layouts

    by_heads, calls = keras_layouts._attention_by_heads, []
    monkeypatch.setattr(keras_layouts, "_attention_by_heads", lambda *a: calls.append(1) or by_heads(*a))
    mesh = keras.distribution.DeviceMesh(shape, ["batch", "model"], [f"cpu:{i}" for i in range(4)])
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=megatron_layout_map(mesh)))
    model, losses = transformer_script()
    keras.distribution.set_distribution(None)
    strategy = model.distribute_strategy
    assert (strategy.num_replicas_in_sync, strategy.devices_per_replica) == shape
    shards = sorted(w.path for w in model.weights if "_shard" in w.path)
    names = ["ffn_in/bias", "ffn_in/kernel", "ffn_out/kernel", "logits/kernel", "mha/attention_output/kernel",
             *(f"mha/{p}/{w}" for p in ("key", "query", "value") for w in ("bias", "kernel")), "token/embeddings"]
    assert shards == sorted(f"{n}_shard{j}" for n in names for j in range(shape[1]))
    assert calls, "MultiHeadAttention was not computed by heads"
    reference, ref_losses = transformer_one_device
    assert max_difference(model, reference) <= 1e-5
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def test_transformer_script_under_data_parallel_trains_as_one_device(transformer_one_device):
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    model, losses = transformer_script()
    keras.distribution.set_distribution(None)
    assert model.distribute_strategy.num_replicas_in_sync == 4
    assert len(replicated_over(model, "ffn_in")) == 4
    reference, ref_losses = transformer_one_device
    assert not replicated_over(reference, "ffn_in")
    assert max_difference(model, reference) <= 1e-5
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def test_set_distribution_inside_another_strategys_scope_is_an_error():
    with kr.ReplicatorStrategy(devices=["/cpu:0", "/cpu:1"]).scope():
        with pytest.raises(ArgumentError, match="inside the scope of"):
            keras.distribution.set_distribution(keras.distribution.DataParallel())
        assert keras.distribution.distribution() is None


SET_BEFORE_IMPORT = """
import tensorflow as tf
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
from keras.distribution import DataParallel, set_distribution   # bound before the patch
set_distribution(DataParallel())
import keras_replicator as kr
from keras_replicator._compat import keras_trainer
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
model.compile("sgd", "mse")
model.fit(tf.ones((8, 3)), tf.ones((8, 1)), batch_size=4, verbose=0)
assert model.distribute_strategy.num_replicas_in_sync == 2, model.distribute_strategy
set_distribution(None)   # the binding made before the import is Keras's own function
assert tf.distribute.has_strategy()
keras.distribution.set_distribution(None)
assert not tf.distribute.has_strategy()
print("followed")
"""


def test_a_distribution_set_before_the_import_is_followed():
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("KR_TEST_DEVICES", None)
    out = subprocess.run([sys.executable, "-c", SET_BEFORE_IMPORT], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0 and "followed" in out.stdout, out.stderr[-3000:]
