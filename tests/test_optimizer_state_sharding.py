"""Optimizer-state sharding (`ReplicatorStrategy(shard_optimizer_state=True)`), on 4 replicas.

Every check compares a sharded run with the same run unsharded (or on one
device): the weights and the optimizer's own variables after several steps, the
bytes each device holds, and checkpoints moved between replica counts and in
and out of sharding. The 2 workers x 2 case is in test_multi_worker.py.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr

X = np.random.default_rng(0).normal(size=(96, 8)).astype("float32")
Y = np.random.default_rng(1).normal(size=(96, 2)).astype("float32")
BATCH = 16
# Enough variables for every one of 4 replicas to own some, for the checks that compare runs
# rather than shares: each layer adds to the trace (per replica when sharded), not to the path.
SHALLOW = 4


def mlp(batch_norm=None, depth=12) -> keras.Model:
    """`depth` 8x8 layers and a head: variables of even sizes, so the shares can be even."""
    keras.utils.set_random_seed(3)
    layers = [keras.Input((8,))]
    for _ in range(depth):
        layers.append(keras.layers.Dense(8, activation="tanh"))
        if batch_norm is not None:
            layers.append(batch_norm())
    layers.append(keras.layers.Dense(2))
    return keras.Sequential(layers)


def train(strategy, make_optimizer, *, epochs=2, compile_kw=None, batch_norm=None, depth=12):
    scope = strategy.scope() if strategy is not None else _nothing()
    with scope:
        model = mlp(batch_norm, depth)
        model.compile(make_optimizer(), "mse", **(compile_kw or {}))
    model.fit(X, Y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    return model


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def state(model) -> list[np.ndarray]:
    return [np.asarray(v.numpy()) for v in model.optimizer.variables]


def assert_same_training(sharded, unsharded, atol=1e-6):
    for a, b in zip(sharded.get_weights(), unsharded.get_weights()):
        np.testing.assert_allclose(a, b, atol=atol, rtol=0)
    got, want = state(sharded), state(unsharded)
    assert [s.shape for s in got] == [s.shape for s in want]
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=atol, rtol=0)
    for variable in sharded.trainable_variables:  # every replica holds the same weights
        copies = [c.numpy() for c in variable.value.values]
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy, copies[0])


OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(1e-2),
    "adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.05),
    "lion": lambda: keras.optimizers.Lion(1e-3),
    "adafactor": lambda: keras.optimizers.Adafactor(1e-2),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_each_optimizer_equals_unsharded_and_holds_a_quarter_per_device(name):
    make = OPTIMIZERS[name]
    unsharded = train(kr.ReplicatorStrategy(), make)
    sharded = train(kr.ReplicatorStrategy(shard_optimizer_state=True), make)
    assert_same_training(sharded, unsharded)

    full = kr.optimizers.state_bytes_per_device(unsharded.optimizer)
    shares = kr.optimizers.state_bytes_per_device(sharded.optimizer)
    assert len(full) == len(shares) == 4

    def size(v):
        return int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize

    # Scalars (the iteration count, the learning rate, ...) stay mirrored; slots are sharded.
    mirrored = [v for v in sharded.optimizer.variables
                if isinstance(v.value, tf.distribute.DistributedValues)]
    assert all(v.shape.rank == 0 for v in mirrored)
    scalars = sum(size(v) for v in mirrored)
    slots = sum(size(v) for v in sharded.optimizer.variables) - scalars
    assert set(full.values()) == {slots + scalars}
    assert sum(shares.values()) == slots + 4 * scalars  # nothing stored twice
    # Owners are chosen by the variables' sizes. An element-wise optimizer's state is
    # proportional to them: within 10% of a quarter here. Adafactor's factored moments are
    # not: within one variable's state (an 8x8 kernel's 64 + 8 + 8 floats) of a quarter.
    bound = slots / 4 + 4 * (64 + 8 + 8) if name == "adafactor" else 1.1 * slots / 4
    for device, held in shares.items():
        assert held - scalars <= bound, (device, held, slots)


@pytest.mark.core
def test_slots_live_on_their_owner_only_and_are_whole():
    strategy = kr.ReplicatorStrategy(shard_optimizer_state=True)
    with strategy.scope():
        model = mlp()
        model.compile(keras.optimizers.Adam(), "mse")
    model.optimizer.build(model.trainable_variables)
    slots = [v for v in model.optimizer.variables if v.shape.rank]
    assert len(slots) == 2 * len(model.trainable_variables)
    owners = kr.optimizers.partition(
        [int(np.prod(v.shape)) for v in model.trainable_variables], 4
    )
    adam = model.optimizer
    for i, variable in enumerate(model.trainable_variables):
        for slot in (adam._momentums[i], adam._velocities[i]):
            assert slot.shape == variable.shape
            assert not isinstance(slot.value, tf.distribute.DistributedValues)
            assert tf.DeviceSpec.from_string(slot.value.device).device_index == owners[i]


def test_steps_per_execution_accumulation_clipping_compression_and_batch_norm():
    def make():
        return kr.optimizers.CrossReplicaOptimizer(
            keras.optimizers.AdamW(1e-2, weight_decay=0.05),
            accumulation_steps=2, clip_global_norm=0.5, compression="bfloat16", skip_nonfinite=True,
        )

    kw = dict(compile_kw={"steps_per_execution": 3}, batch_norm=kr.layers.GlobalBatchNormalization, depth=SHALLOW)
    # Traced per replica, as the sharded step is: the same all-reduce (a collective
    # sums bfloat16 in another order, which 12 steps of batch norm carry past 1e-6).
    unsharded = train(kr.ReplicatorStrategy(trace_once=False), make, **kw)
    sharded = train(kr.ReplicatorStrategy(shard_optimizer_state=True), make, **kw)
    assert int(sharded.optimizer.iterations.numpy()) == 6 * 2 // 2
    assert_same_training(sharded, unsharded)


def test_mixed_precision_loss_scale_and_xla():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        kw = dict(compile_kw={"jit_compile": True}, depth=SHALLOW)
        unsharded = train(kr.ReplicatorStrategy(), lambda: keras.optimizers.Adam(1e-2), **kw)
        sharded = train(
            kr.ReplicatorStrategy(shard_optimizer_state=True), lambda: keras.optimizers.Adam(1e-2), **kw
        )
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert isinstance(sharded.optimizer, keras.optimizers.LossScaleOptimizer)
    assert_same_training(sharded, unsharded)


def test_custom_loop_applies_the_same_updates():
    def run(strategy):
        with strategy.scope():
            model = mlp()
            optimizer = keras.optimizers.Adam(1e-2)
            optimizer.build(model.trainable_variables)
        dataset = strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH)
        )

        @tf.function
        def step(x, y):
            def replica_step(x, y):
                with tf.GradientTape() as tape:
                    loss = tf.nn.compute_average_loss(
                        keras.losses.mean_squared_error(y, model(x)), global_batch_size=BATCH
                    )
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply(grads, model.trainable_variables)

            strategy.run(replica_step, args=(x, y))

        for x, y in dataset:
            step(x, y)
        model.optimizer = optimizer
        return model

    assert_same_training(run(kr.ReplicatorStrategy(shard_optimizer_state=True)),
                         run(kr.ReplicatorStrategy()))


def adamw():
    return keras.optimizers.AdamW(1e-2, weight_decay=0.05)


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory):
    """Two epochs unsharded, uninterrupted; and one sharded epoch, saved: what every resumption
    below starts from and ends at (trained once: the resumptions only read them)."""
    uninterrupted = train(kr.ReplicatorStrategy(), adamw, epochs=2, depth=SHALLOW)
    first = train(kr.ReplicatorStrategy(shard_optimizer_state=True), adamw, epochs=1, depth=SHALLOW)
    path = str(tmp_path_factory.mktemp("sharded_checkpoint") / "model.keras")
    first.save(path)
    return {"uninterrupted": uninterrupted, "first": first, "path": path}


@pytest.mark.parametrize("resume_on", ["2 replicas sharded", "one device", "4 replicas unsharded"])
def test_a_sharded_checkpoint_resumes_anywhere_to_the_uninterrupted_weights(sharded_checkpoint, resume_on):
    uninterrupted, first = sharded_checkpoint["uninterrupted"], sharded_checkpoint["first"]
    strategy = {
        "2 replicas sharded": kr.ReplicatorStrategy(["/cpu:0", "/cpu:1"], shard_optimizer_state=True),
        "one device": None,
        "4 replicas unsharded": kr.ReplicatorStrategy(),
    }[resume_on]
    with strategy.scope() if strategy is not None else _nothing():
        resumed = keras.saving.load_model(sharded_checkpoint["path"])
    # The whole state came back, in the unsharded layout.
    for a, b in zip(state(resumed), state(first), strict=True):
        np.testing.assert_array_equal(a, b)
    resumed.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(resumed.get_weights(), uninterrupted.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    for a, b in zip(state(resumed), state(uninterrupted)):  # the step count and the moments
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_weights_files_and_backups_keep_the_unsharded_format(tmp_path):
    def make():
        return keras.optimizers.Adam(1e-2)

    sharded = train(kr.ReplicatorStrategy(shard_optimizer_state=True), make, epochs=1)
    unsharded = train(kr.ReplicatorStrategy(), make, epochs=1)
    sharded.save_weights(str(tmp_path / "sharded.weights.h5"))
    unsharded.save_weights(str(tmp_path / "unsharded.weights.h5"))
    # Each loads into the other kind of run, whole.
    with kr.ReplicatorStrategy().scope():
        into_unsharded = mlp()
        into_unsharded.compile(make(), "mse")
        into_unsharded.optimizer.build(into_unsharded.trainable_variables)
    into_unsharded.load_weights(str(tmp_path / "sharded.weights.h5"))
    with kr.ReplicatorStrategy(shard_optimizer_state=True).scope():
        into_sharded = mlp()
        into_sharded.compile(make(), "mse")
        into_sharded.optimizer.build(into_sharded.trainable_variables)
    into_sharded.load_weights(str(tmp_path / "unsharded.weights.h5"))
    for a, b in zip(state(into_unsharded), state(sharded)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(state(into_sharded), state(unsharded)):
        np.testing.assert_array_equal(a, b)


def test_what_cannot_be_sharded_is_refused_before_any_step_naming_it():
    with pytest.raises(ValueError, match="shard_optimizer_state must be True or False"):
        kr.ReplicatorStrategy(shard_optimizer_state="yes")
    strategy = kr.ReplicatorStrategy(shard_optimizer_state=True)
    with strategy.scope():
        model = mlp()
        model.compile(keras.optimizers.Adam(use_ema=True), "mse")
    weights = model.get_weights()
    with pytest.raises(ValueError, match="Optimizer 'adam(_[0-9]+)?' has use_ema=True"):
        model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0)
    for a, b in zip(model.get_weights(), weights):  # no step ran
        np.testing.assert_array_equal(a, b)

    class Unowned(keras.optimizers.SGD):
        """Keeps one variable of its own that belongs to no model variable."""

        def build(self, variables):
            super().build(variables)
            self.table = self.add_variable((3, 3), name="lookup_table")

    with strategy.scope():
        model = mlp()
        model.compile(Unowned(0.1), "mse")
    with pytest.raises(ValueError, match="'lookup_table' of shape \\(3, 3\\), which belongs to no model"):
        model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0)


def test_partition_balances_and_is_deterministic():
    sizes = [100, 60, 50, 40, 10]
    assert kr.optimizers.partition(sizes, 2) == [0, 1, 1, 0, 1]  # 140 and 120
    assert kr.optimizers.partition(sizes, 1) == [0] * 5
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 1000, size=200).tolist()
    for n in (2, 4, 8):
        owners = kr.optimizers.partition(sizes, n)
        loads = np.bincount(owners, weights=sizes, minlength=n)
        assert loads.max() <= sum(sizes) / n + max(sizes)
        assert loads.max() <= 1.1 * sum(sizes) / n
    with pytest.raises(ValueError, match="num_replicas must be a positive integer"):
        kr.optimizers.partition([1], 0)
