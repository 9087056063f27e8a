"""Behaviour that needs a fresh TensorFlow: default devices with no simulation."""

import time

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


def test_a_process_that_used_stock_and_ours_exits_promptly():
    """Stock `MirroredStrategy` and `ReplicatorStrategy` in one process: no iterator outlives its
    `fit`, and the process exits (it took minutes: docs/design.md, "Mixing stock and ours").

    The cause, checked without timing: an epoch iterator kept in a reference cycle outlives its
    `fit` with its dataset iterator (gc disabled here, so such a cycle stays visible); a stock
    strategy's tf.data iterators have autotuning threads whose periods double with their age, so
    their late drop (the collector's, or at exit) waited for them. The exit bound (60 s, against
    the 200 s measured) only catches such a hang, not a slow machine.
    """
    result = run_python(
        """
        import gc, time
        import numpy as np, tensorflow as tf, keras

        def model(strategy):
            with strategy.scope():
                m = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3),
                                      keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(3)])
                m.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            return m

        x = np.random.rand(64, 8, 8, 3).astype("float32")
        y = np.random.randint(0, 3, 64)
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).cache().repeat()
        stock = model(tf.distribute.MirroredStrategy())
        ours = model(kr.ReplicatorStrategy())
        gc.disable()
        for name, m in (("stock", stock), ("ours", ours), ("stock", stock), ("ours", ours)):
            m.fit(data, steps_per_epoch=2, epochs=1, verbose=0)
            live = sum(isinstance(o, tf.data.Iterator) for o in gc.get_objects())
            print("live", name, live)
        print("done", time.time(), flush=True)
        """,
        devices=4,
        timeout=600,
    )
    ended = time.time()
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split("\n")
    live = [line for line in lines if line.startswith("live ")]
    assert live == ["live stock 0", "live ours 0", "live stock 0", "live ours 0"], live
    done = float(next(line for line in lines if line.startswith("done ")).split()[1])
    assert ended - done < 60, f"{ended - done:.1f} s from the program's last line to its exit"
