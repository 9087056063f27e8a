"""The replica step is traced once and called on every replica (`trace_once=True`, the default)."""

import json
import logging
import subprocess

import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from tests.helpers import run_python

# Counted in a process with 8 devices: strategies over the first 1, 2, 4 and 8 of
# them; for each, how often the step's Python ran (traces) in fit and in a custom
# loop, and the size of the custom loop's graph (the function and every function in
# its library, each once). trace_once=False is the reference: one trace per replica.
_COUNT = """
import json
import numpy as np, keras, tensorflow as tf

traces = {"fit": 0, "loop": 0}

class Counted(keras.Sequential):
    def train_step(self, data):
        traces["fit"] += 1
        return super().train_step(data)

def graph_nodes(concrete):
    graph_def = concrete.graph.as_graph_def()
    return len(graph_def.node) + sum(len(f.node_def) for f in graph_def.library.function)

x = np.random.RandomState(0).randn(64, 8).astype("float32")
y = x.sum(1, keepdims=True)
out = {}
for trace_once, counts in ((True, (1, 2, 4, 8)), (False, (2, 8))):
    for n in counts:
        traces.update(fit=0, loop=0)
        strategy = kr.ReplicatorStrategy([f"/cpu:{i}" for i in range(n)], trace_once=trace_once)
        with strategy.scope():
            model = Counted([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dropout(0.1), keras.layers.Dense(1)])
            model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"], steps_per_execution=2)
            optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
            optimizer.build(model.trainable_variables)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)

        @tf.function
        def step(xb, yb):
            def replica_step(xb, yb):
                traces["loop"] += 1
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean((model(xb, training=True) - yb) ** 2)
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply(kr.all_reduce(grads, "mean"), model.trainable_variables)
                return loss
            return strategy.reduce("MEAN", strategy.run(replica_step, args=(xb, yb)), axis=None)

        batches = strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(16))
        xb, yb = next(iter(batches))
        nodes = graph_nodes(step.get_concrete_function(xb, yb))
        step(xb, yb)
        kr.testing.assert_replicas_identical(model)
        out[f"{trace_once}-{n}"] = dict(traces, nodes=nodes)
print("COUNTS " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def counts():
    result = run_python(_COUNT, devices=8, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    line = [out for out in result.stdout.splitlines() if out.startswith("COUNTS ")][-1]
    return json.loads(line[len("COUNTS "):])


def test_the_step_is_traced_once_for_1_2_4_8_replicas(counts):
    one = counts["True-1"]
    assert one["fit"] >= 1 and one["loop"] == 1
    for n in (2, 4, 8):
        assert counts[f"True-{n}"]["fit"] == one["fit"], counts
        assert counts[f"True-{n}"]["loop"] == 1, counts
    for n in (2, 8):
        # The reference traces once per replica: what the count above would show.
        assert counts[f"False-{n}"]["fit"] == n * one["fit"], counts
        assert counts[f"False-{n}"]["loop"] == n, counts


def test_the_graph_stays_near_one_replicas_size(counts):
    one = counts["True-1"]["nodes"]
    # One copy of the step whatever the replicas (with its all-reduces), plus per
    # replica a call and its inputs (one per variable): a few nodes, not a step.
    per_replica = (counts["True-8"]["nodes"] - counts["True-2"]["nodes"]) / 6
    assert per_replica < 0.2 * one, counts
    # Per-replica tracing adds a copy of the step for each replica.
    per_copy = (counts["False-8"]["nodes"] - counts["False-2"]["nodes"]) / 6
    assert per_copy > 0.5 * one, counts


def test_every_replica_runs_on_its_own_device():
    # TensorFlow's placer logs where each node of the traced step was placed.
    result = run_python(
        """
        import tensorflow as tf
        tf.debugging.set_log_device_placement(True)
        strategy = kr.ReplicatorStrategy()

        @tf.function
        def step(x):
            def replica_step(x):
                return kr.all_reduce(tf.math.multiply(x, 2.0, name="kr_probe"), "sum")
            return strategy.run(replica_step, args=(x,))

        batches = strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices(tf.ones([8, 2])).batch(8))
        print("SUMS", [float(t[0, 0]) for t in strategy.experimental_local_results(step(next(iter(batches))))])
        """,
        devices=4,
        env={"TF_CPP_MIN_LOG_LEVEL": "0"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stdout + result.stderr
    probes = {line.rsplit("device:", 1)[1].strip() for line in log.splitlines()
              if line.startswith("kr_probe: (Mul)")}
    collectives = {line.rsplit("device:", 1)[1].strip() for line in log.splitlines()
                   if "(CollectiveReduceV2)" in line and "placer" not in line}
    assert probes == {"CPU:0", "CPU:1", "CPU:2", "CPU:3"}, log[-3000:]
    assert collectives == {"CPU:0", "CPU:1", "CPU:2", "CPU:3"}, log[-3000:]
    assert "SUMS [8.0, 8.0, 8.0, 8.0]" in result.stdout


def _data():
    x = np.random.RandomState(0).randn(32, 4).astype("float32")
    return tf.data.Dataset.from_tensor_slices(x).batch(8)


def test_replica_id_is_a_tensor_and_differs_per_replica():
    strategy = kr.ReplicatorStrategy()

    @tf.function
    def step(x):
        def replica_step(x):
            rid = tf.distribute.get_replica_context().replica_id_in_sync_group
            assert isinstance(rid, tf.Tensor) and tf.get_static_value(rid) is None
            return rid + tf.zeros([], tf.int32), kr.replica_id(), tf.random.stateless_uniform(
                [2], seed=tf.stack([rid, 1]))
        return strategy.run(replica_step, args=(x,))

    batch = next(iter(strategy.experimental_distribute_dataset(_data())))
    ids, kr_ids, draws = (strategy.experimental_local_results(v) for v in step(batch))
    assert [int(i) for i in ids] == [0, 1, 2, 3]
    assert [int(i) for i in kr_ids] == [0, 1, 2, 3]
    assert len({tuple(np.round(d.numpy(), 6)) for d in draws}) == 4


def test_a_merge_call_is_traced_per_replica_and_says_so(caplog):
    strategy = kr.ReplicatorStrategy()

    @tf.function
    def step(x):
        def replica_step(x):
            total = tf.distribute.get_replica_context().merge_call(
                lambda s, v: s.reduce("SUM", v, axis=None), args=(tf.reduce_sum(x),))
            return total
        return strategy.run(replica_step, args=(x,))

    batch = next(iter(strategy.experimental_distribute_dataset(_data())))
    with caplog.at_level(logging.INFO, logger="keras_replicator"):
        totals = strategy.experimental_local_results(step(batch))
    expected = float(np.sum(next(iter(_data())).numpy()))
    np.testing.assert_allclose([float(t) for t in totals], [expected] * len(totals), rtol=1e-5)
    assert "traced once per replica, not once for all: the step calls merge_call" in caplog.text


def test_the_switch_is_checked_and_goes_back_to_per_replica_tracing():
    with pytest.raises(TypeError, match="trace_once"):
        kr.ReplicatorStrategy(trace_once="yes")
    traces = []
    strategy = kr.ReplicatorStrategy(trace_once=False)

    @tf.function
    def step(x):
        def replica_step(x):
            traces.append(1)
            return kr.all_reduce(tf.reduce_sum(x), "sum")
        return strategy.run(replica_step, args=(x,))

    batch = next(iter(strategy.experimental_distribute_dataset(_data())))
    totals = strategy.experimental_local_results(step(batch))
    assert len(traces) == 4
    expected = float(np.sum(next(iter(_data())).numpy()))
    np.testing.assert_allclose([float(t) for t in totals], [expected] * 4, rtol=1e-5)


def _replica_function_and_calls(concrete):
    """The traced replica function's nodes and the ops that call it, in a step's graph."""
    graph_def = concrete.graph.as_graph_def()
    library = {f.signature.name: f for f in graph_def.library.function}
    calls = [node for f in [*library.values(), graph_def] for node in getattr(f, "node_def", None) or f.node
             if node.op.endswith("PartitionedCall")
             and any(name in node.attr["f"].func.name for name in ("replica_step", "optimized_step"))]
    names = sorted({call.attr["f"].func.name for call in calls})
    return [node for name in names for node in library[name].node_def], calls


def test_each_replica_call_is_optimised_in_one_round_with_the_users_grappler_options():
    # The replica calls' Grappler settings (those of `grappler_once`'s one run, and of
    # each call where it does not apply): one round of its passes (and no memory
    # optimiser on CPUs) unless the user chose otherwise; every option the user set
    # reaches the calls. A lone all-reduce is one collective with no packing around it.
    strategy = kr.ReplicatorStrategy()
    saved = tf.config.optimizer.get_experimental_options()
    tf.config.optimizer.set_experimental_options({"constant_folding": False})
    try:
        @tf.function
        def step(x):
            def replica_step(x):
                return kr.all_reduce(x * 2.0, "sum")  # [2, 4] on each replica
            return strategy.run(replica_step, args=(x,))

        batch = next(iter(strategy.experimental_distribute_dataset(_data())))
        totals = strategy.experimental_local_results(step(batch))
        nodes, calls = _replica_function_and_calls(step.get_concrete_function(batch))
    finally:
        tf.config.optimizer.set_experimental_options(
            {"constant_folding": saved.get("constant_folding", True)})
    expected = 2.0 * next(iter(_data())).numpy().reshape(4, 2, 4).sum(axis=0)
    for total in totals:
        np.testing.assert_allclose(total.numpy(), expected, rtol=1e-5)
    assert len(calls) == 4
    for call in calls:
        config = tf.compat.v1.ConfigProto.FromString(call.attr["config_proto"].s)
        rewrite = config.graph_options.rewrite_options
        assert rewrite.meta_optimizer_iterations == rewrite.ONE
        assert rewrite.memory_optimization == rewrite.NO_MEM_OPT
        assert rewrite.constant_folding == rewrite.OFF
    ops = [node.op for node in nodes]
    assert ops.count("CollectiveReduceV2") == 1
    assert not {"ConcatV2", "SplitV", "Prod"} & set(ops), ops


def test_indexed_slices_of_uneven_replicas_are_gathered_together():
    # Each replica contributes a different number of rows to two tables of different
    # widths: the rows come back from every replica, in replica order, unsummed (as
    # TensorFlow's all-reduce of IndexedSlices), by 3 all-gathers for both tables.
    strategy = kr.ReplicatorStrategy()
    n = strategy.num_replicas_in_sync

    @tf.function
    def step(x):
        def replica_step(x):
            rid = tf.distribute.get_replica_context().replica_id_in_sync_group
            rows = rid + 1
            a = tf.IndexedSlices(tf.fill([rows, 3], tf.cast(rid + 1, tf.float32)), tf.range(rows), tf.constant([6, 3]))
            b = tf.IndexedSlices(tf.fill([rows, 2], tf.cast(10 * (rid + 1), tf.float32)), rows - 1 - tf.range(rows), tf.constant([5, 2]))
            a_sum, b_sum = tf.distribute.get_replica_context().all_reduce("sum", [a, b])
            return a_sum.values, a_sum.indices, b_sum.values, b_sum.indices, tf.convert_to_tensor(b_sum)
        return strategy.run(replica_step, args=(x,))

    batch = next(iter(strategy.experimental_distribute_dataset(_data())))
    a_values, a_indices, b_values, b_indices, b_dense = (
        strategy.experimental_local_results(v) for v in step(batch))
    expected_a_indices = np.concatenate([np.arange(r + 1) for r in range(n)])
    expected_b_indices = np.concatenate([np.arange(r, -1, -1) for r in range(n)])
    expected_a_values = np.concatenate([np.full([r + 1, 3], r + 1.0) for r in range(n)])
    expected_b_values = np.concatenate([np.full([r + 1, 2], 10.0 * (r + 1)) for r in range(n)])
    dense_b = np.zeros([5, 2])
    np.add.at(dense_b, expected_b_indices, expected_b_values)
    for d in range(n):
        np.testing.assert_array_equal(a_indices[d].numpy(), expected_a_indices)
        np.testing.assert_array_equal(b_indices[d].numpy(), expected_b_indices)
        np.testing.assert_array_equal(a_values[d].numpy(), expected_a_values)
        np.testing.assert_array_equal(b_values[d].numpy(), expected_b_values)
        np.testing.assert_array_equal(b_dense[d].numpy(), dense_b)
    nodes, _ = _replica_function_and_calls(step.get_concrete_function(batch))
    ops = [node.op for node in nodes]
    assert ops.count("CollectiveGatherV2") == 3, ops.count("CollectiveGatherV2")
    assert "If" not in ops and "StatelessIf" not in ops


# A step that fails on one replica is cancelled with the other replicas' collective
# key counters ahead of its own; the next step must still run. In a fresh process,
# so that a hang (collectives have no timeout) fails this test, not the suite.
_AFTER_FAILED_STEPS = """
import json
import tensorflow as tf

strategy = kr.ReplicatorStrategy([f"/cpu:{i}" for i in range(4)])
counters = [launcher._executions for launcher in strategy.extended._kr_collectives()._launchers]

@tf.function
def step(x):
    def replica_step(x):
        x = tf.debugging.check_numerics(x, "replica input")
        ctx = tf.distribute.get_replica_context()
        return ctx.all_reduce("sum", tf.reduce_sum(x)), ctx.all_reduce("mean", x)
    return strategy.run(replica_step, args=(x,))

def values(bad_replica=None):
    def value(ctx):
        r = ctx.replica_id_in_sync_group
        return tf.constant([float("nan") if r == bad_replica else r + 1.0, 1.0])
    return strategy.experimental_distribute_values_from_function(value)

def good_step():
    sums, means = step(values())
    return ([float(s) for s in strategy.experimental_local_results(sums)],
            [m.numpy().tolist() for m in strategy.experimental_local_results(means)])

out = {"first": good_step()}
counters[3].assign_add(5)  # the state a failed step can leave: one replica behind
out["skewed"] = [int(c.numpy()) for c in counters]
out["after_skew"] = good_step()
out["aligned"] = [int(c.numpy()) for c in counters]
failures = []
for _ in range(6):
    try:
        step(values(bad_replica=3))
        failures.append(None)
    except tf.errors.InvalidArgumentError as e:
        failures.append("replica input" in str(e))
    out.setdefault("after_failures", []).append(good_step())
out["failures"] = failures
print("RESULT " + json.dumps(out))
"""


def test_a_step_after_a_failed_step_runs_with_every_replicas_keys_aligned():
    try:
        result = run_python(_AFTER_FAILED_STEPS, devices=4, timeout=400)  # a hang, not a slow import
    except subprocess.TimeoutExpired:
        pytest.fail("a step after a failed one (or after skewed key counters) hung in its collectives")
    assert result.returncode == 0, result.stderr[-3000:]
    line = [out for out in result.stdout.splitlines() if out.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT "):])
    expected = ([1.0 + 2 + 3 + 4 + 4] * 4, [[2.5, 1.0]] * 4)
    assert out["first"] == list(map(list, expected))
    assert len(set(out["skewed"])) == 2  # the skew was there before the step
    assert out["after_skew"] == list(map(list, expected))
    assert len(set(out["aligned"])) == 1 and out["aligned"][0] > max(out["skewed"])
    assert out["failures"] == [True] * 6
    assert out["after_failures"] == [list(map(list, expected))] * 6


def test_an_only_first_replica_update_is_sent_only_where_replicas_may_differ():
    # Spectral normalization's way: `u` (ONLY_FIRST_REPLICA) is updated from mirrored
    # variables only, so every replica already holds replica 0's value and nothing is
    # sent. An update from the replica's data or its id is replica 0's, sent by a collective.
    strategy = kr.ReplicatorStrategy()
    first = tf.VariableAggregation.ONLY_FIRST_REPLICA
    with strategy.scope():
        w = tf.Variable([[1.0, 2.0], [3.0, 4.0]])
        from_weights = tf.Variable([1.0, 0.0], aggregation=first)
        from_data = tf.Variable(tf.zeros([4]), aggregation=first)
        from_id = tf.Variable(0.0, aggregation=first)

    @tf.function
    def step(x):
        def replica_step(x):
            u = tf.linalg.matvec(w, from_weights)
            from_weights.assign(u / tf.norm(u))
            from_data.assign(x[0])
            from_id.assign(tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32) + 1.0)
            return tf.zeros([])
        return strategy.run(replica_step, args=(x,))

    batch = next(iter(strategy.experimental_distribute_dataset(_data())))
    step(batch)
    first_rows = next(iter(_data())).numpy()[0]
    for component in from_weights.values:
        np.testing.assert_allclose(component.numpy(), np.array([1.0, 3.0]) / np.sqrt(10.0), rtol=1e-6)
    for component in from_data.values:
        np.testing.assert_array_equal(component.numpy(), first_rows)
    assert [float(c.numpy()) for c in from_id.values] == [1.0] * 4
    nodes, _ = _replica_function_and_calls(step.get_concrete_function(batch))
    assert [node.op for node in nodes].count("CollectiveReduceV2") == 2
