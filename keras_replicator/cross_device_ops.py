"""All-reduce implementations for one machine: `PackedReductionToOneDevice`.

`ReplicatorStrategy` picks `default_cross_device_ops(devices)` when given no
`cross_device_ops`; both are public so that a user can pass or compare them.

Example:
    ```python
    import keras_replicator as kr

    kr.simulate_devices(2)
    strategy = kr.ReplicatorStrategy(cross_device_ops=kr.PackedReductionToOneDevice())
    ```
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from keras_replicator._compat import distributed_values

__all__ = ["PackedReductionToOneDevice", "default_cross_device_ops"]

# Tensors at least this large are summed by a tree of pairwise adds spread over
# the replicas' devices; smaller ones by one add_n (fewer ops). Measured on 4
# simulated CPU devices (benchmarks/): the tree wins from ~32 MB on.
_TREE_SUM_MIN_BYTES = 32 * 2**20


def _sum_on_host(values: Sequence[tf.Tensor]) -> tf.Tensor:
    """Sums one tensor per replica: the accumulation of the default CPU all-reduce."""
    values = list(values)
    size = values[0].shape.num_elements()
    if len(values) < 3 or size is None or size * values[0].dtype.size < _TREE_SUM_MIN_BYTES:
        return tf.math.add_n(values)
    while len(values) > 1:
        pairs = []
        for left, right in zip(values[0::2], values[1::2]):
            with tf.device(left.device):
                pairs.append(left + right)
        values = pairs + values[2 * len(pairs):]
    return values[0]


# Tensors smaller than this are packed together (see PackedReductionToOneDevice);
# larger ones are reduced alone, where the copy into a pack would cost more than
# the ops it saves.
_PACK_MAX_BYTES = 2**20


class PackedReductionToOneDevice(tf.distribute.ReductionToOneDevice):
    """`ReductionToOneDevice` that reduces a batch of small tensors as one.

    A batch reduction (a model's gradients, a nest given to
    `kr.all_reduce`) of many small tensors is dominated by
    per-tensor costs: for each tensor, a transfer from every replica's device to
    the reducing one, an add, and a transfer back. This class flattens and
    concatenates the small dense tensors of a batch on each replica's device,
    reduces that one tensor, and splits the result on each destination device,
    so those costs are paid once per batch. Tensors of 1 MB or more (where the
    copy into the pack would cost more than it saves), sparse values and tensors
    of unknown shape are reduced one by one, as `ReductionToOneDevice` does.
    Results are the same sums, in the same order of addition: bitwise those of
    `ReductionToOneDevice`.

    Example:
        ```python
        strategy = kr.ReplicatorStrategy(
            cross_device_ops=kr.PackedReductionToOneDevice())
        ```
    """

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        results: list = [None] * len(value_destination_pairs)
        packs: dict[tuple, list[int]] = {}
        for i, (value, destinations) in enumerate(value_destination_pairs):
            key = self._pack_key(value, destinations)
            # A value that cannot be packed is a pack of its own.
            packs.setdefault(("alone", i) if key is None else key, []).append(i)
        for members in packs.values():
            if len(members) == 1:
                value, destinations = value_destination_pairs[members[0]]
                results[members[0]] = self.reduce_implementation(
                    reduce_op, value, destinations, options)
                continue
            values = [value_destination_pairs[i][0] for i in members]
            shapes = [v.values[0].shape for v in values]
            sizes = [s.num_elements() for s in shapes]
            flat = []
            for replica_values in zip(*(v.values for v in values)):
                with tf.device(replica_values[0].device):
                    flat.append(tf.concat([tf.reshape(t, [-1]) for t in replica_values], 0))
            reduced = self.reduce_implementation(
                reduce_op, distributed_values.per_replica(flat),
                value_destination_pairs[members[0]][1], options)
            # One destination device gives a plain tensor, several a Mirrored value.
            per_device = reduced.values if isinstance(reduced, tf.distribute.DistributedValues) else [reduced]
            parts_per_device = []
            for packed in per_device:
                with tf.device(packed.device):
                    parts_per_device.append([
                        tf.reshape(part, shape)
                        for part, shape in zip(tf.split(packed, sizes), shapes)
                    ])
            for j, i in enumerate(members):
                results[i] = distributed_values.mirrored([parts[j] for parts in parts_per_device])
        return results

    @staticmethod
    def _pack_key(value, destinations) -> tuple | None:
        """What a value must share with others to be packed with them, or None."""
        if not isinstance(value, tf.distribute.DistributedValues):
            return None
        tensors = value.values
        if len(tensors) < 2 or not all(isinstance(t, tf.Tensor) for t in tensors):
            return None  # IndexedSlices, or nothing to reduce
        shape = tensors[0].shape
        if not shape.is_fully_defined() or any(t.shape != shape for t in tensors):
            return None
        if shape.num_elements() * tensors[0].dtype.size >= _PACK_MAX_BYTES:
            return None
        return (tensors[0].dtype, tuple(t.device for t in tensors),
                distributed_values.devices_of(destinations))


def default_cross_device_ops(devices: Sequence[str] | None) -> tf.distribute.CrossDeviceOps | None:
    """The all-reduce a one-machine `ReplicatorStrategy` uses when given none.

    CPU devices of one process (e.g. from `kr.simulate_devices`)
    share memory, and TensorFlow hands a tensor from one to another without a
    copy, so summing on the first device and giving every replica the result
    (`ReductionToOneDevice`, with `_sum_on_host`) beats TensorFlow's
    default there, a collective ring, in bandwidth (the all-reduce table of
    `docs/performance.md`, from `benchmarks/results/benchmarks.md`). Batches of small tensors (a
    model's gradients) are packed into one reduction
    (`PackedReductionToOneDevice`). Anything else (GPUs, mixed or
    remote devices) returns `None`: TensorFlow's choice, NCCL on GPUs.
    """
    specs = [tf.DeviceSpec.from_string(d) for d in devices or ()]
    if specs and all(
        (s.device_type or "").upper() == "CPU" and s.job in (None, "localhost") for s in specs
    ):
        return PackedReductionToOneDevice(accumulation_fn=_sum_on_host)
    return None
