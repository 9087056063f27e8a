"""ReplicatorStrategy's default cross-device reduction (chosen from the benchmarks)."""

import logging

import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from keras_replicator import cross_device_ops as cdo_module
from keras_replicator._compat.engines import tf_cross_device_ops  # TF's CollectiveAllReduce


def test_cpu_devices_get_a_packed_reduction_to_one_device():
    strategy = kr.ReplicatorStrategy()
    ops = strategy.extended.cross_device_ops
    assert isinstance(ops, cdo_module.PackedReductionToOneDevice)
    assert ops.accumulation_fn is cdo_module._sum_on_host


def test_choice_by_topology():
    choose = cdo_module.default_cross_device_ops
    assert isinstance(choose(["/cpu:0", "/cpu:1"]), tf.distribute.ReductionToOneDevice)
    assert isinstance(choose(["/device:CPU:0"]), tf.distribute.ReductionToOneDevice)
    assert choose(["/gpu:0", "/gpu:1"]) is None  # TensorFlow's choice: NCCL
    assert choose(["/cpu:0", "/gpu:0"]) is None
    assert choose(["/job:worker/task:1/device:CPU:0"]) is None
    assert choose(None) is None


def test_explicit_choices_are_kept():
    ring = kr.ReplicatorStrategy(communication="ring")
    assert isinstance(ring.extended.cross_device_ops, tf_cross_device_ops.CollectiveAllReduce)
    hierarchical = tf.distribute.HierarchicalCopyAllReduce()
    assert kr.ReplicatorStrategy(cross_device_ops=hierarchical).extended.cross_device_ops is hierarchical


@pytest.mark.parametrize("replicas", [2, 3, 4])
@pytest.mark.parametrize("tree", [False, True], ids=["add_n", "tree"])
def test_sums_and_means_are_exact_and_identical(monkeypatch, replicas, tree):
    if tree:  # the pairwise tree normally starts at 32 MB
        monkeypatch.setattr(cdo_module, "_TREE_SUM_MIN_BYTES", 0)
    strategy = kr.ReplicatorStrategy([f"/cpu:{i}" for i in range(replicas)])

    @tf.function
    def step():
        def replica_fn():
            x = tf.cast(kr.replica_id() + 1, tf.float32) * tf.ones([1000])
            return kr.all_reduce(x, "sum"), kr.all_reduce({"m": x}, "mean")["m"]

        return strategy.run(replica_fn)

    sums, means = step()
    total = replicas * (replicas + 1) / 2
    for s, m in zip(strategy.experimental_local_results(sums), strategy.experimental_local_results(means)):
        np.testing.assert_array_equal(s.numpy(), np.full(1000, total, np.float32))
        np.testing.assert_allclose(m.numpy(), total / replicas, rtol=1e-6)


def test_steps_per_execution_works_with_the_default():
    import keras

    from tests.helpers import conv_model, image_data

    x, y = image_data(64)
    strategy = kr.ReplicatorStrategy()
    with strategy.scope():
        model = conv_model()
        model.compile(keras.optimizers.Adam(1e-3),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=4)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 8
    kr.testing.assert_replicas_identical(model)


def _packed_strategy():
    # Chosen, so that steps all-reduce with it (by default a step traced once
    # all-reduces with each device's collective launcher).
    return kr.ReplicatorStrategy(cross_device_ops=kr.PackedReductionToOneDevice(
        accumulation_fn=cdo_module._sum_on_host))


def _unpacked_strategy():
    return kr.ReplicatorStrategy(cross_device_ops=tf.distribute.ReductionToOneDevice(
        accumulation_fn=cdo_module._sum_on_host))


def _mixed_batch(replica: int) -> dict:
    """A nest with everything a batch reduction can hold, different on every replica."""
    rng = np.random.default_rng(replica)
    return {
        "kernel": rng.normal(size=[2, 3, 4]).astype(np.float32),
        "bias": rng.normal(size=[5]).astype(np.float32),
        "scalar": np.float32(rng.normal()),
        "large": rng.normal(size=[300]).astype(np.float32),
        "float64": rng.normal(size=[3]),
        "empty": np.zeros([0, 3], np.float32),
    }


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_packed_batch_reduction_is_bitwise_the_unpacked_one(monkeypatch, op):
    # "large" (1200 bytes) is over the pack limit here, so it is reduced alone.
    monkeypatch.setattr(cdo_module, "_PACK_MAX_BYTES", 1024)
    packed, unpacked = _packed_strategy(), _unpacked_strategy()
    ops = packed.extended.cross_device_ops
    calls = []
    single = ops.reduce_implementation
    monkeypatch.setattr(ops, "reduce_implementation",
                        lambda *a, **k: calls.append(a[1]) or single(*a, **k))

    def reduce_with(strategy):
        # Function inputs, not constants: nothing is folded before the reduction.
        inputs = strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.nest.map_structure(tf.constant, _mixed_batch(ctx.replica_id_in_sync_group)))

        @tf.function
        def step(inputs):
            return strategy.run(lambda x: kr.all_reduce(x, op), args=(inputs,))
        return step(inputs)

    got, want = reduce_with(packed), reduce_with(unpacked)
    n = packed.num_replicas_in_sync
    for key in want:
        expected = sum(_mixed_batch(r)[key] for r in range(n))
        if op == "mean":
            expected = expected / n
        for g, w in zip(packed.experimental_local_results(got[key]),
                        unpacked.experimental_local_results(want[key])):
            assert g.dtype == w.dtype and g.shape == w.shape, key
            np.testing.assert_array_equal(g.numpy(), w.numpy(), err_msg=key)
            np.testing.assert_allclose(g.numpy(), expected, rtol=1e-6, err_msg=key)
    # One reduction for the float32 pack (kernel, bias, scalar, empty), one each
    # for the large tensor and for float64, which is alone in its pack.
    shapes = sorted(tuple(v.values[0].shape.as_list()) for v in calls)
    assert shapes == sorted([(24 + 5 + 1 + 0,), (300,), (3,)])


def test_sparse_gradients_are_reduced_alone_and_exactly():
    packed, unpacked = _packed_strategy(), _unpacked_strategy()

    def grads_with(strategy):
        with strategy.scope():
            table = tf.Variable(tf.reshape(tf.range(12, dtype=tf.float32), [6, 2]))
            dense = tf.Variable(tf.ones([2]))

        @tf.function
        def step():
            def replica_fn():
                ids = tf.stack([kr.replica_id(), kr.replica_id() + 1])
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(tf.gather(table, ids) * dense)
                g_table, g_dense = tape.gradient(loss, [table, dense])
                assert isinstance(g_table, tf.IndexedSlices)
                g_table, g_dense = kr.all_reduce([g_table, g_dense], "sum")
                return tf.convert_to_tensor(g_table), g_dense
            return strategy.run(replica_fn)
        return [strategy.experimental_local_results(t) for t in step()]

    got, want = grads_with(packed), grads_with(unpacked)
    for g_list, w_list in zip(got, want):
        for g, w in zip(g_list, w_list):
            np.testing.assert_array_equal(g.numpy(), w.numpy())
    n = packed.num_replicas_in_sync
    expected = np.zeros([6, 2], np.float32)
    for r in range(n):
        expected[r] += 1.0
        expected[r + 1] += 1.0
    np.testing.assert_array_equal(got[0][0].numpy(), expected)


def test_training_with_packing_is_bitwise_training_without():
    import keras

    from tests.helpers import conv_model, image_data

    x, y = image_data(64)
    weights = []
    for strategy in (_packed_strategy(), _unpacked_strategy()):
        with strategy.scope():
            model = conv_model()
            model.compile(keras.optimizers.SGD(0.1, momentum=0.9),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        kr.testing.assert_replicas_identical(model)
        weights.append(model.get_weights())
    for packed, unpacked in zip(*weights):
        np.testing.assert_array_equal(packed, unpacked)


def test_packed_batch_reduction_to_one_device_gives_plain_tensors():
    strategy = kr.ReplicatorStrategy()
    n = strategy.num_replicas_in_sync
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: (tf.fill([3], float(ctx.replica_id_in_sync_group)), tf.ones([2, 2])))
    total, count = strategy.extended.batch_reduce_to(
        "SUM", [(values[0], "/cpu:0"), (values[1], "/cpu:0")])
    assert isinstance(total, tf.Tensor) and isinstance(count, tf.Tensor)
    assert tf.DeviceSpec.from_string(total.device).device_index == 0
    np.testing.assert_array_equal(total.numpy(), np.full([3], n * (n - 1) / 2))
    np.testing.assert_array_equal(count.numpy(), np.full([2, 2], n))


class _CountingReduction(tf.distribute.ReductionToOneDevice):
    """ReductionToOneDevice that counts the reductions it is asked for (once per trace)."""

    calls = 0

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        type(self).calls += 1
        return super().reduce_implementation(reduce_op, per_replica_value, destinations, options)

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        type(self).calls += 1
        return super().batch_reduce_implementation(reduce_op, value_destination_pairs, options)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append((record.levelname, record.getMessage()))


def _startup_lines(make):
    logger = logging.getLogger("keras_replicator")
    handler = _Lines()
    logger.addHandler(handler)
    try:
        strategy = make()
    finally:
        logger.removeHandler(handler)
    return strategy, handler.lines


def test_mirrored_strategys_positional_arguments_are_accepted():
    # tf.distribute.MirroredStrategy(devices, cross_device_ops), as a migrating user writes it.
    devices = ["/cpu:0", "/cpu:1"]
    ops = tf.distribute.ReductionToOneDevice()
    strategy = kr.ReplicatorStrategy(devices, ops)
    assert strategy.num_replicas_in_sync == 2 and strategy.extended.cross_device_ops is ops
    with pytest.raises(TypeError, match="positional"):
        kr.ReplicatorStrategy(devices, ops, None)  # the other arguments stay keyword-only


def test_a_non_collective_cross_device_ops_is_honoured_in_steps_and_said():
    _CountingReduction.calls = 0
    strategy, lines = _startup_lines(lambda: kr.ReplicatorStrategy(cross_device_ops=_CountingReduction()))
    warnings = [text for level, text in lines if level == "WARNING"]
    assert len(warnings) == 1 and "_CountingReduction() is not a collective all-reduce" in warnings[0]
    assert "traced once per replica" in warnings[0], warnings
    announced = [text for level, text in lines if level == "INFO"]
    assert announced and announced[0].endswith(
        "all-reduce: _CountingReduction (in steps too: steps traced per replica)"), announced

    @tf.function
    def step():
        return strategy.run(lambda: kr.all_reduce(tf.cast(kr.replica_id() + 1, tf.float32), "sum"))

    sums = strategy.experimental_local_results(step())
    assert [float(s) for s in sums] == [10.0] * 4  # 1 + 2 + 3 + 4 on every replica
    assert _CountingReduction.calls >= 1  # the user's reduction did the step's all-reduce


def test_the_default_and_a_collective_choice_say_nothing_more():
    _, lines = _startup_lines(lambda: kr.ReplicatorStrategy())
    assert [level for level, _ in lines] == ["INFO"], lines
    _, lines = _startup_lines(lambda: kr.ReplicatorStrategy(communication="ring"))
    assert [level for level, _ in lines] == ["INFO"], lines
    _, lines = _startup_lines(lambda: kr.ReplicatorStrategy(cross_device_ops=_CountingReduction(),
                                                            trace_once=False))
    assert [level for level, _ in lines] == ["INFO"], lines  # per replica was asked for


def test_bad_strategy_arguments_are_argument_errors():
    with pytest.raises(kr.errors.ArgumentError, match="variable_partitioner must be"):
        kr.AsyncReplicatorStrategy(variable_partitioner=3)
    with pytest.raises(kr.errors.ArgumentError, match="cross_device_ops must be"):
        kr.ReplicatorStrategy(cross_device_ops="nccl")
    with pytest.raises(kr.errors.ArgumentError, match="Each device must be a string"):
        kr.ReplicatorStrategy([0, 1])
    with pytest.raises(kr.errors.ArgumentError, match="does not exist here"):
        kr.ReplicatorStrategy(["/gpu:7"])
