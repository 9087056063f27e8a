"""Behaviour that needs a fresh TensorFlow: default devices with no simulation."""

import pytest

from tests.helpers import run_python

pytestmark = pytest.mark.devices(1)


def test_default_is_the_one_cpu_without_simulation():
    import keras_replicator as kr

    strategy = kr.ReplicatorStrategy()
    assert strategy.num_replicas_in_sync == 1
    assert kr.local_devices() == ["/device:CPU:0"]


def test_simulate_devices_then_default_strategy_in_a_fresh_interpreter():
    result = run_python(
        """
        import keras_replicator as kr
        kr.simulate_devices(3)
        print(kr.ReplicatorStrategy().num_replicas_in_sync)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "3"


def test_too_late_message_in_a_fresh_interpreter():
    result = run_python(
        """
        import tensorflow as tf
        import keras_replicator as kr
        tf.constant(1.0)            # starts TensorFlow
        kr.simulate_devices(2)
        """
    )
    assert result.returncode != 0
    assert "DeviceConfigurationError" in result.stderr
    assert "simulate_devices(2) was called after TensorFlow initialised" in result.stderr
