"""XLA (`jit_compile=True`) under ReplicatorStrategy: N replicas == one device, every combination.

Each replica's forward, loss and gradients are compiled with XLA on its own device;
all-reduces and the optimizer's cross-replica apply run outside XLA.
"""

import contextlib
import io
import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from keras_replicator.applications import d4pg, sngan
from tests.helpers import ROOT, conv_model, image_data, launch_env

X, Y = image_data(n=32, size=8, classes=4)
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _fit(strategy, *, epochs=2, optimizer=None, model_fn=conv_model, jit=True, **compile_kw):
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = model_fn()
        model.compile(optimizer=optimizer() if optimizer else keras.optimizers.SGD(0.1),
                      loss=LOSS, jit_compile=jit, **compile_kw)
    history = model.fit(X, Y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    return model, history.history["loss"]


def _max_diff(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a.get_weights(), b.get_weights()))


def _decreasing(losses):
    assert all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0], losses


class _NotCompilable(keras.layers.Layer):
    """An op XLA cannot compile: a step that contains it fails only if XLA compiles it."""

    def call(self, x):
        return x + tf.reshape(tf.numpy_function(lambda: np.float32(0.0), [], tf.float32), [])


def _not_compilable_model():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.GlobalAveragePooling2D()(_NotCompilable()(inputs))
    return keras.Model(inputs, keras.layers.Dense(4)(h))


@pytest.fixture(scope="module")
def one_device():
    return _fit(None)


@pytest.mark.core
def test_n_replicas_with_xla_equal_one_device_with_xla(one_device):
    model, losses = _fit(kr.ReplicatorStrategy())
    assert model.distribute_strategy.num_replicas_in_sync == 4 and model.jit_compile
    assert _max_diff(model, one_device[0]) <= 1e-5
    np.testing.assert_allclose(losses, one_device[1], atol=1e-5)
    kr.testing.assert_replicas_identical(model)
    # evaluate and predict run compiled too, and agree with one device.
    np.testing.assert_allclose(model.predict(X, verbose=0), one_device[0].predict(X, verbose=0),
                               atol=1e-5)
    np.testing.assert_allclose(model.evaluate(X, Y, verbose=0),
                               one_device[0].evaluate(X, Y, verbose=0), atol=1e-5)


def test_the_replica_step_is_compiled_with_xla():
    # The same model trains without jit_compile; with it, XLA refuses the op: proof the
    # per-replica step goes through XLA.
    _fit(kr.ReplicatorStrategy(), epochs=1, model_fn=_not_compilable_model, jit=False)
    with pytest.raises(tf.errors.OpError) as raised:
        _fit(kr.ReplicatorStrategy(), epochs=1, model_fn=_not_compilable_model)
    message = str(raised.value)
    if re.search("(?i)xla|compil", message):
        return
    # TensorFlow may raise another replica's cancellation instead (about 1 run in 8): the
    # error then says so, and its advice raises XLA's own error.
    assert isinstance(raised.value, tf.errors.CancelledError), message
    assert "the error itself is in TensorFlow's log above" in message and "trace_once=False" in message
    with pytest.raises(tf.errors.OpError, match="(?i)xla|compil"):
        _fit(kr.ReplicatorStrategy(trace_once=False), epochs=1, model_fn=_not_compilable_model)


def test_a_cancellation_raised_for_a_failed_replica_says_where_the_error_is():
    from keras_replicator._compat import keras_trainer

    cancelled = tf.errors.CancelledError(
        None, None, "Graph execution error:\n\nFunction was cancelled before it was started")
    clear = keras_trainer._cancelled_replica_error(kr.ReplicatorStrategy(), cancelled)
    assert isinstance(clear, tf.errors.CancelledError)
    assert "the error itself is in TensorFlow's log above" in str(clear) and "trace_once=False" in str(clear)
    assert "Function was cancelled before it was started" in str(clear)
    # Traced per replica, or another cancellation: TensorFlow's error as it is.
    assert keras_trainer._cancelled_replica_error(kr.ReplicatorStrategy(trace_once=False), cancelled) is None
    other = tf.errors.CancelledError(None, None, "the user stopped it")
    assert keras_trainer._cancelled_replica_error(kr.ReplicatorStrategy(), other) is None


def test_stock_mirrored_strategy_with_xla_still_fails():
    with pytest.raises(tf.errors.OpError, match="located in device"):
        _fit(tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(4)]), epochs=1)


def test_steps_per_execution_and_cross_replica_optimizer(one_device):
    def wrapped():
        return kr.optimizers.CrossReplicaOptimizer(keras.optimizers.SGD(0.1))

    model, _ = _fit(kr.ReplicatorStrategy(), optimizer=wrapped, steps_per_execution=2)
    assert _max_diff(model, one_device[0]) <= 1e-5
    kr.testing.assert_replicas_identical(model)


def test_mixed_float16_with_loss_scale_optimizer():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        def scaled():
            return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))

        one, one_losses = _fit(None, epochs=3, optimizer=scaled)
        model, losses = _fit(kr.ReplicatorStrategy(), epochs=3, optimizer=scaled)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    _decreasing(losses)
    kr.testing.assert_replicas_identical(model)
    # float16 compute: the replicas' partial sums round differently from one device's sum.
    assert _max_diff(model, one) <= 2e-3
    np.testing.assert_allclose(losses, one_losses, atol=2e-3)


def _global_bn_model():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(8, 3, padding="same")(inputs)
    h = kr.layers.GlobalBatchNormalization()(h)
    h = keras.layers.Conv2D(8, 3, strides=2, padding="same", activation="relu")(h)
    h = keras.layers.BatchNormalization()(h)  # plain: local statistics, averaged moving ones
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, keras.layers.Dense(4)(h))


@pytest.mark.core
def test_global_batch_norm_equals_one_device_and_plain_batch_norm_trains():
    # One device: GlobalBatchNormalization is plain batch norm over the global batch, so the
    # replicated model equals it up to the plain BatchNormalization (local statistics).
    model, losses = _fit(kr.ReplicatorStrategy(), epochs=3, model_fn=_global_bn_model)
    _decreasing(losses)
    kr.testing.assert_replicas_identical(model)
    moving = [w for w in model.weights if "moving" in w.path]
    assert moving and all(np.any(kr.testing.replica_values(w)[0] != w.numpy() * 0 + (
        1.0 if "variance" in w.path else 0.0)) for w in moving)


# --- the applications' steps ----------------------------------------------------------------

TINY = sngan.SNGANConfig(image_size=16, ch=8, z_dim=8, g_first=2, g_multipliers=(2, 1),
                         d_multipliers=(1, 2), d_downsample=(True, False), channels=1)


def _sngan(strategy, jit):
    rng = np.random.default_rng(0)
    data = (np.tanh(rng.standard_normal((32, 16, 16, 1))).astype("float32"),
            rng.integers(0, 10, 32).astype("int32"))
    with strategy.scope() if strategy else contextlib.nullcontext():
        keras.utils.set_random_seed(0)
        gan = sngan.SNGAN(sngan.generator(TINY, 10), sngan.discriminator(TINY, 10),
                          num_classes=10, n_dis=2, ema_decay=0.9, seed=3)
        gan.compile(d_optimizer=sngan.default_optimizer(1e-3),
                    g_optimizer=sngan.default_optimizer(1e-3), jit_compile=jit)
    gan.fit(sngan.digits_dataset(8, 2, data=data, shuffle=False), steps_per_epoch=2, verbose=0)
    return gan


def test_sngan_step_with_xla_equals_one_device():
    # One device under the strategy: the same per-replica compilation (Keras alone compiles the
    # whole step, optimizers included, as one XLA cluster: minutes of compile time here).
    one = _sngan(kr.ReplicatorStrategy(["/cpu:0"]), jit=True)
    gan = _sngan(kr.ReplicatorStrategy([f"/cpu:{i}" for i in range(2)]), jit=True)
    kr.testing.assert_replicas_identical(gan)
    assert kr.testing.max_weight_difference(gan.generator, one.generator) <= 1e-5
    assert kr.testing.max_weight_difference(gan.discriminator, one.discriminator) <= 1e-5


def _d4pg(strategy, jit):
    rng = np.random.default_rng(0)
    n = 3 * 16
    data = {"observation": rng.normal(size=(n, 3)).astype("f4"),
            "action": rng.uniform(-2, 2, size=(n, 1)).astype("f4"),
            "reward": rng.normal(size=(n,)).astype("f4"),
            "discount": np.full((n,), 0.99, "f4"),
            "next_observation": rng.normal(size=(n, 3)).astype("f4")}
    with strategy.scope():
        keras.utils.set_random_seed(3)
        learner = d4pg.D4PGLearner.create(3, [-2.0], [2.0], policy_layers=(16, 16),
                                          critic_layers=(16, 16), target_update_period=2)
        learner.compile(learning_rate=1e-3, clip_global_norm=1.0, jit_compile=jit)
    dataset = strategy.distribute_dataset(tf.data.Dataset.from_tensor_slices(data),
                                          global_batch_size=16)
    learner.fit(dataset, epochs=1, steps_per_epoch=3, verbose=0)
    return learner


def test_d4pg_learner_step_with_xla_equals_one_device():
    one = _d4pg(kr.ReplicatorStrategy(["/cpu:0"]), jit=True)
    learner = _d4pg(kr.ReplicatorStrategy(), jit=True)
    assert int(learner.updates.numpy()) == 3
    kr.testing.assert_replicas_identical(learner)
    for name in ("policy", "critic", "target_policy", "target_critic"):
        assert kr.testing.max_weight_difference(getattr(learner, name), getattr(one, name)) <= 1e-5


# --- multi-worker -----------------------------------------------------------------------------


def test_two_workers_with_xla_equal_one_device(one_device, tmp_path):
    from keras_replicator import launch as launcher
    from tests import xla_job

    assert (xla_job.EXAMPLES, xla_job.BATCH, xla_job.EPOCHS) == (len(X), 16, 2)
    env = launch_env()
    out = io.StringIO()
    code = launcher.launch(os.path.join(ROOT, "tests", "xla_job.py"), [str(tmp_path)], workers=2,
                           devices_per_worker=1, env=env, timeout=400, output=out)
    assert code == 0, out.getvalue()[-3000:]
    reference = one_device[0].get_weights()
    for i in range(2):
        with np.load(tmp_path / f"worker{i}.npz") as arrays:
            assert int(arrays["replicas"]) == 2 and bool(arrays["jit"])
            np.testing.assert_allclose(arrays["loss"], one_device[1], atol=1e-5)
            for j, w in enumerate(reference):
                np.testing.assert_allclose(arrays[f"w{j}"], w, atol=1e-5)


# --- the custom-loop primitives ----------------------------------------------------------------


def test_replica_jit_in_a_custom_loop_and_collectives_refused_inside_it():
    strategy = kr.ReplicatorStrategy()
    doubled = kr.replica_jit(lambda x: 2.0 * x)
    summed_inside = kr.replica_jit(lambda x: kr.all_reduce(2.0 * x))

    def step(fn):
        def replica_step():
            x = tf.cast(kr.replica_id(), tf.float32) + tf.ones([3])
            return kr.all_reduce(fn(x))  # the all-reduce outside the compiled function
        run = tf.function(lambda: strategy.experimental_local_results(strategy.run(replica_step)))
        return run()[0]

    np.testing.assert_allclose(step(doubled).numpy(), [20.0] * 3)  # 2 * (1 + 2 + 3 + 4)
    with pytest.raises(RuntimeError, match="kr.all_reduce inside an XLA-compiled replica"):
        step(summed_inside)
    with pytest.raises(kr.errors.ArgumentError, match="callable"):
        kr.replica_jit(3)


def test_auto_does_what_keras_does_for_one_device(monkeypatch):
    def compiled(strategy, model_fn=conv_model):
        with strategy.scope() if strategy else contextlib.nullcontext():
            model = model_fn()
            model.compile(optimizer="sgd", loss=LOSS)  # jit_compile="auto"
        return model.jit_compile

    # This machine has CPUs only: Keras leaves XLA off on one device, and so do we.
    assert compiled(None) is False and compiled(kr.ReplicatorStrategy()) is False
    # With a GPU, Keras turns XLA on for one device (and off under any tf.distribute
    # strategy, stock included); ours turns it on as for one device.
    physical = tf.config.list_physical_devices()
    monkeypatch.setattr(tf.config, "list_physical_devices",
                        lambda *a: physical + [tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")])
    assert compiled(None) is True
    assert compiled(kr.ReplicatorStrategy()) is True
    assert compiled(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])) is False
