"""Where am I: local devices and simulated CPU replicas.

The multi-worker resolvers (``TF_CONFIG``, Slurm, explicit) also live here.
"""

from __future__ import annotations

import tensorflow as tf

from keras_replicator import _tf_internal


class DeviceConfigurationError(RuntimeError):
    """Raised when devices can no longer be configured (TensorFlow already started)."""


def simulate_devices(n: int) -> list[str]:
    """Splits the host CPU into ``n`` logical devices, so replication runs without GPUs.

    Call it at the top of a program, before anything makes TensorFlow create its
    runtime (building a tensor, a model, a strategy, or listing logical devices).
    Calling it again with the same ``n`` is harmless.

    Example:
        ```python
        import keras_replicator as kr
        kr.simulate_devices(4)
        strategy = kr.ReplicatorStrategy()   # 4 replicas on /device:CPU:0..3
        ```

    Args:
        n: number of logical CPU devices, >= 1.

    Returns:
        The names of the logical CPU devices, e.g. ``["/device:CPU:0", ...]``.

    Raises:
        ValueError: ``n`` is not a positive integer.
        DeviceConfigurationError: TensorFlow was already initialised with a
            different number of CPU devices.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"simulate_devices(n) needs a positive integer, got {n!r}.")
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if _tf_internal.tensorflow_initialized():
        have = len(current) if current else 1
        if have != n:
            raise DeviceConfigurationError(
                f"simulate_devices({n}) was called after TensorFlow initialised its devices "
                f"(it has {have} CPU device(s)). Call kr.simulate_devices() first thing in the "
                "program, before creating tensors, models or strategies; in tests, run each "
                "device count in a fresh interpreter."
            )
    elif not current or len(current) != n:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)]
        )
    return [f"/device:CPU:{i}" for i in range(n)]


def local_devices() -> list[str]:
    """The devices a local ``ReplicatorStrategy`` uses by default.

    Every local GPU if there is one, else every logical CPU device (one, unless
    :func:`simulate_devices` split it).

    Example:
        ```python
        import keras_replicator as kr
        print(kr.local_devices())   # ['/device:CPU:0'] on a laptop
        ```
    """
    gpus = tf.config.list_logical_devices("GPU")
    if gpus:
        return [d.name for d in gpus]
    return [d.name for d in tf.config.list_logical_devices("CPU")]

