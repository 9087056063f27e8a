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

When ``TF_CONFIG``, Slurm or a ``cluster_resolver`` describes a cluster of
several workers, the strategy replicates between graphs across them with
TensorFlow's ``CollectiveAllReduceExtended`` (ring over gRPC on CPUs, NCCL on
GPUs), with the same fixes plus what Keras 3 lacks there: ``predict`` returns
every worker's rows, metrics are global, the failure of one worker stops the
others with :class:`~keras_replicator.cluster.WorkerLostError` within
``failure_timeout`` seconds, and checkpoints are written by the chief only.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence

import tensorflow as tf

from keras_replicator import _tf_internal, cluster, data, layers
from keras_replicator._compat import multi_device_iterator
from keras_replicator.layers import batch_normalization  # noqa: F401 (install_batch_norm_guard)

# Each strategy instance gets a disjoint range of collective group keys. Workers
# of one job create their strategies in the same order, so they agree.
_COLLECTIVE_KEY_STRIDE = 100_000
_instance_counter = itertools.count(1)
# The cluster this process joined (its TensorFlow server runs for good): later
# multi-worker strategies of the same cluster reuse it.
_joined_cluster: tuple | None = None

_COMMUNICATION = {
    "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
    "ring": tf.distribute.experimental.CommunicationImplementation.RING,
    "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
}


def _device_strings(devices) -> list[str]:
    """A ``devices=`` argument (a name, or names and LogicalDevices) as a non-empty list of names."""
    names = [devices] if isinstance(devices, str) else devices
    try:
        names = list(names)
    except TypeError:
        raise TypeError(
            f"devices must be a list of device names such as ['/gpu:0', '/gpu:1'], got {devices!r}"
        ) from None
    if not names:
        raise ValueError("devices is empty: give at least one device, or None for all local devices.")
    out = []
    for d in names:
        if isinstance(d, tf.config.LogicalDevice):
            d = d.name
        if not isinstance(d, str):
            raise TypeError(f"Each device must be a string such as '/gpu:0', got {d!r}.")
        out.append(d)
    return out


def _normalise_devices(devices) -> list[str]:
    if devices is None:
        return cluster.local_devices()
    names = _device_strings(devices)
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
    """``ReductionToOneDevice`` that reduces a batch of small tensors as one.

    A batch reduction (a model's gradients, a nest given to
    :func:`~keras_replicator.all_reduce`) of many small tensors is dominated by
    per-tensor costs: for each tensor, a transfer from every replica's device to
    the reducing one, an add, and a transfer back. This class flattens and
    concatenates the small dense tensors of a batch on each replica's device,
    reduces that one tensor, and splits the result on each destination device,
    so those costs are paid once per batch. Tensors of 1 MB or more (where the
    copy into the pack would cost more than it saves), sparse values and tensors
    of unknown shape are reduced one by one, as ``ReductionToOneDevice`` does.
    Results are the same sums, in the same order of addition: bitwise those of
    ``ReductionToOneDevice``.

    Example:
        ```python
        strategy = kr.ReplicatorStrategy(
            cross_device_ops=kr.strategy.PackedReductionToOneDevice())
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
                reduce_op, _tf_internal.per_replica(flat),
                value_destination_pairs[members[0]][1], options)
            # One destination device gives a plain tensor, several a Mirrored value.
            per_device = reduced.values if _tf_internal.is_distributed_values(reduced) else [reduced]
            parts_per_device = []
            for packed in per_device:
                with tf.device(packed.device):
                    parts_per_device.append([
                        tf.reshape(part, shape)
                        for part, shape in zip(tf.split(packed, sizes), shapes)
                    ])
            for j, i in enumerate(members):
                results[i] = _tf_internal.mirrored([parts[j] for parts in parts_per_device])
        return results

    @staticmethod
    def _pack_key(value, destinations) -> tuple | None:
        """What a value must share with others to be packed with them, or None."""
        if not _tf_internal.is_distributed_values(value):
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
                _tf_internal.devices_of(destinations))


def default_cross_device_ops(devices: Sequence[str] | None) -> tf.distribute.CrossDeviceOps | None:
    """The all-reduce a one-machine ``ReplicatorStrategy`` uses when given none.

    CPU devices of one process (e.g. from :func:`~keras_replicator.simulate_devices`)
    share memory, and TensorFlow hands a tensor from one to another without a
    copy, so summing on the first device and giving every replica the result
    (``ReductionToOneDevice``, with :func:`_sum_on_host`) beats TensorFlow's
    default there, a collective ring, by 2-8x in bandwidth (1-64 MB tensors on
    2-4 devices; see ``docs/performance.md``). Batches of small tensors (a
    model's gradients) are packed into one reduction
    (:class:`PackedReductionToOneDevice`). Anything else (GPUs, mixed or
    remote devices) returns ``None``: TensorFlow's choice, NCCL on GPUs.
    """
    specs = [tf.DeviceSpec.from_string(d) for d in devices or ()]
    if specs and all(
        (s.device_type or "").upper() == "CPU" and s.job in (None, "localhost") for s in specs
    ):
        return PackedReductionToOneDevice(accumulation_fn=_sum_on_host)
    return None


class ReplicatorExtended(_tf_internal.MirroredExtended):
    """Single-worker replication engine: ``MirroredExtended`` made safe for Keras 3."""

    def __init__(self, container_strategy, devices=None, cross_device_ops=None, communication=None):
        if cross_device_ops is None and communication is None:
            cross_device_ops = default_cross_device_ops(devices)
        # Read by _make_collective_ops_with_fallbacks during super().__init__.
        self._kr_communication = communication
        super().__init__(container_strategy, devices=devices, cross_device_ops=cross_device_ops)

    def _make_collective_ops_with_fallbacks(self):
        ops_obj = super()._make_collective_ops_with_fallbacks()
        if self._kr_communication is not None and isinstance(
            ops_obj, _tf_internal.cross_device_ops.CollectiveAllReduce
        ):
            # An explicit communication= replaces TensorFlow's choice for the local all-reduce.
            self._communication_options = tf.distribute.experimental.CommunicationOptions(
                implementation=self._kr_communication
            )
            ops_obj = _tf_internal.cross_device_ops.CollectiveAllReduce(
                devices=self._devices,
                group_size=len(self._devices),
                options=self._communication_options,
                collective_keys=self._collective_keys,
            )
        return _tf_internal.make_control_flow_safe(ops_obj)

    def _initialize_strategy(self, devices):
        super()._initialize_strategy(devices)
        # A user-given CollectiveAllReduce needs the same fix as the default one.
        _tf_internal.make_control_flow_safe(self._cross_device_ops)


# TensorFlow's errors when a peer is gone: the coordination service's heartbeat
# timeout (Unavailable), a closed connection in a collective (Unavailable,
# Aborted, Cancelled), a restarted peer (FailedPrecondition), or a timeout.
_PEER_ERRORS = (
    tf.errors.UnavailableError,
    tf.errors.AbortedError,
    tf.errors.CancelledError,
    tf.errors.DeadlineExceededError,
    tf.errors.FailedPreconditionError,
    tf.errors.InternalError,
)
_TASK_IN_MESSAGE = re.compile(r"/job:(\w+)/replica:\d+/task:(\d+)")


def _first_line(error: Exception) -> str:
    """The first line of a TensorFlow error's message, without its function-node prefix."""
    text = re.sub(r"\{\{[^}]*\}\}", "", str(getattr(error, "message", error))).strip()
    return text.splitlines()[0].strip() if text else type(error).__name__


def _tasks_mentioned(error: Exception) -> set[str]:
    return {f"/job:{j}/replica:0/task:{i}" for j, i in _TASK_IN_MESSAGE.findall(str(error))}


def _local_device_names(devices) -> list[str] | None:
    """Checks the form of a multi-worker ``devices=`` argument without starting TensorFlow."""
    if devices is None:
        return None
    names = _device_strings(devices)
    out = []
    for d in names:
        spec = tf.DeviceSpec.from_string(d)
        if spec.job not in (None, "localhost") or spec.task not in (None, 0):
            raise ValueError(
                f"Device {d!r} names a job or task. In a multi-worker job, devices= lists this "
                "worker's local devices, e.g. ['/gpu:0', '/gpu:1']."
            )
        if (spec.device_type or "").upper() not in ("CPU", "GPU"):
            raise ValueError(f"Device {d!r} names no device type; write e.g. '/gpu:0'.")
        out.append(f"/device:{spec.device_type.upper()}:{spec.device_index or 0}")
    if len(set(out)) != len(out):
        raise ValueError(f"devices has duplicates: {names}")
    return out


class ReplicatorMultiWorkerExtended(_tf_internal.CollectiveAllReduceExtended):
    """Multi-worker replication engine: ``CollectiveAllReduceExtended`` made safe for Keras 3.

    Between-graph replication: every worker runs the same program over its local
    devices, and collectives over gRPC join the replicas of all workers. Adds to
    TensorFlow's engine: execution-ordered collective keys (as the local engine),
    every logical local device (not only one CPU), bounded waits at start-up and
    after a failure (the coordination service's timeouts), and naming a lost
    worker when a step fails because of it.
    """

    def __init__(
        self,
        container_strategy,
        cluster_resolver,
        *,
        devices: list[str] | None,
        communication,
        failure_timeout: float,
        startup_timeout: float,
    ):
        self._kr_devices = devices
        self._kr_failure_timeout = failure_timeout
        self._kr_startup_timeout = startup_timeout
        super().__init__(
            container_strategy,
            cluster_resolver=cluster_resolver,
            communication_options=tf.distribute.experimental.CommunicationOptions(
                implementation=communication
            ),
        )
        self._task_names = cluster.task_names(self._cluster_spec)
        self._my_task = f"/job:{self._task_type}/replica:0/task:{self._task_id}"

    def _initialize_multi_worker(self, cluster_resolver):
        global _joined_cluster
        spec = cluster_resolver.cluster_spec()
        me = f"{cluster_resolver.task_type} {cluster_resolver.task_id}"
        key = (repr(sorted(spec.as_dict().items())), cluster_resolver.task_type, cluster_resolver.task_id)
        if _joined_cluster is not None:
            if _joined_cluster != key:
                raise cluster.ClusterStartupError(
                    f"{me}: this process already joined another cluster; a process can be part of "
                    "one cluster only."
                )
            # Same cluster: its server and coordination already run (read by super()).
            self._std_server_started = True
            self._enable_check_health = False
        elif _tf_internal.tensorflow_initialized():
            raise cluster.ClusterStartupError(
                f"{me}: TensorFlow had already started when the multi-worker ReplicatorStrategy was "
                "created. Create the strategy first thing in the program, before any tensor, model "
                "or dataset (kr.simulate_devices may come before it)."
            )
        _tf_internal.configure_coordination_service(
            spec, heartbeat_timeout=self._kr_failure_timeout, startup_timeout=self._kr_startup_timeout
        )
        try:
            super()._initialize_multi_worker(cluster_resolver)
        except (tf.errors.OpError, RuntimeError) as e:
            names = cluster.task_names(spec)
            mine = f"/job:{cluster_resolver.task_type}/replica:0/task:{cluster_resolver.task_id}"
            leader = _tf_internal.coordination_leader(spec)
            silent = sorted(_tasks_mentioned(e) - {mine})
            if not silent and mine != leader:
                silent = [leader]  # the others register with the leader: it did not answer
            who = f"no answer from {' and '.join(names[t] for t in silent)}. " if silent else ""
            raise cluster.ClusterStartupError(
                f"{names[mine]} could not join the cluster of {len(names)} tasks within "
                f"startup_timeout={self._kr_startup_timeout:g} s: {who}Check that every worker was "
                "started with the same cluster, that each address is reachable from every worker, "
                f"and that no other program uses the ports. TensorFlow said: {_first_line(e)}"
            ) from e
        _joined_cluster = key
        _tf_internal.make_control_flow_safe(self._cross_device_ops)
        _tf_internal.make_control_flow_safe(self._host_cross_device_ops)

    def _initialize_local_devices(self, cluster_resolver, worker_device):
        mine = tf.DeviceSpec.from_string(worker_device)

        def local(kind):
            found = []
            for d in tf.config.list_logical_devices(kind):
                spec = tf.DeviceSpec.from_string(d.name)
                if spec.job in (None, "localhost") or (spec.job == mine.job and spec.task == mine.task):
                    found.append(f"/device:{kind}:{spec.device_index}")
            return sorted(set(found), key=lambda n: int(n.rsplit(":", 1)[1]))

        if self._kr_devices is None:
            names = local("GPU") or local("CPU")
        else:
            known = set(local("GPU") + local("CPU"))
            for d in self._kr_devices:
                if d not in known:
                    raise ValueError(f"Device {d!r} does not exist on {worker_device}; it has {sorted(known)}.")
            names = self._kr_devices
        kind = "GPU" if "GPU" in names[0] else "CPU"
        return tuple(f"{worker_device}{n}" for n in names), kind

    def _lost_worker_error(self, error: Exception) -> cluster.WorkerLostError | None:
        """A WorkerLostError naming the lost worker(s) if ``error`` came from one, else None."""
        if isinstance(error, cluster.WorkerLostError) or not isinstance(error, _PEER_ERRORS):
            return None
        peers = [t for t in self._task_names if t != self._my_task]
        # TensorFlow's message usually names the lost task; a probe confirms it (a peer
        # that aborted only because of another one's loss answers). Then probe the rest.
        mentioned = [t for t in peers if t in _tasks_mentioned(error)]
        timeout = min(2.0, self._kr_failure_timeout)
        lost, unknown = _tf_internal.unhealthy_peers(mentioned, timeout)
        if not lost:
            lost, more_unknown = _tf_internal.unhealthy_peers([t for t in peers if t not in mentioned], timeout)
            unknown += more_unknown
        if not lost:
            lost = [t for t in mentioned if t in unknown]  # could not probe: trust the message
        if not lost:
            return None  # every peer answers: not a lost worker
        names = [self._task_names[t] for t in lost]
        return cluster.WorkerLostError(
            f"Lost {' and '.join(names)}: it stopped responding (no heartbeat for "
            f"failure_timeout={self._kr_failure_timeout:g} s, or its connection closed), so training "
            f"stopped on {self._task_names[self._my_task]}. Restart every worker of the job; "
            "keras.callbacks.BackupAndRestore resumes it from the last saved epoch. "
            f"TensorFlow said: {_first_line(error)}",
            names,
        )


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

        The same script runs on several workers unchanged when ``TF_CONFIG``
        (or Slurm) describes them, e.g. ``keras-replicator launch --workers 2
        train.py``; create the strategy first thing in the script:

        ```python
        strategy = kr.ReplicatorStrategy(failure_timeout=60)
        print(strategy.num_workers, strategy.worker_index, strategy.is_chief)
        ```

    Args:
        devices: the devices to replicate over, as for
            ``tf.distribute.MirroredStrategy``: device names such as
            ``["/gpu:0", "/gpu:1"]``. ``None`` takes every local GPU, else every
            logical CPU device (see :func:`keras_replicator.simulate_devices`).
        cross_device_ops: a ``tf.distribute.CrossDeviceOps`` to use for
            all-reduces (e.g. ``tf.distribute.NcclAllReduce()``,
            ``tf.distribute.ReductionToOneDevice()``). ``None`` chooses by the
            devices (:func:`default_cross_device_ops`): NCCL on GPUs, a
            reduction on one device over CPU devices. One machine only;
            across workers choose ``communication``.
        cluster_resolver: a ``tf.distribute.cluster_resolver.ClusterResolver``
            describing a multi-worker job. ``None`` looks at ``TF_CONFIG``, then
            at Slurm's environment (see :func:`keras_replicator.cluster.resolve_cluster`);
            with no cluster (or a cluster of one task) the strategy is local.
            In a multi-worker job ``devices`` lists each worker's local devices.
        communication: ``"auto"``, ``"ring"`` or ``"nccl"``: the implementation
            of collective all-reduces (``"auto"``: NCCL on GPUs, ring otherwise).
        failure_timeout: seconds without a heartbeat after which a worker counts
            as lost; the others then stop with
            :class:`~keras_replicator.cluster.WorkerLostError`. Multi-worker only.
        startup_timeout: seconds to wait at creation for every worker of the
            cluster to be up before failing with
            :class:`~keras_replicator.cluster.ClusterStartupError`. Multi-worker only.
    """

    def __init__(
        self,
        devices: Sequence[str] | None = None,
        *,
        cross_device_ops: tf.distribute.CrossDeviceOps | None = None,
        cluster_resolver: tf.distribute.cluster_resolver.ClusterResolver | None = None,
        communication: str = "auto",
        failure_timeout: float = 60.0,
        startup_timeout: float = 300.0,
    ):
        if cross_device_ops is not None and not isinstance(
            cross_device_ops, tf.distribute.CrossDeviceOps
        ):
            raise TypeError(
                "cross_device_ops must be a tf.distribute.CrossDeviceOps such as "
                f"tf.distribute.ReductionToOneDevice(), got {cross_device_ops!r}."
            )
        if not isinstance(communication, str) or communication.lower() not in _COMMUNICATION:
            raise ValueError(f"communication must be one of {sorted(_COMMUNICATION)}, got {communication!r}.")
        for name, value in (("failure_timeout", failure_timeout), ("startup_timeout", startup_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and value > 0
            ):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}.")
        implementation = _COMMUNICATION[communication.lower()]
        cluster.simulate_devices_from_env()
        resolver = cluster.resolve_cluster(cluster_resolver)
        spec = resolver.cluster_spec() if resolver is not None else tf.train.ClusterSpec({})
        if sum(spec.num_tasks(job) for job in spec.jobs) > 1:
            if cross_device_ops is not None:
                raise ValueError(
                    "cross_device_ops applies to one machine; in a multi-worker job choose "
                    'communication="ring" or "nccl" instead.'
                )
            local_names = _local_device_names(devices)
            self._collective_key_base = next(_instance_counter) * _COLLECTIVE_KEY_STRIDE
            extended = ReplicatorMultiWorkerExtended(
                self,
                resolver,
                devices=local_names,
                communication=implementation,
                failure_timeout=float(failure_timeout),
                startup_timeout=float(startup_timeout),
            )
            _tf_internal.install_multi_worker_keras_patches()
        else:
            device_names = _normalise_devices(devices)
            # Read by MirroredExtended.__init__; must be set before it runs.
            self._collective_key_base = next(_instance_counter) * _COLLECTIVE_KEY_STRIDE
            extended = ReplicatorExtended(
                self,
                devices=device_names,
                cross_device_ops=cross_device_ops,
                communication=None if communication.lower() == "auto" else implementation,
            )
        super().__init__(extended)
        _tf_internal.install_keras_patches()
        _tf_internal.install_all_reduce_gradient_patch()
        # Per-replica input iterators without tf.data autotuning threads, whose join stalled
        # every new epoch by up to 20 s (issue 21; see _compat/multi_device_iterator.py).
        multi_device_iterator.install()
        # Plain Keras BatchNormalization: moving statistics kept identical across replicas.
        layers.batch_normalization.install_batch_norm_guard()

    # Marks the strategies whose Keras integration keras_replicator handles.
    _keras_replicator = True

    @property
    def devices(self) -> tuple[str, ...]:
        """The devices of the local replicas, in replica order."""
        return tuple(self.extended.worker_devices)

    @property
    def num_workers(self) -> int:
        """Number of worker processes in the job (1 on one machine)."""
        return getattr(self.extended, "_num_workers", 1)

    @property
    def worker_index(self) -> int:
        """This worker's index in ``0 .. num_workers - 1`` (the chief's is 0).

        Its replicas are the global replicas ``worker_index * k .. worker_index * k + k - 1``
        for ``k`` local devices.
        """
        return getattr(self.extended, "_id_in_cluster", 0)

    @property
    def is_chief(self) -> bool:
        """True on the worker that writes checkpoints and summaries (always on one machine)."""
        return bool(getattr(self.extended, "_is_chief", True))

    @property
    def cluster_resolver(self) -> tf.distribute.cluster_resolver.ClusterResolver | None:
        """The resolver of the multi-worker job, or ``None`` on one machine."""
        return getattr(self.extended, "_cluster_resolver", None) if self.num_workers > 1 else None

    def _lost_worker_error(self, error: Exception) -> cluster.WorkerLostError | None:
        """Keras's fit/evaluate/predict re-raise step errors caused by a lost worker as this."""
        if isinstance(self.extended, ReplicatorMultiWorkerExtended):
            return self.extended._lost_worker_error(error)
        return None

    def __repr__(self) -> str:
        if self.num_workers > 1:
            return (
                f"ReplicatorStrategy(num_replicas={self.num_replicas_in_sync}, "
                f"num_workers={self.num_workers}, worker_index={self.worker_index}, "
                f"devices={list(self.devices)})"
            )
        return f"ReplicatorStrategy(num_replicas={self.num_replicas_in_sync}, devices={list(self.devices)})"

    # --- input pipelines (keras_replicator.data) ---------------------------------

    def distribute_dataset(
        self,
        dataset_or_fn: data.DatasetOrFn,
        *,
        global_batch_size: int | None = None,
        per_replica_batch_size: int | None = None,
        shard_policy: str = "auto",
        drop_remainder: bool | None = None,
        shuffle_buffer_size: int | None = None,
        seed: int | None = None,
        batched: bool | None = None,
        options: tf.distribute.InputOptions | None = None,
    ) -> tf.distribute.DistributedDataset:
        """Batches, shards and splits a dataset or an ``input_fn`` over the replicas.

        Every example of a finite dataset is used exactly once per epoch (unless
        ``drop_remainder=True``) and every replica gets at least one example per
        step. See :func:`keras_replicator.data.distribute_dataset` for the
        arguments and the guide "Input pipelines" for the details.

        Example:
            ```python
            train = strategy.distribute_dataset(dataset, per_replica_batch_size=32)
            model.fit(train, epochs=3)

            def input_fn(ctx):                       # called once per worker
                return make_dataset().shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
            train = strategy.distribute_dataset(input_fn, global_batch_size=256)
            ```
        """
        return data.distribute_dataset(
            self,
            dataset_or_fn,
            global_batch_size=global_batch_size,
            per_replica_batch_size=per_replica_batch_size,
            shard_policy=shard_policy,
            drop_remainder=drop_remainder,
            shuffle_buffer_size=shuffle_buffer_size,
            seed=seed,
            batched=batched,
            options=options,
        )

    def experimental_distribute_dataset(self, dataset, options=None):
        """Distributes a dataset batched by the global batch size (what Keras calls).

        As ``tf.distribute.Strategy.experimental_distribute_dataset``, with the
        guarantees of :meth:`distribute_dataset`: slices of a batch differ by at
        most one example, a short last batch leaves no replica empty, and
        sharding follows the dataset's ``auto_shard_policy`` without
        TensorFlow's AUTO->DATA warning. Datasets it cannot split (sparse or
        scalar components) get TensorFlow's own implementation.

        Example:
            ```python
            dist = strategy.experimental_distribute_dataset(dataset.batch(64))
            for batch in dist:
                strategy.run(step, args=(batch,))
            ```
        """
        distributed = data.distribute_batched_dataset(self, dataset, options)
        if distributed is None:
            return super().experimental_distribute_dataset(dataset, options)
        return distributed
