"""kr.layers without any strategy: one-device maths, serialization, conversion, errors, docs."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from tests.helpers import python_blocks, run_markdown_example

pytestmark = pytest.mark.devices(1)


def test_matches_keras_batch_norm_on_one_device():
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(8, 4, 4, 3)) * 2 + 1).astype("float32")
    ours = kr.layers.GlobalBatchNormalization(momentum=0.9, epsilon=1e-2)
    theirs = keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-2)
    for _ in range(3):
        np.testing.assert_allclose(ours(x, training=True), theirs(x, training=True), atol=1e-5)
    np.testing.assert_allclose(ours(x, training=False), theirs(x, training=False), atol=1e-5)
    assert kr.testing.max_weight_difference(ours, theirs) <= 1e-6
    # group_size has nothing to group on one replica: plain batch statistics.
    grouped = kr.layers.GlobalBatchNormalization(group_size=2, epsilon=1e-2)
    plain = keras.layers.BatchNormalization(epsilon=1e-2)
    np.testing.assert_allclose(grouped(x, training=True), plain(x, training=True), atol=1e-5)
    # trainable=False means inference mode, as in Keras.
    ours.trainable = False
    before = ours.moving_mean.numpy()
    np.testing.assert_allclose(ours(x, training=True), theirs(x, training=False), atol=1e-5)
    np.testing.assert_array_equal(ours.moving_mean.numpy(), before)


def test_float64_forward_and_gradient_equal_keras_exactly():
    rng = np.random.default_rng(1)
    x = tf.constant(rng.normal(size=(6, 5, 3)) * 3 + 2)
    weights = tf.constant(rng.normal(size=(6, 5, 3)))
    layers = [cls(dtype="float64", gamma_initializer="random_normal", beta_initializer="random_normal")
              for cls in (kr.layers.GlobalBatchNormalization, keras.layers.BatchNormalization)]
    layers[0].build(x.shape)
    layers[1].build(x.shape)
    layers[1].set_weights(layers[0].get_weights())
    results = []
    for layer in layers:
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(y * weights)
        results.append((y, *tape.gradient(loss, [x, *layer.trainable_weights])))
    for ours, theirs in zip(*results):
        np.testing.assert_allclose(ours, theirs, atol=1e-10)


# --- serialization -------------------------------------------------------------------


def test_config_round_trip():
    layer = kr.layers.GlobalBatchNormalization(
        axis=1, momentum=0.9, epsilon=1e-4, center=False, group_size=2, name="gbn",
        gamma_initializer="random_uniform", gamma_regularizer=keras.regularizers.L2(1e-3),
        gamma_constraint=keras.constraints.NonNeg(), moving_variance_initializer="zeros")
    config = layer.get_config()
    assert config["group_size"] == 2 and config["axis"] == 1 and config["center"] is False
    clone = kr.layers.GlobalBatchNormalization.from_config(config)
    assert clone.get_config() == config
    conditional = kr.layers.ConditionalGlobalBatchNormalization(7, momentum=0.5, group_size=4, scale=False)
    config = conditional.get_config()
    assert config["num_classes"] == 7
    assert kr.layers.ConditionalGlobalBatchNormalization.from_config(config).get_config() == config
    # Registered: Keras finds them by name.
    assert keras.saving.get_registered_name(kr.layers.GlobalBatchNormalization) == (
        "keras_replicator>GlobalBatchNormalization")
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
    assert isinstance(restored, kr.layers.GlobalBatchNormalization) and restored.get_config() == layer.get_config()


def test_keras_file_save_and_load(tmp_path):
    keras.utils.set_random_seed(0)
    x, labels = keras.Input((4, 4, 3)), keras.Input((), dtype="int32")
    h = kr.layers.GlobalBatchNormalization(group_size=2)(x)
    h = kr.layers.ConditionalGlobalBatchNormalization(5, axis=-1)([h, labels])
    model = keras.Model([x, labels], keras.layers.Dense(2)(keras.layers.Flatten()(h)))
    model.compile("sgd", "mse")
    rng = np.random.default_rng(2)
    data = [rng.normal(size=(16, 4, 4, 3)).astype("float32") + 1, rng.integers(0, 5, 16)]
    model.fit(data, rng.normal(size=(16, 2)), batch_size=8, verbose=0)
    path = str(tmp_path / "gbn.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert [type(la) for la in loaded.layers] == [type(la) for la in model.layers]
    assert kr.testing.max_weight_difference(loaded, model) == 0.0
    np.testing.assert_allclose(loaded.predict(data, verbose=0), model.predict(data, verbose=0), atol=1e-6)


# --- conversion ----------------------------------------------------------------------


def all_layers(model):
    """Every layer of ``model``, descending into nested models (public API only)."""
    for layer in model.layers:
        yield layer
        if isinstance(layer, keras.Model):
            yield from all_layers(layer)


def randomize_batch_norms(model, seed=0):
    """Non-default gamma, beta and moving statistics, so that carrying them over is checked."""
    rng = np.random.default_rng(seed)
    for layer in all_layers(model):
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.set_weights([rng.uniform(0.5, 1.5, w.shape).astype("float32") for w in layer.weights])


def assert_converted(original, converted, x):
    kinds = [type(la) for la in all_layers(converted)]
    assert keras.layers.BatchNormalization not in kinds
    before = [type(la) for la in all_layers(original)]
    assert kinds.count(kr.layers.GlobalBatchNormalization) == before.count(keras.layers.BatchNormalization) > 0
    assert converted is not original
    expected = original.predict(x, verbose=0)
    np.testing.assert_allclose(converted.predict(x, verbose=0), expected, rtol=1e-5, atol=1e-5)


def test_convert_functional_with_nested_sequential():
    keras.utils.set_random_seed(1)
    block = keras.Sequential([keras.Input((6,)), keras.layers.Dense(6), keras.layers.BatchNormalization(momentum=0.7)])
    inputs = keras.Input((5,))
    h = keras.layers.Dense(6)(inputs)
    h = keras.layers.BatchNormalization(epsilon=1e-2, center=False, name="first_bn")(h)
    h = block(h)
    original = keras.Model(inputs, keras.layers.Dense(2)(h))
    randomize_batch_norms(original)
    weights_before = [w.copy() for w in original.get_weights()]
    converted = kr.layers.convert_to_global_batch_norm(original, group_size=2)
    x = np.random.default_rng(3).normal(size=(4, 5)).astype("float32")
    assert_converted(original, converted, x)
    first = converted.get_layer("first_bn")
    assert isinstance(first, kr.layers.GlobalBatchNormalization)
    assert (first.epsilon, first.center, first.group_size) == (1e-2, False, 2)
    # The original is untouched.
    assert isinstance(original.get_layer("first_bn"), keras.layers.BatchNormalization)
    for before, after in zip(weights_before, original.get_weights()):
        np.testing.assert_array_equal(before, after)
    # Training mode too (batch statistics): the same function.
    np.testing.assert_allclose(converted(x, training=True), original(x, training=True), atol=1e-5)


def test_convert_sequential():
    keras.utils.set_random_seed(2)
    original = keras.Sequential([
        keras.Input((6, 6, 2)), keras.layers.Conv2D(4, 3), keras.layers.BatchNormalization(axis=-1, synchronized=True),
        keras.layers.Flatten(), keras.layers.Dense(3)])
    randomize_batch_norms(original)
    converted = kr.layers.convert_to_global_batch_norm(original)
    assert isinstance(converted, keras.Sequential)
    assert_converted(original, converted, np.random.default_rng(4).normal(size=(3, 6, 6, 2)).astype("float32"))


def test_convert_resnet50():
    original = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
    randomize_batch_norms(original)
    converted = kr.layers.convert_to_global_batch_norm(original)
    assert converted.count_params() == original.count_params()
    x = np.random.default_rng(5).uniform(0, 255, size=(2, 32, 32, 3)).astype("float32")
    assert_converted(original, converted, x)


def test_convert_errors():
    with pytest.raises(TypeError, match="takes a Keras model"):
        kr.layers.convert_to_global_batch_norm(keras.layers.BatchNormalization())

    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.bn = keras.layers.BatchNormalization()

        def call(self, x):
            return self.bn(x)

    model = Subclassed()
    model(np.ones((2, 3), "float32"))
    with pytest.raises(TypeError, match="'Subclassed' is a subclassed model, which Keras cannot clone"):
        kr.layers.convert_to_global_batch_norm(model)
    inputs = keras.Input((3,))
    renorm = keras.Model(inputs, keras.layers.BatchNormalization(renorm=True, name="rn")(inputs))
    with pytest.raises(ValueError, match="Layer 'rn' uses batch renormalization"):
        kr.layers.convert_to_global_batch_norm(renorm)
    with pytest.raises(ValueError, match="group_size must be a positive integer"):
        kr.layers.convert_to_global_batch_norm(keras.Model(inputs, inputs), group_size=0)


# --- argument errors --------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"axis": 1.5}, TypeError, "axis must be an integer, got 1.5"),
        ({"axis": True}, TypeError, "axis must be an integer"),
        ({"momentum": 1.5}, ValueError, r"momentum must be in \[0, 1\], got 1.5"),
        ({"momentum": -0.1}, ValueError, r"momentum must be in \[0, 1\]"),
        ({"momentum": "high"}, TypeError, "momentum must be a finite number"),
        ({"epsilon": 0.0}, ValueError, "epsilon must be a positive number"),
        ({"center": 1}, TypeError, "center must be True or False"),
        ({"scale": None}, TypeError, "scale must be True or False"),
        ({"group_size": 0}, ValueError, "group_size must be a positive integer, got 0"),
        ({"group_size": 2.0}, TypeError, "group_size must be a positive integer, got 2.0"),
        ({"group_size": True}, TypeError, "group_size must be a positive integer, got True"),
    ],
)
def test_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        kr.layers.GlobalBatchNormalization(**kwargs)
    with pytest.raises(error, match=message):
        kr.layers.ConditionalGlobalBatchNormalization(3, **kwargs)


@pytest.mark.parametrize(
    "num_classes, error, message",
    [(0, ValueError, "num_classes must be a positive integer, got 0"),
     (2.5, TypeError, "num_classes must be a positive integer, got 2.5"),
     (None, TypeError, "num_classes must be a positive integer, got None")],
)
def test_bad_num_classes(num_classes, error, message):
    with pytest.raises(error, match=message):
        kr.layers.ConditionalGlobalBatchNormalization(num_classes)


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"axis=3 is out of range for inputs of rank 3"):
        kr.layers.GlobalBatchNormalization(axis=3).build((None, 4, 5))
    with pytest.raises(ValueError, match="axis=0 is the batch axis"):
        kr.layers.GlobalBatchNormalization(axis=-3).build((None, 4, 5))
    with pytest.raises(ValueError, match="must have a known size"):
        kr.layers.GlobalBatchNormalization().build((None, None))
    with pytest.raises(ValueError, match="needs inputs of rank >= 2"):
        kr.layers.GlobalBatchNormalization().build((None,))
    with pytest.raises(ValueError, match="mask must have the shape of the inputs without the features axis"):
        kr.layers.GlobalBatchNormalization()(np.ones((2, 3, 4), "float32"), training=True, mask=np.ones((2, 3, 4), bool))
    conditional = kr.layers.ConditionalGlobalBatchNormalization(3)
    with pytest.raises(ValueError, match=r"called on a pair \[x, class_ids\]"):
        conditional(np.ones((2, 4), "float32"))
    with pytest.raises(ValueError, match=r"class_ids must have shape \(batch,\) or \(batch, 1\), got \(2, 2\)"):
        conditional([np.ones((2, 4), "float32"), np.zeros((2, 2), "int32")])


# --- the guide -------------------------------------------------------------------------


def test_guide_examples_run():
    blocks = python_blocks("docs/batch_norm.md")
    assert len(blocks) == 2
    result = run_markdown_example("docs/batch_norm.md", 0)
    assert "GlobalBatchNormalization replicas identical" in result.stdout
    result = run_markdown_example("docs/batch_norm.md", 1)
    ours, keras_sync = (float(v) for v in result.stdout.split()[-2:])
    assert ours <= 1e-2 and keras_sync > 1.0
