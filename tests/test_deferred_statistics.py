"""Plain BatchNormalization's moving statistics in a step traced once: one collective at the step's end.

Every read sees the replicas' mean, as when each update all-reduced at once;
the step traced per replica is the reference.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr

REPLICAS = 4


@pytest.fixture(scope="module", params=[True, False], ids=["traced_once", "per_replica"])
def strategy(request):
    strategy = kr.ReplicatorStrategy(trace_once=request.param)
    assert strategy.num_replicas_in_sync == REPLICAS
    return strategy


def shifted_slices(seed: int, width: int = 3):
    """One slice per replica, replica r's shifted by 10 r: its local statistics differ."""
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(4, width)).astype("float32") + 10.0 * r for r in range(REPLICAS)]


def per_replica(strategy, slices):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(slices[ctx.replica_id_in_sync_group]))


def local_results(strategy, value):
    return [np.asarray(v) for v in strategy.experimental_local_results(value)]


def mean_of_local_means(slices):
    return np.mean([s.astype(np.float64).mean(0) for s in slices], axis=0)


def batch_norms(strategy, count: int) -> list:
    """``count`` plain BatchNormalization layers (momentum 0.5) built under ``strategy``."""
    with strategy.scope():
        layers = [keras.layers.BatchNormalization(momentum=0.5) for _ in range(count)]
        for layer in layers:
            layer.build((None, 3))
    return layers


def collectives_in(concrete) -> int:
    """The all-reduces of a traced step and of every function it calls."""
    graph_def = concrete.graph.as_graph_def()
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    return sum(n.op.startswith("CollectiveReduce") for n in nodes)


@pytest.mark.core
def test_three_layers_statistics_take_one_collective_and_match_per_replica(strategy):
    layers = batch_norms(strategy, 3)
    first, second = shifted_slices(1), shifted_slices(2)

    @tf.function
    def step(x):
        def replica_step(x):
            for layer in layers:
                x = layer(x, training=True)
            return x

        return strategy.run(replica_step, args=(x,))

    step(per_replica(strategy, first))
    step(per_replica(strategy, second))
    kr.testing.assert_replicas_identical(layers)
    # The first layer's input is the data: its moving mean follows the replicas' mean.
    expected = 0.25 * mean_of_local_means(first) + 0.5 * mean_of_local_means(second)
    np.testing.assert_allclose(layers[0].moving_mean.numpy(), expected, rtol=1e-5)
    if strategy.extended.trace_once:
        # 6 statistics: one packed all-reduce (before: one each).
        assert collectives_in(step.get_concrete_function(per_replica(strategy, first))) == 1


def test_a_statistic_read_after_its_update_in_the_step_reads_the_mean(strategy):
    (layer,) = batch_norms(strategy, 1)
    first, second = shifted_slices(3), shifted_slices(4)

    @tf.function
    def step(x, y):
        def replica_step(x, y):
            layer(x, training=True)
            seen = tf.identity(layer.moving_mean)  # not an update: a plain read
            layer(y, training=True)
            return seen

        return strategy.run(replica_step, args=(x, y))

    seen = local_results(strategy, step(per_replica(strategy, first), per_replica(strategy, second)))
    for replica_seen in seen:
        np.testing.assert_allclose(replica_seen, 0.5 * mean_of_local_means(first), rtol=1e-5)
    expected = 0.25 * mean_of_local_means(first) + 0.5 * mean_of_local_means(second)
    np.testing.assert_allclose(layer.moving_mean.numpy(), expected, rtol=1e-5)
    kr.testing.assert_replicas_identical(layer)


def test_a_read_inside_a_branch_after_the_update_reads_the_mean(strategy):
    (layer,) = batch_norms(strategy, 1)
    data = shifted_slices(5)

    @tf.function
    def step(x, flag):
        def replica_step(x):
            # The reduction cannot run inside the branch: traced again without deferring.
            layer(x, training=True)
            return tf.cond(flag, lambda: tf.identity(layer.moving_mean), lambda: tf.zeros([3]))

        return strategy.run(replica_step, args=(x,))

    seen = step(per_replica(strategy, data), tf.constant(True))
    expected = 0.5 * mean_of_local_means(data)
    for replica_seen in local_results(strategy, seen):
        np.testing.assert_allclose(replica_seen, expected, rtol=1e-5)
    np.testing.assert_allclose(layer.moving_mean.numpy(), expected, rtol=1e-5)
    kr.testing.assert_replicas_identical(layer)


def test_an_update_inside_a_branch_all_reduces_there():
    # Traced once only: a step traced per replica cannot update a mean-aggregated
    # variable inside a branch (TensorFlow's merge_call in control flow).
    strategy = kr.ReplicatorStrategy()
    inner, outer = batch_norms(strategy, 2)
    data = shifted_slices(6)

    @tf.function
    def step(x, flag):
        def replica_step(x):
            outer(x, training=True)
            return tf.cond(flag, lambda: inner(x, training=True), lambda: x)

        return strategy.run(replica_step, args=(x,))

    step(per_replica(strategy, data), tf.constant(True))
    for layer in (inner, outer):
        np.testing.assert_allclose(layer.moving_mean.numpy(), 0.5 * mean_of_local_means(data), rtol=1e-5)
        kr.testing.assert_replicas_identical(layer)
