"""A step traced once, its large all-reduces reduced between its calls (`reduce_between_calls`).

The reference is the step traced per replica, which reduces with the same
cross-device ops in the caller's graph: the weights must match it (to float32
rounding: the two graphs are optimised apart), and no collective may be left in
the step.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from keras_replicator._compat import reduce_between_calls

REPLICAS = 4


def collectives_in(concrete) -> int:
    """The collective all-reduces of a traced function and of every function it calls."""
    graph_def = concrete.graph.as_graph_def()
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    return sum(n.op.startswith("CollectiveReduce") for n in nodes)


def calls_in(concrete) -> int:
    """The calls of functions not to inline (the replica step's, or its stages')."""
    graph_def = concrete.graph.as_graph_def()
    kept = {f.signature.name for f in graph_def.library.function if "_noinline" in f.attr}
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    return sum(n.op.endswith("PartitionedCall") and n.attr["f"].func.name in kept for n in nodes)


def data(seed: int, features: int = 256, rows: int = 64):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(rows, features)).astype("float32"), rng.normal(size=(rows, 1)).astype("float32")


def regression(strategy, features: int = 256, width: int = 1024, optimizer: str = "adam"):
    """A model whose first kernel's gradient is 1 MB (the threshold) or more."""
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((features,)), keras.layers.Dense(width, activation="relu"),
                                  keras.layers.BatchNormalization(), keras.layers.Dense(1)])
        model.compile(keras.optimizers.get(optimizer), "mse", metrics=["mae"])
    return model


@pytest.fixture
def splits(monkeypatch):
    """Each split the engine made, as (cuts, staged, its stages optimised by Grappler once)."""
    made = []
    original = reduce_between_calls.split

    def split(traced, cuts, *args):
        staged = original(traced, cuts, *args)
        made.append((len(cuts), staged is not None, staged is not None and staged.optimized_once))
        return staged

    monkeypatch.setattr(reduce_between_calls, "split", split)
    return made


def fit_weights(strategy, steps: int = 3):
    model = regression(strategy)
    x, y = data(1)
    history = model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(32).repeat(), steps_per_epoch=steps,
                        epochs=1, verbose=0)
    return model, history.history


@pytest.mark.core
def test_fit_with_a_gradient_over_the_threshold_reduces_it_between_the_calls_as_per_replica(splits):
    staged, staged_history = fit_weights(kr.ReplicatorStrategy())
    # One cut (the gradients; the BN statistics are far below the threshold), staged.
    assert splits == [(1, True, True)]
    reference, reference_history = fit_weights(kr.ReplicatorStrategy(trace_once=False))
    for a, b in zip(staged.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for name, values in reference_history.items():
        np.testing.assert_allclose(staged_history[name], values, rtol=1e-5)
    kr.testing.assert_replicas_identical(staged)


def _custom_step(strategy, optimizers: int):
    """A step with `optimizers` optimizers, each over its own 1 MB Dense (a GAN's two)."""
    with strategy.scope():
        keras.utils.set_random_seed(0)
        models = [keras.Sequential([keras.Input((256,)), keras.layers.Dense(1024), keras.layers.Dense(1)])
                  for _ in range(optimizers)]
        opts = [keras.optimizers.Adam(1e-2) for _ in models]
        for model, opt in zip(models, opts):
            opt.build(model.trainable_variables)

    @tf.function
    def step(x, y):
        def replica_step(x, y):
            losses = []
            for model, opt in zip(models, opts):
                with tf.GradientTape() as tape:
                    # Each model reads the loss before it, as a generator's loss reads the critic.
                    inputs = x if not losses else x + losses[-1]
                    loss = tf.reduce_mean((model(inputs) - y) ** 2) / REPLICAS
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))
                losses.append(loss)
            return tf.add_n(losses), losses[0]
        return strategy.run(replica_step, args=(x, y))

    return models, opts, step


def _run_custom(strategy, optimizers: int):
    models, opts, step = _custom_step(strategy, optimizers)
    # 64 rows in batches of 24: the last batch (16) splits evenly, 4 rows a replica.
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(data(2)).batch(24))
    losses = []
    for x, y in dataset:
        out = step(x, y)
        losses.append([[float(v) for v in strategy.experimental_local_results(o)] for o in out])
    concretes = [step.get_concrete_function(x, y)]
    return [w for m in models for w in m.get_weights()], losses, concretes, opts


@pytest.mark.core
def test_a_custom_step_with_two_optimizers_is_cut_twice_and_matches_per_replica(splits):
    weights, losses, concretes, opts = _run_custom(kr.ReplicatorStrategy(), 2)
    assert splits and all(s == (2, True, True) for s in splits), splits
    reference, reference_losses, _, reference_opts = _run_custom(kr.ReplicatorStrategy(trace_once=False), 2)
    for a, b in zip(weights, reference):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-5)
    for opt, ref in zip(opts, reference_opts):
        for a, b in zip(opt.variables, ref.variables):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5)  # Adam's moments: rounding, squared
    for concrete in concretes:
        assert collectives_in(concrete) == 0
        assert calls_in(concrete) == 3 * REPLICAS  # 2 cuts: 3 stages, each called on every replica


@pytest.mark.core
def test_below_the_threshold_the_step_keeps_its_collective(splits, monkeypatch):
    monkeypatch.setattr(reduce_between_calls, "MIN_BYTES", 2**30)
    weights, _, concretes, _ = _run_custom(kr.ReplicatorStrategy(), 1)
    reference, _, _, _ = _run_custom(kr.ReplicatorStrategy(trace_once=False), 1)
    assert all(cuts == 0 for cuts, _, _ in splits)
    for concrete in concretes:
        assert collectives_in(concrete) >= 1 and calls_in(concrete) == REPLICAS
    for a, b in zip(weights, reference):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.core
def test_a_mean_all_reduce_of_a_large_tensor_is_cut_and_every_replica_gets_the_mean(splits):
    strategy = kr.ReplicatorStrategy()
    size = 2**20 // 4 + 1  # just over the threshold

    @tf.function
    def step():
        def replica_step():
            rid = tf.cast(kr.replica_id(), tf.float32)
            return kr.all_reduce(tf.fill([size], rid), "mean")
        return strategy.run(replica_step)

    results = strategy.experimental_local_results(step())
    assert splits == [(1, True, True)]
    for result in results:
        np.testing.assert_array_equal(result.numpy(), np.full([size], np.mean(range(REPLICAS)), np.float32))
    assert collectives_in(step.get_concrete_function()) == 0
