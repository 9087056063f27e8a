"""The replica-context primitives against values computed by hand."""

import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr


def run_per_replica(strategy, fn):
    """Runs ``fn`` on every replica inside a tf.function; returns per-replica numpy values."""

    @tf.function
    def step():
        return strategy.run(fn)

    out = step()
    return tf.nest.map_structure(
        lambda v: [np.asarray(x) for x in strategy.experimental_local_results(v)], out
    )


@pytest.fixture(params=[2, 4], ids=["2replicas", "4replicas"])
def strategy(request):
    return kr.ReplicatorStrategy([f"/cpu:{i}" for i in range(request.param)])


def value():  # replica r holds r + 1 (and a vector [r, -r])
    r = tf.cast(kr.replica_id(), tf.float32)
    return r + 1.0, tf.stack([r, -r])


@pytest.mark.parametrize(
    "op, expected", [("sum", lambda n: n * (n + 1) / 2), ("mean", lambda n: (n + 1) / 2),
                     ("max", lambda n: n), ("min", lambda n: 1)]
)
def test_all_reduce_ops(strategy, op, expected):
    n = strategy.num_replicas_in_sync
    out = run_per_replica(strategy, lambda: kr.all_reduce(value()[0], op))
    assert out == [pytest.approx(expected(n))] * n


def test_all_reduce_nested_structure(strategy):
    n = strategy.num_replicas_in_sync
    out = run_per_replica(strategy, lambda: kr.all_reduce({"a": value()[0], "b": value()[1]}))
    assert out["a"] == [pytest.approx(n * (n + 1) / 2)] * n
    for v in out["b"]:
        np.testing.assert_allclose(v, [n * (n - 1) / 2, -n * (n - 1) / 2])


def test_grouped_all_reduce():
    strategy = kr.ReplicatorStrategy()
    out = run_per_replica(strategy, lambda: kr.all_reduce(value()[0], "sum", group_size=2))
    assert out == [3.0, 3.0, 7.0, 7.0]
    out = run_per_replica(strategy, lambda: kr.all_reduce(value()[0], "max", group_size=2))
    assert out == [2.0, 2.0, 4.0, 4.0]


def test_all_gather_in_replica_order(strategy):
    n = strategy.num_replicas_in_sync
    out = run_per_replica(strategy, lambda: kr.all_gather(value()[0][tf.newaxis]))
    for v in out:
        np.testing.assert_array_equal(v, np.arange(1, n + 1))


def test_all_gather_uneven_sizes_along_axis():
    strategy = kr.ReplicatorStrategy(["/cpu:0", "/cpu:1"])
    # replica 0 contributes one row, replica 1 two rows
    out = run_per_replica(
        strategy, lambda: kr.all_gather(tf.ones([kr.replica_id() + 1, 2]) * tf.cast(kr.replica_id(), tf.float32))
    )
    for v in out:
        np.testing.assert_array_equal(v, [[0, 0], [1, 1], [1, 1]])


def test_broadcast_sends_the_source_value_and_ignores_nan_elsewhere(strategy):
    n = strategy.num_replicas_in_sync
    src = n - 1

    def fn():
        r = tf.cast(kr.replica_id(), tf.float32)
        x = tf.where(tf.equal(kr.replica_id(), src), r + 10.0, np.nan)
        return kr.broadcast(x, source_replica=src), kr.broadcast(tf.cast(kr.replica_id(), tf.int32) * 7, src)

    floats, ints = run_per_replica(strategy, fn)
    assert floats == [src + 10.0] * n
    assert ints == [7 * src] * n


def test_replica_id_and_num_replicas(strategy):
    n = strategy.num_replicas_in_sync
    ids, counts = run_per_replica(strategy, lambda: (kr.replica_id(), tf.constant(kr.num_replicas())))
    assert ids == list(range(n))
    assert counts == [n] * n


def test_all_reduce_is_differentiable():
    strategy = kr.ReplicatorStrategy(["/cpu:0", "/cpu:1"])

    def fn():
        x = tf.constant(2.0) + tf.cast(kr.replica_id(), tf.float32)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = kr.all_reduce(x * x, "sum")
        return tape.gradient(y, x)

    # d(sum_r x_r^2)/dx_r = 2 x_r, then the all-sum of the upstream gradient (2 replicas) doubles it
    assert run_per_replica(strategy, fn) == [8.0, 12.0]


def test_all_reduce_second_order_gradient():
    strategy = kr.ReplicatorStrategy(["/cpu:0", "/cpu:1"])

    def fn():
        x = tf.constant(2.0) + tf.cast(kr.replica_id(), tf.float32)
        with tf.GradientTape() as outer:
            outer.watch(x)
            with tf.GradientTape() as inner:
                inner.watch(x)
                y = kr.all_reduce(x * x, "sum")
                z = y * y
            g = inner.gradient(z, x)
        return outer.gradient(g, x)

    # The same on one device: every replica's z, g summed (that is what the
    # gradients of the all-reduce compute), x = [2, 3].
    x = tf.constant([2.0, 3.0])
    with tf.GradientTape() as outer:
        outer.watch(x)
        with tf.GradientTape() as inner:
            inner.watch(x)
            total = 2 * tf.reduce_sum(x * x) ** 2
        g = tf.reduce_sum(inner.gradient(total, x))
    expected = outer.gradient(g, x).numpy()  # [264, 344]
    assert run_per_replica(strategy, fn) == [pytest.approx(e) for e in expected]


def test_tracing_a_chain_of_all_reduces_does_not_walk_other_replicas():
    """tf.custom_gradient searches the graph behind an all-reduce for variables. Stock
    TensorFlow's walk crosses into every replica's graph and back to the inputs, so
    tracing a model with one all-reduce per layer grows with the square of its depth
    (ResNet-50 with Keras's synchronized batch norm: > 10 min for its first step on 4
    replicas). Under ReplicatorStrategy the walk must stop at the all-reduce: its
    size must not grow with the depth of what comes before."""
    from tensorflow.python.ops import op_selector  # measuring TensorFlow's walk itself

    strategy = kr.ReplicatorStrategy(["/cpu:0", "/cpu:1"])
    walked = []
    original = op_selector.get_backward_walk_ops

    def counting(*args, **kwargs):
        ops = original(*args, **kwargs)
        walked.append(len(ops))
        return ops

    def largest_walk(depth):
        walked.clear()

        @tf.function
        def step():
            def fn():
                h = tf.ones([4]) * (1.0 + tf.cast(kr.replica_id(), tf.float32))
                with tf.GradientTape() as tape:
                    tape.watch(h)
                    y = h
                    for _ in range(depth):
                        y = tf.tanh(tf.distribute.get_replica_context().all_reduce("MEAN", y * 1.5))
                return tape.gradient(tf.reduce_sum(y), h)

            return strategy.run(fn)

        step.get_concrete_function()
        return max(walked)

    op_selector.get_backward_walk_ops = counting
    try:
        shallow, deep = largest_walk(2), largest_walk(12)
    finally:
        op_selector.get_backward_walk_ops = original
    assert shallow == deep, (shallow, deep)


def test_outside_a_replica_context_behaves_as_one_replica():
    x = tf.constant([1.0, 2.0])
    np.testing.assert_array_equal(kr.all_reduce(x, "mean"), x)
    np.testing.assert_array_equal(kr.all_gather(x), x)
    np.testing.assert_array_equal(kr.broadcast(x), x)
    assert int(kr.replica_id()) == 0 and kr.num_replicas() == 1
    strategy = kr.ReplicatorStrategy()
    with strategy.scope():  # cross-replica context
        np.testing.assert_array_equal(kr.all_reduce(x, "sum"), x)
        np.testing.assert_array_equal(kr.broadcast(x), x)
        # The one exception: num_replicas() answers the strategy's count in its scope.
        assert kr.num_replicas() == strategy.num_replicas_in_sync > 1


@pytest.mark.parametrize("call, match", [
    (lambda: kr.all_reduce(tf.constant(1.0), "prod"), "op must be one of"),
    (lambda: kr.all_reduce(tf.constant(1.0), "sum", group_size=3), "does not divide"),
    (lambda: kr.all_reduce(tf.constant(1.0), "sum", group_size=0), "positive integer"),
    (lambda: kr.broadcast(tf.constant(1.0), source_replica=4), r"source_replica must be an integer in \[0, 3\]"),
])
def test_bad_arguments_inside_replicas(call, match):
    strategy = kr.ReplicatorStrategy()
    with pytest.raises(ValueError, match=match):
        run_per_replica(strategy, call)
