"""CrossReplicaOptimizer: accumulation, compression, clipping, skipping, loss scaling, saving.

Every replicated run is compared with a single-device reference (4 simulated
devices in this process; strategies over the first 2 or all 4).
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from tests.helpers import dense_model, regression_data, run_markdown_example


def strategy_for(replicas):
    return kr.ReplicatorStrategy([f"/cpu:{i}" for i in range(replicas)])


def sgd():
    return keras.optimizers.SGD(0.05, momentum=0.9)


def fit(model, x, y, batch_size, epochs=2, **kwargs):
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **kwargs)
    return model


def build(strategy, make_optimizer, steps_per_execution=1):
    """A dense model compiled under ``strategy`` with ``make_optimizer()`` (made in scope)."""
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = dense_model()
        model.compile(make_optimizer(), "mse", steps_per_execution=steps_per_execution)
    return model


def wrapped(make_inner=sgd, **options):
    """A factory of ``CrossReplicaOptimizer(make_inner(), **options)``, called under the scope."""
    return lambda: kr.CrossReplicaOptimizer(make_inner(), **options)


def reference(x, y, batch_size=16, make_optimizer=sgd, epochs=2):
    return fit(build(None, make_optimizer), x, y, batch_size, epochs)


def value(v):
    return kr.testing.replica_values(v)[0]


# --- accumulation ------------------------------------------------------------------


def scheduled_sgd():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=1, decay_rate=0.9)
    return keras.optimizers.SGD(schedule, momentum=0.9)


@pytest.mark.parametrize(
    "replicas,k,steps_per_execution", [(2, 4, 3), (4, 2, 1)], ids=["2rep-k4-spe3", "4rep-k2"]
)
def test_k_micro_batches_equal_one_big_batch(replicas, k, steps_per_execution):
    # The learning rate decays every update: the schedule must follow updates, not batches.
    x, y = regression_data(64)
    ref = reference(x, y, batch_size=16, make_optimizer=scheduled_sgd)
    make = wrapped(scheduled_sgd, accumulation_steps=k)
    model = fit(build(strategy_for(replicas), make, steps_per_execution), x, y, batch_size=16 // k)
    opt = model.optimizer
    kr.testing.assert_replicas_identical(model)
    kr.testing.assert_replicas_identical(opt.inner_optimizer)
    assert kr.testing.max_weight_difference(model, ref) <= 1e-5
    # Iterations and the schedule count updates; micro-steps count batches.
    assert int(value(opt.iterations)) == int(value(ref.optimizer.iterations)) == 8
    assert int(value(opt.micro_steps)) == 8 * k
    assert float(keras.ops.convert_to_numpy(opt.learning_rate)) == pytest.approx(0.05 * 0.9**8)


def test_without_accumulation_small_batches_are_not_one_big_batch():
    # The accumulation test can fail: plain SGD at batch B/k differs from batch B.
    x, y = regression_data(64)
    assert kr.testing.max_weight_difference(reference(x, y, 8), reference(x, y, 16)) > 1e-3


def test_custom_training_loop_and_no_strategy():
    # Outside Keras's fit: a strategy.run loop (GAN/RL style) and plain eager code.
    x, y = regression_data(64)
    ref = reference(x, y, batch_size=16, epochs=1)

    def train(model, optimizer, step):
        for i in range(8):
            step(model, optimizer, x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8])
        return model

    def eager_step(model, optimizer, xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(xb) - yb) ** 2)
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

    alone = train(dense_model(), wrapped(accumulation_steps=2)(), eager_step)
    assert kr.testing.max_weight_difference(alone, ref) <= 1e-5

    strategy = strategy_for(2)
    with strategy.scope():
        model, optimizer = dense_model(), wrapped(accumulation_steps=2, skip_nonfinite=True)()

    @tf.function
    def replicated_step(xb, yb):
        def replica_step(xb, yb):
            with tf.GradientTape() as tape:  # this replica's share of the mean loss
                loss = tf.reduce_sum((model(xb) - yb) ** 2) / 8.0
            optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

        strategy.run(replica_step, args=(xb, yb))

    batches = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(8))
    for xb, yb in batches:
        replicated_step(xb, yb)
    kr.testing.assert_replicas_identical(model)
    assert int(value(optimizer.iterations)) == 4
    assert kr.testing.max_weight_difference(model, ref) <= 1e-5


# --- compression --------------------------------------------------------------------


def classification_data(n=1024, d=16, classes=4, seed=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype("float32")
    y = np.argmax(x @ rng.normal(size=(d, classes)), axis=1).astype("int32")
    return x, y


def classifier():
    keras.utils.set_random_seed(2)
    return keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(4)]
    )


def accuracy(model, x, y):
    """Accuracy of ``model``'s weights on one device (an eager call: nothing to trace)."""
    plain = classifier()
    plain.set_weights(model.get_weights())
    return float(np.mean(np.argmax(keras.ops.convert_to_numpy(plain(x)), axis=1) == y))


def test_compression_trains_to_the_same_accuracy():
    x, y = classification_data(1536)
    x, y, x_test, y_test = x[:1024], y[:1024], x[1024:], y[1024:]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    strategy = strategy_for(4)
    results, models = {}, {}
    for compression in (None, "float16", "bfloat16"):
        with strategy.scope():
            opt = kr.CrossReplicaOptimizer(keras.optimizers.Adam(1e-2), compression=compression)
            model = classifier()
            model.compile(opt, loss)
        fit(model, x, y, batch_size=64, epochs=2)
        kr.testing.assert_replicas_identical(model)
        results[compression] = accuracy(model, x_test, y_test)
        models[compression] = model
    assert results[None] > 0.85, results  # the task is learnt
    for compression in ("float16", "bfloat16"):
        assert abs(results[compression] - results[None]) <= 0.01, results
        # The gradients really travelled in 16 bits: the weights are not bit-identical.
        assert kr.testing.max_weight_difference(models[compression], models[None]) > 0


# --- clipping -----------------------------------------------------------------------


@pytest.mark.parametrize("replicas", [2, 4])
def test_clipping_uses_the_global_gradient_norm(replicas):
    x, y = regression_data(64)
    y = 10 * y  # large gradients: the clip is active at every step
    ref = reference(x, y, make_optimizer=lambda: keras.optimizers.SGD(0.05, momentum=0.9, global_clipnorm=0.5))
    unclipped = reference(x, y)
    assert kr.testing.max_weight_difference(ref, unclipped) > 1e-2  # clipping mattered
    make = wrapped(clip_global_norm=0.5)
    model = fit(build(strategy_for(replicas), make), x, y, batch_size=16)
    kr.testing.assert_replicas_identical(model)
    assert kr.testing.max_weight_difference(model, ref) <= 1e-5


# --- non-finite steps -----------------------------------------------------------------


@pytest.mark.parametrize("replicas,k", [(2, 1), (4, 2)], ids=["2rep", "4rep-k2"])
def test_planted_nan_step_is_skipped_on_every_replica(replicas, k):
    x, y = regression_data(64)
    micro = 16 // k
    # One NaN input in the third micro-batch, on one replica's slice only.
    bad_row = 2 * micro + micro // replicas + 1
    x_nan = x.copy()
    x_nan[bad_row, 3] = np.nan
    # Skipping the update is training without the micro-batches it was made of.
    update = bad_row // 16
    keep = np.r_[0 : update * 16, (update + 1) * 16 : 64]
    ref = fit(build(None, sgd), x[keep], y[keep], batch_size=16, epochs=1)
    make = wrapped(accumulation_steps=k, skip_nonfinite=True)
    model = fit(build(strategy_for(replicas), make), x_nan, y, batch_size=micro, epochs=1)
    opt = model.optimizer
    kr.testing.assert_replicas_identical(model)
    kr.testing.assert_replicas_identical(opt.inner_optimizer)
    assert int(value(opt.skipped_steps)) == 1
    assert int(value(opt.iterations)) == 3  # 4 updates, one skipped
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert kr.testing.max_weight_difference(model, ref) <= 1e-5


# --- mixed precision --------------------------------------------------------------------


def test_wrapping_a_loss_scale_optimizer_matches_one_device_and_skips_overflow():
    x, y = regression_data(64)
    y = 10 * y  # large gradients: the clip is active
    x_nan = x.copy()
    x_nan[37, 0] = np.inf  # a non-finite gradient in the third step

    def clipped_sgd():
        return keras.optimizers.SGD(0.05, momentum=0.9, global_clipnorm=0.5)

    # On one device, Keras clips the unscaled gradient inside the loss scale optimizer.
    ref = fit(build(None, lambda: keras.optimizers.LossScaleOptimizer(clipped_sgd(), initial_scale=2.0**10)),
              x_nan, y, batch_size=16, epochs=1)
    ref_opt = ref.optimizer
    make = wrapped(
        lambda: keras.optimizers.LossScaleOptimizer(sgd(), initial_scale=2.0**10),
        clip_global_norm=0.5,  # of the unscaled gradient, not of the scaled one we see
        skip_nonfinite=True,
    )
    model = fit(build(strategy_for(4), make), x_nan, y, batch_size=16, epochs=1)
    opt = model.optimizer
    kr.testing.assert_replicas_identical(model)
    lso = opt.inner_optimizer
    assert float(value(lso.dynamic_scale)) == float(value(ref_opt.dynamic_scale)) == 2.0**9
    assert int(value(opt.skipped_steps)) == 1
    assert int(value(opt.iterations)) == int(value(ref_opt.iterations)) == 3
    assert kr.testing.max_weight_difference(model, ref) <= 1e-5


def test_loss_scale_optimizer_outside_is_refused_with_a_clear_error():
    # Refused when the LossScaleOptimizer is made, before any model or step.
    with pytest.raises(ValueError, match=r"CrossReplicaOptimizer\(keras.optimizers.LossScaleOptimizer"):
        build(strategy_for(2), lambda: keras.optimizers.LossScaleOptimizer(kr.CrossReplicaOptimizer(sgd())))
    # Keras adds the outer one itself under "mixed_float16" unless told not to.
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with strategy_for(2).scope(), pytest.raises(ValueError, match="auto_scale_loss=False"):
            model = dense_model()
            model.compile(kr.CrossReplicaOptimizer(sgd()), "mse")
    finally:
        keras.mixed_precision.set_global_policy("float32")


# --- saving -------------------------------------------------------------------------------


def adam():
    return keras.optimizers.Adam(0.01)


def trained_half_way(strategy):
    """A model whose optimizer is in the middle of an accumulation (3 of 4 micro-batches)."""
    x, y = regression_data(64)
    model = build(strategy, wrapped(adam, accumulation_steps=4))
    fit(model, x[:48], y[:48], batch_size=8, epochs=1)  # 6 micro-batches: 1 update + 2
    return model, x, y


def accumulated_sums(opt):
    return [np.sum(kr.testing.replica_values(a), axis=0) for a in opt.accumulators]


def assert_same_state(a, b):
    assert kr.testing.max_weight_difference(a, b) == 0
    va, vb = a.optimizer.variables, b.optimizer.variables
    assert len(va) == len(vb)
    for x, y in zip(va, vb):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(x), keras.ops.convert_to_numpy(y))


def test_saves_and_restores_with_the_model(tmp_path):
    strategy = strategy_for(4)
    model, x, y = trained_half_way(strategy)
    sums = accumulated_sums(model.optimizer)
    assert max(np.abs(s).max() for s in sums) > 0  # there is a half-done accumulation to save

    path = str(tmp_path / "model.keras")
    model.save(path)
    with strategy.scope():
        loaded = keras.saving.load_model(path)
    assert isinstance(loaded.optimizer, kr.CrossReplicaOptimizer)
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    assert_same_state(loaded, model)
    for s, t in zip(sums, accumulated_sums(loaded.optimizer)):
        np.testing.assert_allclose(s, t, rtol=1e-6, atol=1e-7)

    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    saved = checkpoint.save(str(tmp_path / "ckpt"))
    restored = build(strategy, wrapped(adam, accumulation_steps=4))
    with strategy.scope():
        restored.optimizer.build(restored.trainable_variables)
    tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).restore(saved).assert_consumed()
    assert_same_state(restored, model)

    # The loaded model continues identically, the pending accumulation included.
    for m in (model, loaded):
        fit(m, x[:16], y[:16], batch_size=8, epochs=1)
        kr.testing.assert_replicas_identical(m)
    assert int(value(model.optimizer.iterations)) == 2
    assert kr.testing.max_weight_difference(loaded, model) <= 1e-6


def test_config_round_trip_and_wrap_optimizer():
    opt = kr.wrap_optimizer(
        keras.optimizers.Adam(0.002), accumulation_steps=3, compression="bfloat16",
        clip_global_norm=2.0, skip_nonfinite=True, name="wrapped",
    )
    assert isinstance(opt, kr.CrossReplicaOptimizer)
    config = opt.get_config()
    assert config["accumulation_steps"] == 3 and config["compression"] == "bfloat16"
    same = kr.CrossReplicaOptimizer.from_config(config)
    assert same.get_config() == config
    assert float(keras.ops.convert_to_numpy(same.learning_rate)) == pytest.approx(0.002)
    again = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(again) is kr.CrossReplicaOptimizer and again.get_config() == config
    # The learning rate is the wrapped optimizer's, settable through the wrapper.
    opt.learning_rate = 0.5
    assert float(keras.ops.convert_to_numpy(opt.inner_optimizer.learning_rate)) == 0.5


# --- bad input --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({"accumulation_steps": 0}, ValueError, "accumulation_steps must be a positive integer, got 0"),
        ({"accumulation_steps": 2.0}, ValueError, "accumulation_steps must be a positive integer"),
        ({"compression": "int8"}, ValueError, "compression must be one of None, 'float16', 'bfloat16'; got 'int8'"),
        ({"clip_global_norm": 0}, ValueError, "clip_global_norm must be a positive number"),
        ({"clip_global_norm": float("inf")}, ValueError, "clip_global_norm must be a positive"),
        ({"skip_nonfinite": 1}, TypeError, "skip_nonfinite must be True or False"),
        ({"learning_rate": 0.1}, ValueError, r"does not take \['learning_rate'\]"),
    ],
)
def test_bad_arguments_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        kr.CrossReplicaOptimizer(keras.optimizers.SGD(), **kwargs)


def test_bad_optimizers_are_refused():
    with pytest.raises(TypeError, match="optimizer must be a keras.optimizers.Optimizer"):
        kr.CrossReplicaOptimizer(object())
    with pytest.raises(ValueError, match="do not wrap it twice"):
        kr.CrossReplicaOptimizer(kr.CrossReplicaOptimizer(keras.optimizers.SGD()))
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2; use"):
        kr.CrossReplicaOptimizer(keras.optimizers.SGD(gradient_accumulation_steps=2))
    assert isinstance(kr.CrossReplicaOptimizer("adam").inner_optimizer, keras.optimizers.Adam)


def test_apply_outside_a_replica_context_is_refused():
    strategy = strategy_for(2)
    with strategy.scope():
        v = keras.Variable(np.ones(3, "float32"))
        opt = kr.CrossReplicaOptimizer(keras.optimizers.SGD(0.1))
        with pytest.raises(ValueError, match="must be called in a replica context"):
            opt.apply([tf.ones(3)], [v])


@pytest.mark.parametrize("index,expected", [(0, "identical on every replica"), (1, "loss scale:")])
def test_docs_page_examples_run(index, expected):
    result = run_markdown_example("docs/optimizers.md", index)
    assert expected in result.stdout
