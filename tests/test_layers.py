"""Global batch normalization on 4 simulated replicas, against one-device and float64 references."""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from tests.helpers import image_data

REPLICAS = 4


@pytest.fixture(scope="module")
def strategy():
    strategy = kr.ReplicatorStrategy()
    assert strategy.num_replicas_in_sync == REPLICAS
    return strategy


def per_replica(strategy, slices):
    """A distributed value whose replica ``r`` holds ``slices[r]``."""
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(slices[ctx.replica_id_in_sync_group])
    )


def run_layer(strategy, layer, slices, *, training=True, class_ids=None, masks=None):
    """Calls ``layer`` on every replica's slice in one replicated step; returns the outputs."""
    args = [per_replica(strategy, slices)]
    if class_ids is not None:
        args.append(per_replica(strategy, class_ids))
    if masks is not None:
        args.append(per_replica(strategy, masks))

    @tf.function
    def step(*args):
        def replica_step(x, *rest):
            if class_ids is not None:
                return layer([x, rest[0]], training=training)
            if masks is not None:
                return layer(x, training=training, mask=rest[0])
            return layer(x, training=training)

        return strategy.run(replica_step, args=args)

    return [np.asarray(v) for v in strategy.experimental_local_results(step(*args))]


def bn_reference(x, axis=-1, epsilon=1e-3, gamma=None, beta=None):
    """Training-mode batch norm in float64 numpy: outputs, mean, variance."""
    x = np.asarray(x, np.float64)
    axis = axis % x.ndim
    axes = tuple(a for a in range(x.ndim) if a != axis)
    shape = [1] * x.ndim
    shape[axis] = -1
    mean, var = x.mean(axes), x.var(axes)
    y = (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + epsilon)
    if gamma is not None:
        y = y * np.reshape(gamma, shape)
    if beta is not None:
        y = y + np.reshape(beta, shape)
    return y, mean, var


def build_under(strategy, make):
    with strategy.scope():
        return make()


# --- forward and moving statistics --------------------------------------------------


@pytest.mark.core
@pytest.mark.parametrize("axis", [-1, 1])
def test_forward_matches_keras_batch_norm_on_the_global_batch(strategy, axis):
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(16, 5, 6, 3)) * [1.0, 2.0, 0.5] + [0.5, -1.0, 3.0]).astype("float32")
    if axis == 1:
        x = np.ascontiguousarray(np.moveaxis(x, -1, 1))  # channels first: (16, 3, 5, 6)
    layer = build_under(strategy, lambda: kr.layers.GlobalBatchNormalization(axis=axis, momentum=0.7))
    outputs = np.concatenate(run_layer(strategy, layer, np.split(x, REPLICAS)))

    reference = keras.layers.BatchNormalization(axis=axis, momentum=0.7)
    expected = np.asarray(reference(x, training=True))
    np.testing.assert_allclose(outputs, expected, atol=1e-5)
    _, mean, var = bn_reference(x, axis)
    np.testing.assert_allclose(outputs, bn_reference(x, axis)[0], atol=1e-5)
    for name in ("moving_mean", "moving_variance"):
        ours, theirs = getattr(layer, name), getattr(reference, name)
        assert np.max(np.abs(ours.numpy() - theirs.numpy())) <= 1e-5, name
    np.testing.assert_allclose(layer.moving_mean.numpy(), 0.3 * mean, atol=1e-5)
    np.testing.assert_allclose(layer.moving_variance.numpy(), 0.7 + 0.3 * var, atol=1e-5)
    kr.testing.assert_replicas_identical(layer)  # bit-identical copies

    # Inference uses the moving statistics, on every replica.
    inference = np.concatenate(run_layer(strategy, layer, np.split(x, REPLICAS), training=False))
    np.testing.assert_allclose(inference, np.asarray(reference(x, training=False)), atol=1e-5)


def test_uneven_and_empty_replica_batches_combine_exactly(strategy):
    # Replicas hold 7, 1, 0 and 4 examples: the parallel-variance formula weights by count.
    rng = np.random.default_rng(1)
    x = (rng.normal(size=(12, 4)) * 3 + 2).astype("float32")
    slices = [x[:7], x[7:8], x[8:8], x[8:]]
    layer = build_under(strategy, lambda: kr.layers.GlobalBatchNormalization(momentum=0.0))
    outputs = run_layer(strategy, layer, slices)
    assert [o.shape[0] for o in outputs] == [7, 1, 0, 4]
    expected, mean, var = bn_reference(x)
    np.testing.assert_allclose(np.concatenate(outputs), expected, atol=1e-5)
    np.testing.assert_allclose(layer.moving_mean.numpy(), mean, atol=1e-5)
    np.testing.assert_allclose(layer.moving_variance.numpy(), var, atol=1e-5)
    kr.testing.assert_replicas_identical(layer)


def test_masked_positions_do_not_count(strategy):
    rng = np.random.default_rng(2)
    x = (rng.normal(size=(8, 5, 3)) + 1.0).astype("float32")
    mask = rng.random((8, 5)) > 0.4
    mask[2:4] = False  # replica 1 has nothing unmasked
    x[~mask] = 1e3  # masked values are garbage that must not leak into the statistics
    layer = build_under(strategy, lambda: kr.layers.GlobalBatchNormalization(momentum=0.0))
    outputs = np.concatenate(run_layer(strategy, layer, np.split(x, REPLICAS), masks=np.split(mask, REPLICAS)))
    valid = x[mask].astype(np.float64)  # [n, 3]
    mean, var = valid.mean(0), valid.var(0)
    np.testing.assert_allclose(outputs[mask], (valid - mean) / np.sqrt(var + 1e-3), atol=1e-5)
    np.testing.assert_allclose(layer.moving_mean.numpy(), mean, atol=1e-5)
    np.testing.assert_allclose(layer.moving_variance.numpy(), var, atol=1e-5)


# --- training equivalence ---------------------------------------------------------


def bn_model(norm, seed=1, **kwargs):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(inputs)
    h = norm(momentum=0.8, **kwargs)(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    h = keras.layers.Dense(8)(h)
    h = norm(momentum=0.8, **kwargs)(h)
    return keras.Model(inputs, keras.layers.Dense(4)(h))


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def fit(model, data, epochs=1, strategy=None):
    """Compiles (under ``strategy``'s scope if given) and trains for ``epochs`` on batches of 16."""
    if strategy is None:
        model.compile(keras.optimizers.SGD(0.1, momentum=0.9), LOSS)
    else:
        with strategy.scope():
            model.compile(keras.optimizers.SGD(0.1, momentum=0.9), LOSS)
    model.fit(*data, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    return model


def bn_data():
    x, y = image_data(64)
    return x + 0.5, y


@pytest.fixture(scope="module")
def trained(strategy):
    """A Keras-BN model converted under the strategy and trained on 4 replicas, and its
    one-device Keras-BN reference trained on the same global batches."""
    data = bn_data()
    reference = fit(bn_model(keras.layers.BatchNormalization), data)
    with strategy.scope():
        converted = kr.layers.convert_to_global_batch_norm(bn_model(keras.layers.BatchNormalization))
    fit(converted, data, strategy=strategy)
    return converted, reference, data


@pytest.mark.core
def test_training_matches_one_device_keras_batch_norm(trained):
    model, reference, _ = trained
    assert sum(isinstance(layer, kr.layers.GlobalBatchNormalization) for layer in model.layers) == 2
    assert [w.path.split("/")[-1] for w in model.weights] == [w.path.split("/")[-1] for w in reference.weights]
    assert len(kr.testing.replica_values(model.weights[0])) == REPLICAS  # mirrored
    kr.testing.assert_replicas_identical(model)
    assert kr.testing.max_weight_difference(model, reference) <= 1e-5  # weights and moving statistics
    moving = reference.non_trainable_weights  # moving mean, variance; twice
    assert len(moving) == 4 and all(np.abs(w.numpy() - i % 2).max() > 1e-2 for i, w in enumerate(moving))


@pytest.mark.core
def test_model_trained_on_replicas_saves_and_loads_on_one_device(trained, tmp_path):
    model, reference, (x, _) = trained
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)  # no strategy: one device
    assert [type(la) for la in loaded.layers] == [type(la) for la in model.layers]
    assert kr.testing.max_weight_difference(loaded, model) == 0.0
    replicated = model.predict(x, batch_size=16, verbose=0)  # inference on 4 replicas
    np.testing.assert_allclose(loaded.predict(x, batch_size=16, verbose=0), replicated, atol=1e-6)
    np.testing.assert_allclose(reference.predict(x, batch_size=16, verbose=0), replicated, atol=1e-5)


class GhostBatchNorm(keras.layers.Layer):
    """One-device reference for grouped BN: the batch is normalized in ``groups`` chunks."""

    def __init__(self, groups, momentum, **kwargs):
        super().__init__(**kwargs)
        self.groups, self.momentum = groups, momentum

    def build(self, shape):
        c = (shape[-1],)
        self.gamma = self.add_weight(shape=c, initializer="ones", name="gamma")
        self.beta = self.add_weight(shape=c, initializer="zeros", name="beta")
        self.moving_mean = self.add_weight(shape=c, initializer="zeros", trainable=False, name="moving_mean")
        self.moving_variance = self.add_weight(shape=c, initializer="ones", trainable=False, name="moving_variance")

    def call(self, x, training=False):
        if not training:
            return tf.nn.batch_normalization(x, self.moving_mean, self.moving_variance, self.beta, self.gamma, 1e-3)
        axes = list(range(len(x.shape) - 1))
        outs, means, variances = [], [], []
        for chunk in tf.split(x, self.groups):
            mean, var = tf.nn.moments(chunk, axes)
            outs.append(tf.nn.batch_normalization(chunk, mean, var, self.beta, self.gamma, 1e-3))
            means.append(mean)
            variances.append(var)
        m = self.momentum
        self.moving_mean.assign(self.moving_mean * m + tf.add_n(means) / self.groups * (1 - m))
        self.moving_variance.assign(self.moving_variance * m + tf.add_n(variances) / self.groups * (1 - m))
        return tf.concat(outs, 0)


def test_grouped_forward_equals_separate_groups(strategy):
    rng = np.random.default_rng(3)
    x = (rng.normal(size=(16, 4, 4, 3)) * 2 + 1).astype("float32")
    x[8:] = x[8:] * 3 - 5  # the two groups see different data
    layer = build_under(strategy, lambda: kr.layers.GlobalBatchNormalization(group_size=2, momentum=0.6))
    outputs = run_layer(strategy, layer, np.split(x, REPLICAS))
    groups = [keras.layers.BatchNormalization(momentum=0.6) for _ in range(2)]
    for g, half in enumerate(np.split(x, 2)):  # replicas 0-1 and 2-3
        expected = np.asarray(groups[g](half, training=True))
        np.testing.assert_allclose(np.concatenate(outputs[2 * g : 2 * g + 2]), expected, atol=1e-5)
    # Moving statistics: the average of the two groups', the same on every replica.
    for name in ("moving_mean", "moving_variance"):
        expected = (getattr(groups[0], name).numpy() + getattr(groups[1], name).numpy()) / 2
        np.testing.assert_allclose(getattr(layer, name).numpy(), expected, atol=1e-5)
    kr.testing.assert_replicas_identical(layer)
    # Group statistics really differ from the global ones.
    assert np.abs(np.concatenate(outputs) - bn_reference(x)[0]).max() > 0.5


def test_grouped_training_matches_one_device_ghost_batch_norm(strategy):
    data = bn_data()
    # In every batch of 16, replicas 0-1 (group 0) see inputs 3x smaller than replicas 2-3.
    scale = np.tile(np.repeat([1.0, 3.0], 8), 4).astype("float32")
    data = (data[0] * scale[:, None, None, None], data[1])
    reference = fit(bn_model(GhostBatchNorm, groups=2), data)
    with strategy.scope():
        model = bn_model(kr.layers.GlobalBatchNormalization, group_size=2)
    fit(model, data, strategy=strategy)
    kr.testing.assert_replicas_identical(model)
    assert kr.testing.max_weight_difference(model, reference) <= 1e-5


def test_second_order_gradients_match_one_device(strategy):
    # A gradient penalty (WGAN-GP style) differentiates through the layer's gradient,
    # including its dependence on the batch statistics (through the weight ``v`` upstream).
    rng = np.random.default_rng(9)
    x = (rng.normal(size=(16, 5)) * 2 + 1).astype("float32")
    w = rng.normal(size=(16, 5)).astype("float32")
    v0 = (rng.normal(size=5) + 1.5).astype("float32")

    def penalty_gradients(layer, v, x, w):
        with tf.GradientTape() as outer:
            with tf.GradientTape() as inner:
                inner.watch(x)
                loss = tf.reduce_sum(tf.sin(layer(x * v, training=True)) * w)
            g = inner.gradient(loss, x)
            penalty = tf.reduce_sum(g * g)
        return outer.gradient(penalty, [v, *layer.trainable_weights])

    reference = keras.layers.BatchNormalization(gamma_initializer="random_normal", beta_initializer="random_normal")
    reference.build(x.shape)
    expected = penalty_gradients(reference, tf.Variable(v0), tf.constant(x), tf.constant(w))
    with strategy.scope():
        layer = kr.layers.GlobalBatchNormalization()
        layer.build(x.shape)
        layer.set_weights(reference.get_weights())
        v = tf.Variable(v0)
    step = tf.function(lambda x, w: strategy.run(lambda x, w: penalty_gradients(layer, v, x, w), args=(x, w)))
    out = step(per_replica(strategy, np.split(x, REPLICAS)), per_replica(strategy, np.split(w, REPLICAS)))
    assert len(out) == 3
    for per_replica_grads, want in zip(out, expected):
        summed = sum(np.asarray(v) for v in strategy.experimental_local_results(per_replica_grads))
        np.testing.assert_allclose(summed, want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("rank", [4, 2])
@pytest.mark.parametrize("fused", [True, False], ids=["fused_kernel", "plain_ops"])
def test_gradients_match_one_device_keras_batch_norm(strategy, monkeypatch, fused, rank):
    # The layer picks TensorFlow's fused kernels for large activations and plain ops for
    # small ones: both paths against one-device Keras batch norm on the same global batch.
    monkeypatch.setattr(kr.layers.batch_norm_ops, "_FUSED_MIN_ELEMENTS", 0 if fused else 2**62)
    rng = np.random.default_rng(11)
    shape = (16, 3, 3, 6) if rank == 4 else (16, 6)
    x = (rng.normal(size=shape) * 3 + 5).astype("float32")
    w = rng.normal(size=shape).astype("float32")

    def gradients(layer, x, w):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.sin(layer(x, training=True)) * w)
        return tape.gradient(loss, [x, *layer.trainable_weights])

    reference = keras.layers.BatchNormalization(gamma_initializer="random_normal", beta_initializer="random_normal")
    reference.build(x.shape)
    with strategy.scope():
        layer = kr.layers.GlobalBatchNormalization()
        layer.build(x.shape)
        layer.set_weights(reference.get_weights())
    expected = gradients(reference, tf.constant(x), tf.constant(w))
    step = tf.function(lambda x, w: strategy.run(lambda x, w: gradients(layer, x, w), args=(x, w)))
    dx, dgamma, dbeta = step(per_replica(strategy, np.split(x, REPLICAS)), per_replica(strategy, np.split(w, REPLICAS)))
    local = strategy.experimental_local_results
    np.testing.assert_allclose(np.concatenate(local(dx)), expected[0], atol=2e-5)
    for got, want in ((dgamma, expected[1]), (dbeta, expected[2])):
        np.testing.assert_allclose(sum(np.asarray(v) for v in local(got)), want, atol=2e-5)
    np.testing.assert_allclose(layer.moving_mean.numpy(), reference.moving_mean.numpy(), atol=1e-5)
    np.testing.assert_allclose(layer.moving_variance.numpy(), reference.moving_variance.numpy(), atol=1e-5)


# --- numerics --------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [True, False], ids=["fused_kernel", "plain_ops"])
def test_large_mean_inputs_stay_accurate_where_keras_synchronized_bn_fails(strategy, monkeypatch, fused):
    monkeypatch.setattr(kr.layers.batch_norm_ops, "_FUSED_MIN_ELEMENTS", 0 if fused else 2**62)
    rng = np.random.default_rng(4)
    x = (1e4 + rng.normal(size=(64, 6, 6, 8))).astype("float32")
    expected = bn_reference(x)[0]  # float64, from the same float32 inputs
    ours = build_under(strategy, kr.layers.GlobalBatchNormalization)
    keras_sync = build_under(strategy, lambda: keras.layers.BatchNormalization(synchronized=True))
    ours_error = np.abs(np.concatenate(run_layer(strategy, ours, np.split(x, REPLICAS))) - expected).max()
    keras_error = np.abs(np.concatenate(run_layer(strategy, keras_sync, np.split(x, REPLICAS))) - expected).max()
    print(f"max abs error: GlobalBatchNormalization {ours_error:.2e}, "
          f"BatchNormalization(synchronized=True) {keras_error:.2e}")
    assert ours_error <= 1e-2
    assert keras_error > 1.0 and keras_error > 100 * ours_error


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_statistics_are_float32(strategy, policy):
    half = policy.split("_")[1]
    rng = np.random.default_rng(5)
    x = (300 + rng.normal(size=(32, 8, 8, 2))).astype(half)  # x**2 and sums overflow float16
    exact = np.asarray(tf.cast(x, tf.float64))  # the half-precision inputs, exactly
    layer = build_under(strategy, lambda: kr.layers.GlobalBatchNormalization(momentum=0.0, dtype=policy))
    outputs = run_layer(strategy, layer, np.split(x, REPLICAS))
    assert str(outputs[0].dtype) == half
    assert layer.moving_mean.dtype == "float32" and layer.moving_variance.dtype == "float32"
    expected, mean, var = bn_reference(exact)
    # float32 statistics resolve the mean to 1e-4; a half-precision mean near 300 moves in steps of 0.25 (2 for bfloat16).
    np.testing.assert_allclose(layer.moving_mean.numpy(), mean, atol=1e-4)
    np.testing.assert_allclose(layer.moving_variance.numpy(), var, rtol=1e-4)
    tolerance = 1e-2 if half == "float16" else 5e-2  # output rounding to the half type
    np.testing.assert_allclose(np.concatenate(outputs).astype(np.float64), expected, atol=tolerance)


# --- class-conditional ---------------------------------------------------------------


def test_conditional_uses_global_statistics_and_per_class_affine(strategy):
    rng = np.random.default_rng(6)
    x = (rng.normal(size=(12, 3, 3, 4)) * 2 - 1).astype("float32")
    ids = rng.integers(0, 5, size=12).astype("int32")
    gamma = rng.normal(size=(5, 4)).astype("float32")
    beta = rng.normal(size=(5, 4)).astype("float32")
    layer = build_under(strategy, lambda: kr.layers.ConditionalGlobalBatchNormalization(5, momentum=0.0))
    with strategy.scope():
        layer.build([(None, 3, 3, 4), (None,)])
        layer.set_weights([gamma, beta, np.zeros(4, "float32"), np.ones(4, "float32")])
    outputs = np.concatenate(
        run_layer(strategy, layer, np.split(x, REPLICAS), class_ids=np.split(ids, REPLICAS)))
    normalized, mean, var = bn_reference(x)
    expected = normalized * gamma[ids][:, None, None, :] + beta[ids][:, None, None, :]
    np.testing.assert_allclose(outputs, expected, atol=1e-5)
    np.testing.assert_allclose(layer.moving_mean.numpy(), mean, atol=1e-5)
    np.testing.assert_allclose(layer.moving_variance.numpy(), var, atol=1e-5)
    kr.testing.assert_replicas_identical(layer)
    # Inference: moving statistics, same per-class affine; ids of shape (batch, 1) work too.
    inference = np.concatenate(run_layer(strategy, layer, np.split(x, REPLICAS), training=False,
                                         class_ids=np.split(ids[:, None], REPLICAS)))
    expected = (x - mean) / np.sqrt(var + 1e-3) * gamma[ids][:, None, None, :] + beta[ids][:, None, None, :]
    np.testing.assert_allclose(inference, expected, atol=1e-5)


def conditional_model(seed=1):
    keras.utils.set_random_seed(seed)
    z, labels = keras.Input((6,)), keras.Input((), dtype="int32")
    h = keras.layers.Dense(8)(z)
    h = kr.layers.ConditionalGlobalBatchNormalization(3, momentum=0.8)([h, labels])
    return keras.Model([z, labels], keras.layers.Dense(1)(keras.layers.ReLU()(h)))


def test_conditional_training_matches_one_device(strategy):
    rng = np.random.default_rng(7)
    z = rng.normal(size=(64, 6)).astype("float32")
    labels = rng.integers(0, 3, size=64).astype("int32")
    y = (z[:, :1] * (labels[:, None] - 1)).astype("float32")
    models = []
    for scope in (None, strategy):
        with scope.scope() if scope else contextlib.nullcontext():
            model = conditional_model()
            model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse")
        model.fit([z, labels], y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        models.append(model)
    kr.testing.assert_replicas_identical(models[1])
    assert kr.testing.max_weight_difference(models[1], models[0]) <= 1e-5
    layer = next(la for la in models[1].layers if isinstance(la, kr.layers.ConditionalGlobalBatchNormalization))
    gamma = layer.gamma.numpy()
    assert np.abs(gamma - 1).max() > 1e-3  # the per-class tables trained


# --- plain Keras BatchNormalization under ReplicatorStrategy (moving statistics kept identical) -------------


def replica_dependent_data():
    """Each replica's slice of every batch of 16 is shifted by 10 * replica."""
    rng = np.random.default_rng(8)
    x = rng.normal(size=(64, 3)).astype("float32")
    x += np.tile(np.repeat(10.0 * np.arange(REPLICAS), 16 // REPLICAS), 4)[:, None].astype("float32")
    return x, rng.normal(size=(64, 1)).astype("float32")


@pytest.mark.parametrize("steps_per_execution", [1, 2])
def test_plain_keras_batch_norm_moving_statistics_stay_identical(strategy, steps_per_execution):
    x, y = replica_dependent_data()
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization(momentum=0.5), keras.layers.Dense(1)])
        model.compile("sgd", "mse", steps_per_execution=steps_per_execution)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    bn = model.layers[0]
    kr.testing.assert_replicas_identical(model)
    # Training used local statistics; the moving averages follow their replica average.
    mean, var = np.zeros(3), np.ones(3)
    for batch in np.split(x.astype(np.float64), 4):
        local = batch.reshape(REPLICAS, -1, 3)
        mean = 0.5 * mean + 0.5 * local.mean(1).mean(0)
        var = 0.5 * var + 0.5 * local.var(1).mean(0)
    np.testing.assert_allclose(bn.moving_mean.numpy(), mean, atol=1e-5)
    np.testing.assert_allclose(bn.moving_variance.numpy(), var, atol=1e-5)


def test_plain_batch_norm_guard_scope(strategy):
    with strategy.scope():
        renorm = keras.layers.BatchNormalization(renorm=True)
        renorm.build((None, 3))
        synced = keras.layers.BatchNormalization(synchronized=True)
        synced.build((None, 3))
    outside = keras.layers.BatchNormalization()
    outside.build((None, 3))

    def aggregations(layer):
        return {w.path.split("/")[-1]: w.aggregation for w in layer.weights}

    assert all(a == "mean" for n, a in aggregations(renorm).items() if n not in ("gamma", "beta"))
    assert set(aggregations(synced).values()) == {"none"}  # already all-reduced statistics
    assert set(aggregations(outside).values()) == {"none"}
    # renorm statistics stay identical too.
    x, _ = replica_dependent_data()
    run_layer(strategy, renorm, np.split(x[:16], REPLICAS))
    kr.testing.assert_replicas_identical(renorm)


def test_convert_outside_the_scope_uses_the_models_strategy(strategy):
    with strategy.scope():
        original = keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization(), keras.layers.Dense(2)])
    converted = kr.layers.convert_to_global_batch_norm(original)  # no scope entered here
    assert isinstance(converted.layers[0], kr.layers.GlobalBatchNormalization)
    for weight in converted.weights:
        assert len(kr.testing.replica_values(weight)) == REPLICAS, weight.path
    kr.testing.assert_replicas_identical(converted)


# --- errors ---------------------------------------------------------------------------


def test_group_size_must_divide_the_replicas(strategy):
    with strategy.scope():
        with pytest.raises(ValueError, match=r"group_size=3 does not divide the number of replicas \(4\)"):
            kr.layers.GlobalBatchNormalization(group_size=3)
    layer = kr.layers.GlobalBatchNormalization(group_size=3)  # no strategy yet: checked at call time
    with strategy.scope():
        layer.build((None, 2))
    with pytest.raises(ValueError, match="group_size=3 does not divide"):
        run_layer(strategy, layer, np.split(np.ones((8, 2), "float32"), REPLICAS))

