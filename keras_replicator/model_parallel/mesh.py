"""The device grid of a model-parallel job: M replicas, each spanning k logical devices.

TF-Replicator's design (tensorflow/community `rfcs/20181016-replicator.md`): "When
using model parallelism, a replica will span several physical devices"; with M
replicas of k devices each there are k *logical devices*, the same index naming the
same role in every replica. Replica `r`'s logical device `j` is the local device
`r * k + j`: a replica's devices are adjacent (on GPUs, the ones most likely to share
a fast link), and logical device 0 of every replica is where its inputs arrive.

This module only names devices; it starts no TensorFlow.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from keras_replicator._validation import ArgumentError, check_int

__all__ = ["ReplicaMesh"]


@dataclass(frozen=True)
class ReplicaMesh:
    """M replicas x k logical devices over one worker's devices.

    Args:
        devices: the worker's devices, in order (`len(devices)` must be a multiple
            of `devices_per_replica`).
        devices_per_replica: k, the logical devices of one replica.

    Example:
        ```python
        from keras_replicator.model_parallel import ReplicaMesh

        mesh = ReplicaMesh(["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"], devices_per_replica=2)
        mesh.num_replicas                  # 2
        mesh.device(1, 0)                  # '/cpu:2': replica 1's logical device 0
        mesh.logical_devices(1)            # ('/cpu:1', '/cpu:3'): logical device 1 of each replica
        mesh.replica_devices(0)            # ('/cpu:0', '/cpu:1')
        ```
    """

    devices: tuple[str, ...]
    devices_per_replica: int = 1

    def __post_init__(self):
        if isinstance(self.devices, str) or not isinstance(self.devices, Sequence):
            raise ArgumentError(f"devices must be a sequence of device names, got {self.devices!r}.")
        object.__setattr__(self, "devices", tuple(self.devices))
        k = check_int("devices_per_replica", self.devices_per_replica, minimum=1)
        n = len(self.devices)
        if n == 0 or n % k:
            raise ArgumentError(
                f"devices_per_replica={k} must divide the number of devices, {n} "
                f"({list(self.devices)}): each replica spans exactly {k} devices."
            )
        if len(set(self.devices)) != n:
            raise ArgumentError(f"devices has duplicates: {list(self.devices)}.")

    @property
    def num_replicas(self) -> int:
        """M, the number of replicas."""
        return len(self.devices) // self.devices_per_replica

    def device(self, replica: int, logical_device: int) -> str:
        """Replica `replica`'s logical device `logical_device`."""
        self._check(replica, logical_device)
        return self.devices[replica * self.devices_per_replica + logical_device]

    def replica_devices(self, replica: int) -> tuple[str, ...]:
        """Replica `replica`'s devices, logical device 0 first."""
        self._check(replica, 0)
        k = self.devices_per_replica
        return self.devices[replica * k:(replica + 1) * k]

    def logical_devices(self, logical_device: int) -> tuple[str, ...]:
        """Logical device `logical_device` of every replica, in replica order."""
        self._check(0, logical_device)
        return self.devices[logical_device::self.devices_per_replica]

    @property
    def input_devices(self) -> tuple[str, ...]:
        """Where each replica's inputs arrive: its logical device 0."""
        return self.logical_devices(0)

    def _check(self, replica: int, logical_device: int) -> None:
        if not 0 <= replica < self.num_replicas:
            raise ArgumentError(f"replica must be in 0..{self.num_replicas - 1}, got {replica}.")
        if not 0 <= logical_device < self.devices_per_replica:
            raise ArgumentError(
                f"logical_device must be in 0..{self.devices_per_replica - 1} "
                f"(devices_per_replica={self.devices_per_replica}), got {logical_device}."
            )
