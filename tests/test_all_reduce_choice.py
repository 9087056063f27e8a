"""ReplicatorStrategy's default cross-device reduction (chosen from the benchmarks)."""

import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from keras_replicator import _tf_internal
from keras_replicator import strategy as strategy_module


def test_cpu_devices_get_a_reduction_to_one_device():
    strategy = kr.ReplicatorStrategy()
    ops = strategy.extended._cross_device_ops
    assert isinstance(ops, tf.distribute.ReductionToOneDevice)
    assert ops.accumulation_fn is strategy_module._sum_on_host


def test_choice_by_topology():
    choose = strategy_module.default_cross_device_ops
    assert isinstance(choose(["/cpu:0", "/cpu:1"]), tf.distribute.ReductionToOneDevice)
    assert isinstance(choose(["/device:CPU:0"]), tf.distribute.ReductionToOneDevice)
    assert choose(["/gpu:0", "/gpu:1"]) is None  # TensorFlow's choice: NCCL
    assert choose(["/cpu:0", "/gpu:0"]) is None
    assert choose(["/job:worker/task:1/device:CPU:0"]) is None
    assert choose(None) is None


def test_explicit_choices_are_kept():
    ring = kr.ReplicatorStrategy(communication="ring")
    assert isinstance(ring.extended._cross_device_ops, _tf_internal.cross_device_ops.CollectiveAllReduce)
    hierarchical = tf.distribute.HierarchicalCopyAllReduce()
    assert kr.ReplicatorStrategy(cross_device_ops=hierarchical).extended._cross_device_ops is hierarchical


@pytest.mark.parametrize("replicas", [2, 3, 4])
@pytest.mark.parametrize("tree", [False, True], ids=["add_n", "tree"])
def test_sums_and_means_are_exact_and_identical(monkeypatch, replicas, tree):
    if tree:  # the pairwise tree normally starts at 32 MB
        monkeypatch.setattr(strategy_module, "_TREE_SUM_MIN_BYTES", 0)
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
