"""ReplicatorStrategy construction, devices and arguments."""

import pytest
import tensorflow as tf

import keras_replicator as kr


def test_is_a_tf_distribute_strategy_over_all_simulated_devices():
    strategy = kr.ReplicatorStrategy()
    assert isinstance(strategy, tf.distribute.Strategy)
    assert not isinstance(strategy, tf.distribute.MirroredStrategy)  # not a thin alias
    assert strategy.num_replicas_in_sync == 4
    assert [d.split("/")[-1] for d in strategy.devices] == [f"device:CPU:{i}" for i in range(4)]
    assert "num_replicas=4" in repr(strategy)


def test_explicit_devices_like_mirrored_strategy():
    assert kr.ReplicatorStrategy(["/cpu:0", "/cpu:2"]).num_replicas_in_sync == 2
    assert kr.ReplicatorStrategy("/cpu:1").num_replicas_in_sync == 1
    logical = tf.config.list_logical_devices("CPU")[:3]
    assert kr.ReplicatorStrategy(logical).num_replicas_in_sync == 3


@pytest.mark.parametrize(
    "devices, error, match",
    [
        ([], ValueError, "empty"),
        (["/cpu:0", "/cpu:0"], ValueError, "duplicates"),
        (["/cpu:0", "/gpu:0"], ValueError, "does not exist"),
        (["/cpu:9"], ValueError, "simulate_devices"),
        ([0, 1], TypeError, "string"),
        (3, TypeError, "list of device names"),
    ],
)
def test_bad_devices_give_clear_errors(devices, error, match):
    with pytest.raises(error, match=match):
        kr.ReplicatorStrategy(devices)


def test_bad_cross_device_ops():
    with pytest.raises(TypeError, match="CrossDeviceOps"):
        kr.ReplicatorStrategy(cross_device_ops="nccl")


@pytest.mark.parametrize(
    "ops", [tf.distribute.ReductionToOneDevice(), tf.distribute.HierarchicalCopyAllReduce()]
)
def test_user_cross_device_ops_are_used(ops):
    strategy = kr.ReplicatorStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=ops)

    @tf.function
    def step():
        return strategy.run(lambda: kr.all_reduce(tf.cast(kr.replica_id(), tf.float32) + 1.0))

    assert [float(v) for v in strategy.experimental_local_results(step())] == [3.0, 3.0]


def test_many_strategies_in_one_process_do_not_collide():
    # Collective group keys are per instance: strategies over different device
    # sets, used alternately, must not hang or mix up their groups.
    s2 = kr.ReplicatorStrategy(["/cpu:0", "/cpu:1"])
    s4 = kr.ReplicatorStrategy()
    for strategy, expected in [(s2, 2.0), (s4, 4.0), (s2, 2.0)]:

        @tf.function
        def step(strategy=strategy):
            return strategy.run(lambda: kr.all_reduce(tf.constant(1.0)))

        assert float(strategy.experimental_local_results(step())[0]) == expected


def test_simulate_devices_is_idempotent_and_validates():
    assert kr.simulate_devices(4) == [f"/device:CPU:{i}" for i in range(4)]
    for bad in (0, -1, 2.0, True, "4"):
        with pytest.raises(ValueError, match="positive integer"):
            kr.simulate_devices(bad)


def test_simulate_devices_too_late_is_a_clear_error():
    with pytest.raises(kr.DeviceConfigurationError, match="before creating tensors"):
        kr.simulate_devices(2)
