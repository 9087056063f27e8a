"""Exactly once: every example of an epoch reaches exactly one replica, with a conv model.

``check_exactly_once`` is written to run unchanged on every worker of a
multi-worker job (2 workers x 2 devices): the counts are summed over the
replicas of all workers (a Keras metric in ``fit``, ``strategy.reduce`` in a
custom loop), so each worker can assert on the global picture.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr


class IdCounter(keras.metrics.Metric):
    """Counts how often each example id went through a training step, over all replicas."""

    def __init__(self, num_examples: int, **kwargs):
        super().__init__(name="id_counter", **kwargs)
        self.num_examples = num_examples
        self.counts = self.add_variable(shape=(num_examples,), initializer="zeros", name="counts", aggregation="sum")

    def update_state(self, ids):
        # A padding row (a replica left without rows by a short batch) is no example.
        ids = tf.boolean_mask(tf.cast(ids, tf.int32), kr.real_rows(ids))
        ids = tf.reshape(ids, [-1])
        self.counts.assign_add(tf.math.bincount(ids, minlength=self.num_examples, maxlength=self.num_examples, dtype=self.counts.dtype))

    def result(self):
        return tf.reduce_max(self.counts)


class IdRecorder(keras.Model):
    """A small conv net whose training step records the ids of the examples it trains on.

    Convolutions matter: TensorFlow 2.21's oneDNN Conv2D mis-shapes an empty
    batch, so a replica left without examples would crash the step.
    """

    def __init__(self, num_examples: int):
        super().__init__()
        self.conv = keras.layers.Conv2D(4, 3, padding="same", activation="relu")
        self.pool = keras.layers.GlobalAveragePooling2D()
        self.out = keras.layers.Dense(2)
        self.ids_seen = IdCounter(num_examples)
        self.batch_sizes = []

    def call(self, inputs):
        return self.out(self.pool(self.conv(inputs["image"])))

    def train_step(self, data):
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        self.ids_seen.update_state(x["id"])
        return super().train_step(data)


class _CountsPerEpoch(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs = []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(np.asarray(keras.ops.convert_to_numpy(self.model.ids_seen.counts)).astype(int))


def id_dataset(num_examples: int, size: int = 6, seed: int = 0):
    """Images, labels and ids 0..num_examples-1, as NumPy arrays."""
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(num_examples, size, size, 1)).astype("float32")
    labels = rng.integers(0, 2, size=(num_examples,)).astype("int32")
    return {"image": images, "id": np.arange(num_examples, dtype="int32")}, labels


def check_exactly_once(
    strategy: tf.distribute.Strategy,
    *,
    num_examples: int = 450,
    global_batch_size: int = 64,
    epochs: int = 2,
    via: str = "distribute_dataset",
    seed: int = 0,
) -> list[np.ndarray]:
    """Trains an ``IdRecorder`` and asserts every id was seen exactly once in every epoch.

    ``via``: ``"distribute_dataset"`` (strategy.distribute_dataset of an unbatched,
    shuffled dataset), ``"numpy"`` (model.fit on NumPy arrays, shuffled by Keras) or
    ``"loop"`` (a custom ``strategy.run`` loop over the distributed dataset). Every
    worker of a job must call it with the same arguments. Returns the counts per epoch
    (summed over all replicas of all workers).
    """
    keras.utils.set_random_seed(seed)  # identical shuffles on every worker
    x, y = id_dataset(num_examples, seed=seed)
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    if via == "loop":
        return _check_loop(strategy, dataset, num_examples, global_batch_size, epochs, seed)
    with strategy.scope():
        model = IdRecorder(num_examples)
        model.compile(keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    counts = _CountsPerEpoch()
    if via == "distribute_dataset":
        train = strategy.distribute_dataset(
            dataset, global_batch_size=global_batch_size, shuffle_buffer_size=num_examples, seed=seed
        )
        model.fit(train, epochs=epochs, callbacks=[counts], verbose=0)
    elif via == "numpy":
        model.fit(x, y, batch_size=global_batch_size, epochs=epochs, shuffle=True, callbacks=[counts], verbose=0)
    else:
        raise ValueError(f"via must be 'distribute_dataset', 'numpy' or 'loop', got {via!r}.")
    _assert_each_once(counts.epochs, epochs, num_examples)
    steps = -(-num_examples // global_batch_size)
    assert int(model.optimizer.iterations.numpy()) == epochs * steps
    return counts.epochs


def _check_loop(strategy, dataset, num_examples, global_batch_size, epochs, seed):
    distributed = strategy.distribute_dataset(
        dataset, global_batch_size=global_batch_size, shuffle_buffer_size=num_examples, seed=seed
    )

    def replica_counts(batch):
        x, _ = batch
        ids = tf.cast(x["id"], tf.int32)
        empty = tf.cast(tf.equal(tf.size(ids), 0), tf.int32)
        counts = tf.math.bincount(ids, minlength=num_examples, maxlength=num_examples)
        return counts, empty

    @tf.function
    def step(batch):
        counts, empty = strategy.run(replica_counts, args=(batch,))
        return strategy.reduce("sum", counts, axis=None), strategy.reduce("sum", empty, axis=None)

    per_epoch = []
    for _ in range(epochs):
        total = np.zeros(num_examples, int)
        for batch in distributed:
            counts, empty = step(batch)
            assert int(empty) == 0, f"{int(empty)} replica(s) got an empty batch"
            total += counts.numpy()
        per_epoch.append(total)
    _assert_each_once(per_epoch, epochs, num_examples)
    return per_epoch


def _assert_each_once(per_epoch, epochs, num_examples):
    assert len(per_epoch) == epochs
    for epoch, counts in enumerate(per_epoch):
        missing = np.flatnonzero(counts == 0)
        repeated = np.flatnonzero(counts > 1)
        assert counts.shape == (num_examples,) and not missing.size and not repeated.size, (
            f"epoch {epoch}: {missing.size} example(s) never seen (e.g. {missing[:5].tolist()}), "
            f"{repeated.size} seen more than once (e.g. {repeated[:5].tolist()})"
        )


@pytest.fixture(scope="module")
def strategy():
    return kr.ReplicatorStrategy()


# 450 examples, global batch 64, 4 replicas: the last batch has 2 examples, fewer than replicas.
@pytest.mark.core
@pytest.mark.parametrize("via", ["distribute_dataset", "numpy", "loop"])
def test_every_example_exactly_once_per_epoch(strategy, via):
    check_exactly_once(strategy, via=via)


def test_the_check_detects_a_missing_example(strategy):
    # Dropping the remainder loses the last 2 examples: the same check must fail.
    x, y = id_dataset(450)
    with strategy.scope():
        model = IdRecorder(450)
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    counts = _CountsPerEpoch()
    train = strategy.distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)), global_batch_size=64, drop_remainder=True
    )
    model.fit(train, epochs=1, callbacks=[counts], verbose=0)
    with pytest.raises(AssertionError, match="2 example"):
        _assert_each_once(counts.epochs, 1, 450)
    assert counts.epochs[0].sum() == 448
