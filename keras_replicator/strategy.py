"""``ReplicatorStrategy``: a ``tf.distribute.Strategy`` that makes Keras 3 replicate.

A researcher writes ordinary Keras code under ``strategy.scope()``; ``fit``,
``evaluate`` and ``predict`` then run data-parallel over every local device. The
replication engine is TensorFlow's own (``MirroredExtended``: one thread per
replica tracing into one graph, collective or reduction-to-one-device all-reduces).
What this module adds is what Keras 3 needs from it and does not get from the
stock strategies (see ``_tf_internal`` for the details):

* ``steps_per_execution > 1`` with 2+ replicas works (keras-team/keras#19246);
* every strategy instance gets its own collective keys, so several strategies
  over different devices can live in one process (tests, notebooks);
* the defaults a laptop user expects: every GPU, else every logical CPU device.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import tensorflow as tf

from keras_replicator import _tf_internal, cluster

# Each strategy instance gets a disjoint range of collective group keys. Workers
# of one job create their strategies in the same order, so they agree.
_COLLECTIVE_KEY_STRIDE = 100_000
_instance_counter = itertools.count(1)


def _normalise_devices(devices) -> list[str]:
    if devices is None:
        return cluster.local_devices()
    if isinstance(devices, str):
        devices = [devices]
    try:
        devices = list(devices)
    except TypeError:
        raise TypeError(
            f"devices must be a list of device names such as ['/gpu:0', '/gpu:1'], got {devices!r}"
        ) from None
    if not devices:
        raise ValueError("devices is empty: give at least one device, or None for all local devices.")
    names = []
    for d in devices:
        if isinstance(d, tf.config.LogicalDevice):
            d = d.name
        if not isinstance(d, str):
            raise TypeError(f"Each device must be a string such as '/gpu:0', got {d!r}.")
        names.append(d)
    specs = [tf.DeviceSpec.from_string(d) for d in names]
    if len({s.to_string() for s in specs}) != len(specs):
        raise ValueError(f"devices has duplicates: {names}")
    local = tf.config.list_logical_devices()
    known = {(s.device_type, s.device_index) for s in (tf.DeviceSpec.from_string(d.name) for d in local)}
    for name, spec in zip(names, specs):
        if spec.job not in (None, "localhost"):
            continue  # a remote device: checked when the cluster connects
        if (spec.device_type or "").upper() not in ("CPU", "GPU", "TPU"):
            raise ValueError(f"Device {name!r} names no device type; write e.g. '/gpu:0'.")
        if (spec.device_type.upper(), spec.device_index or 0) not in known:
            raise ValueError(
                f"Device {name!r} does not exist here. Local devices: {[d.name for d in local]}. "
                "On a CPU-only machine, call kr.simulate_devices(n) first to get n CPU devices."
            )
    return names


class ReplicatorExtended(_tf_internal.MirroredExtended):
    """Single-worker replication engine: ``MirroredExtended`` made safe for Keras 3."""

    def _make_collective_ops_with_fallbacks(self):
        return _tf_internal.make_control_flow_safe(super()._make_collective_ops_with_fallbacks())

    def _initialize_strategy(self, devices):
        super()._initialize_strategy(devices)
        # A user-given CollectiveAllReduce needs the same fix as the default one.
        _tf_internal.make_control_flow_safe(self._cross_device_ops)


class ReplicatorStrategy(_tf_internal.StrategyBase):
    """Synchronous data-parallel replication for Keras 3 (the TF-Replicator model).

    Each replica runs the same step on its slice of the global batch; gradients
    are all-reduced, so every replica keeps identical weights. Use it as any
    ``tf.distribute.Strategy``: build and compile the model under ``scope()``,
    then ``fit`` as usual, or drive ``run`` from a custom ``tf.function`` loop.

    Example:
        ```python
        import keras, numpy as np
        import keras_replicator as kr

        kr.simulate_devices(2)                  # a CPU-only machine: 2 replicas
        strategy = kr.ReplicatorStrategy()
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile("sgd", "mse", steps_per_execution=4)
        model.fit(np.ones((64, 4)), np.ones((64, 1)), batch_size=16, verbose=0)
        ```

    Args:
        devices: the devices to replicate over, as for
            ``tf.distribute.MirroredStrategy``: device names such as
            ``["/gpu:0", "/gpu:1"]``. ``None`` takes every local GPU, else every
            logical CPU device (see :func:`keras_replicator.simulate_devices`).
        cross_device_ops: a ``tf.distribute.CrossDeviceOps`` to use for
            all-reduces (e.g. ``tf.distribute.NcclAllReduce()``,
            ``tf.distribute.ReductionToOneDevice()``). ``None`` lets TensorFlow
            choose: NCCL on GPUs, collective ring on CPUs.
    """

    def __init__(
        self,
        devices: Sequence[str] | None = None,
        *,
        cross_device_ops: tf.distribute.CrossDeviceOps | None = None,
    ):
        if cross_device_ops is not None and not isinstance(
            cross_device_ops, tf.distribute.CrossDeviceOps
        ):
            raise TypeError(
                "cross_device_ops must be a tf.distribute.CrossDeviceOps such as "
                f"tf.distribute.ReductionToOneDevice(), got {cross_device_ops!r}."
            )
        device_names = _normalise_devices(devices)
        # Read by MirroredExtended.__init__; must be set before it runs.
        self._collective_key_base = next(_instance_counter) * _COLLECTIVE_KEY_STRIDE
        extended = ReplicatorExtended(self, devices=device_names, cross_device_ops=cross_device_ops)
        super().__init__(extended)
        _tf_internal.install_keras_patches()

    # Marks the strategies whose Keras integration keras_replicator handles.
    _keras_replicator = True

    @property
    def devices(self) -> tuple[str, ...]:
        """The devices of the local replicas, in replica order."""
        return tuple(self.extended.worker_devices)

    def __repr__(self) -> str:
        return f"ReplicatorStrategy(num_replicas={self.num_replicas_in_sync}, devices={list(self.devices)})"
