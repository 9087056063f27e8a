"""Building and reading `tf.distribute` values from a custom `CrossDeviceOps`.

Uses: `values.PerReplica`, `distribute_utils.regroup` (a `Mirrored` result) and
`cross_device_ops.get_devices_from`, which have no public equivalent; a
`CrossDeviceOps` subclass must return what TensorFlow's own ones return.
Checked on TensorFlow 2.16-2.21.
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops, distribute_utils
from tensorflow.python.distribute import values as tf_values


def devices_of(destinations) -> tuple[str, ...]:
    """The canonical device strings of a reduction's destinations (a device
    string, a variable, a tensor or distributed values), as TensorFlow's
    cross-device ops compute them."""
    return tuple(cross_device_ops.get_devices_from(destinations))


def per_replica(values: list) -> tf.distribute.DistributedValues:
    """One tensor per replica, wrapped as `PerReplica`."""
    return tf_values.PerReplica(tuple(values))


def mirrored(values: list) -> tf.distribute.DistributedValues:
    """One tensor per device, wrapped as the `Mirrored` value a cross-device reduction returns."""
    return distribute_utils.regroup(values, wrap_class=tf_values.Mirrored)
