"""The mirrored and collective replication engines, made safe for Keras 3.

`ReplicatorStrategy` reuses TensorFlow's engines instead of re-implementing
replica threads, device placement and cross-device reductions:
`mirrored_strategy.MirroredExtended` on one machine and
`collective_all_reduce_strategy.CollectiveAllReduceExtended` across workers.
What this module overrides, and the private state it reads, checked on
TensorFlow 2.16-2.21:

* both: the strategy's `_collective_key_base` (read by the engines' constructors:
  each strategy instance gets its own collective keys);
* `MirroredExtended._create_variable`'s `colocate_with` (an object with
  `_devices`): the variables made under `logical_device_for_variables(i)` are
  mirrored over logical device `i` of every replica (`_LogicalDevices`); reads a
  mirrored replica context's `_replica_id_in_sync_group` (a Python int);
* `MirroredExtended._batch_reduce_to`: values whose copies are logical device
  `j > 0`'s are all-reduced by a `CollectiveAllReduce` over those devices (its
  own group) where the engine's all-reduce is a collective; reads that object's
  `_group_size` and `_launchers`, the engine's `_communication_options` and
  `_collective_keys`;
* `MirroredExtended._make_collective_ops_with_fallbacks` and
  `_initialize_strategy`: execution-ordered collective keys, an explicit
  `communication=`;
* `CollectiveAllReduceExtended._initialize_multi_worker` (bounded start-up, a
  process joins one cluster, a clear error) and `_initialize_local_devices`
  (every logical local device, not one CPU); reads `_cluster_spec`,
  `_task_type`, `_task_id`, `_num_workers`, `_id_in_cluster`, `_is_chief`,
  `_cluster_resolver`, `_cross_device_ops`, `_host_cross_device_ops`,
  `_std_server_started`, `_enable_check_health`.

The engines expose what the strategy needs as public properties
(`num_workers`, `worker_index`, `is_chief`, `cluster_resolver`,
`lost_worker_error`), so nothing outside this package reads TensorFlow's private
state.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading

import tensorflow as tf
from tensorflow.python.distribute import (
    collective_all_reduce_strategy,
    device_util,
    mirrored_strategy,
)
from tensorflow.python.distribute import cross_device_ops as tf_cross_device_ops

from keras_replicator import cluster
from keras_replicator._compat import coordination, reduce_between_calls, replica_trace
from keras_replicator._compat.collective_launcher import make_control_flow_safe
from keras_replicator._validation import ArgumentError, check_int
from keras_replicator.errors import ClusterStartupError, WorkerLostError
from keras_replicator.model_parallel.mesh import ReplicaMesh

# Each strategy instance gets a disjoint range of collective group keys. Workers
# of one job create their strategies in the same order, so they agree.
_COLLECTIVE_KEY_STRIDE = 100_000
_instance_counter = itertools.count(1)
# The cluster this process joined (its TensorFlow server runs for good): later
# multi-worker strategies of the same cluster reuse it.
_joined_cluster: tuple | None = None


def _give_collective_keys(strategy) -> None:
    # Read by the engines' __init__: must be set before they run.
    strategy._collective_key_base = next(_instance_counter) * _COLLECTIVE_KEY_STRIDE


class _TraceOnce:
    """What both engines add to trace the replica step once (`replica_trace`).

    Overrides `_call_for_each_replica`, `_create_variable` (each distributed
    variable's components are registered, to be swapped per replica),
    `_use_merge_call` and `_get_cross_device_ops` (while the one trace runs:
    TensorFlow's merge-call-free path with the devices' collective launchers).
    """

    trace_once = True

    def _kr_init_trace_once(self, trace_once: bool) -> None:
        self.trace_once = trace_once
        self._kr_components = replica_trace.ComponentRegistry()
        self._kr_tracing = threading.local()

    def _kr_collectives(self):
        """The collective all-reduce over this worker's devices, or None."""
        raise NotImplementedError

    def step_all_reduce(self):
        """The cross-device ops that all-reduce inside a step, or None if steps are traced per replica."""
        if not self.trace_once or len(self.worker_devices) < 2 or self.devices_per_replica > 1:
            return None
        return self._kr_collectives()

    def between_calls_reduction(self):
        """The cross-device ops that reduce a step traced once between its calls
        (`reduce_between_calls`), or None where its collectives do: several
        workers, devices other than CPUs, or a collective chosen."""
        if self.num_workers > 1 or not self.trace_once:
            return None
        if any((tf.DeviceSpec.from_string(d).device_type or "").upper() != "CPU" for d in self.worker_devices):
            return None
        ops_obj = getattr(self, "_cross_device_ops", None)
        if ops_obj is None or isinstance(ops_obj, tf_cross_device_ops.CollectiveAllReduce):
            return None
        return ops_obj

    def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
        reduce = functools.partial(super()._replica_ctx_all_reduce, reduce_op, value, options)
        if not self.is_tracing_once:
            return reduce()
        return reduce_between_calls.all_reduce(reduce, reduce_op, value)

    @property
    def is_tracing_once(self) -> bool:
        return getattr(self._kr_tracing, "depth", 0) > 0

    @contextlib.contextmanager
    def tracing_once(self):
        self._kr_tracing.depth = getattr(self._kr_tracing, "depth", 0) + 1
        try:
            yield
        finally:
            self._kr_tracing.depth -= 1

    def _call_for_each_replica(self, fn, args, kwargs):
        collectives = self._kr_collectives()
        launchers = list(collectives._launchers) if collectives is not None else None
        return replica_trace.call_for_each_replica(
            self, fn, args, kwargs, self._kr_components, launchers)

    def _create_variable(self, next_creator, **kwargs):
        variable = super()._create_variable(next_creator, **kwargs)
        self._kr_components.add(variable)
        return variable

    def _use_merge_call(self):
        if self.is_tracing_once:
            return False
        return super()._use_merge_call()

    def _get_cross_device_ops(self, value):
        if self.is_tracing_once:
            return self._kr_collectives()
        return super()._get_cross_device_ops(value)


class _Colocation:
    """What `MirroredExtended._create_variable` reads from `colocate_with`: the devices."""

    def __init__(self, devices):
        self._devices = tuple(devices)


class _LogicalDevices:
    """What both engines add for a replica that spans several devices (a `ReplicaMesh`).

    TensorFlow's engine sees one device per replica, each replica's logical
    device 0 (its inputs arrive there, its step runs there); the other logical
    devices hold the variables made under `logical_device_for_variables(i)`
    (mirrored over logical device `i` of every replica) and the ops placed with
    `kr.logical_device(i)`.
    """

    mesh: ReplicaMesh

    def _kr_init_mesh(self, devices_per_replica: int) -> None:
        self._kr_devices_per_replica = devices_per_replica
        self._kr_variable_device: list[int] = []

    def _kr_make_mesh(self, devices, where: str) -> ReplicaMesh:
        names = [device_util.canonicalize(d) for d in devices]
        k = self._kr_devices_per_replica
        if len(names) % k:
            raise ArgumentError(
                f"devices_per_replica={k} must divide the number of {where} devices, {len(names)} "
                f"({names}): each replica spans exactly {k} devices."
            )
        self.mesh = ReplicaMesh(names, k)
        return self.mesh

    @property
    def devices_per_replica(self) -> int:
        return self._kr_devices_per_replica

    def check_logical_device(self, index) -> int:
        k = self._kr_devices_per_replica
        return check_int("logical_device", index, minimum=0, maximum=k - 1)

    @contextlib.contextmanager
    def logical_device_for_variables(self, index: int):
        index = self.check_logical_device(index)
        strategy = self._container_strategy()
        if not tf.distribute.has_strategy() or tf.distribute.get_strategy() is not strategy:
            # Outside the scope, variables are TensorFlow's plain ones, on the default device.
            raise RuntimeError(
                "logical_device_for_variables() places the variables made in the strategy's scope: "
                "enter it inside `with strategy.scope():`."
            )
        self._kr_variable_device.append(index)
        try:
            yield
        finally:
            self._kr_variable_device.pop()

    def _kr_make_logical_collectives(self, base) -> None:
        """One collective all-reduce per logical device j > 0, over its copies in every replica.

        Why: TensorFlow's collective runs on the replicas' logical devices 0; the
        gradients of a variable on logical device j would be copied there and back.
        Only where the step's all-reduce is a collective (several workers, or
        `communication=` on one machine); made now, in the same order on every worker, so that the
        group keys agree.
        """
        self._kr_logical_ops: dict[int, tf_cross_device_ops.CollectiveAllReduce] = {}
        self._kr_logical_index: dict[tuple, int] = {}
        if self._kr_devices_per_replica == 1 or not isinstance(base, tf_cross_device_ops.CollectiveAllReduce):
            return
        for j in range(1, self._kr_devices_per_replica):
            devices = self.mesh.logical_devices(j)
            self._kr_logical_ops[j] = make_control_flow_safe(tf_cross_device_ops.CollectiveAllReduce(
                devices=devices, group_size=base._group_size, options=self._communication_options,
                collective_keys=self._collective_keys))
            self._kr_logical_index[devices] = j

    def logical_device_launchers(self) -> list:
        """The launchers of each logical device's collective group (aligned before each step)."""
        return [list(ops_obj._launchers) for ops_obj in getattr(self, "_kr_logical_ops", {}).values()]

    def _kr_logical_group(self, value) -> int:
        """j > 0 if `value`'s components are logical device j's, one per replica, and the
        all-reduce it would take is a collective; else 0 (the engine's own all-reduce)."""
        if not getattr(self, "_kr_logical_ops", None) or not isinstance(value, tf.distribute.DistributedValues):
            return 0
        devices = tuple(device_util.canonicalize(v.device) for v in value.values)
        j = self._kr_logical_index.get(devices, 0)
        if j and not isinstance(self._get_cross_device_ops(value), tf_cross_device_ops.CollectiveAllReduce):
            return 0
        return j

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        groups: dict[int, list[int]] = {}
        for i, (value, _) in enumerate(value_destination_pairs):
            groups.setdefault(self._kr_logical_group(value), []).append(i)
        if set(groups) <= {0}:
            return super()._batch_reduce_to(reduce_op, value_destination_pairs, options)
        results: list = [None] * len(value_destination_pairs)
        for j, members in groups.items():  # in order of first appearance: the same on every worker
            pairs = [value_destination_pairs[i] for i in members]
            if j == 0:
                reduced = super()._batch_reduce_to(reduce_op, pairs, options)
            else:
                reduced = self._kr_logical_ops[j].batch_reduce(
                    reduce_op, pairs, options=self._communication_options.merge(options))
            for i, value in zip(members, reduced):
                results[i] = value
        return results

    def _create_variable(self, next_creator, **kwargs):
        if kwargs.get("colocate_with") is None and self._kr_variable_device:
            kwargs["colocate_with"] = _Colocation(self.mesh.logical_devices(self._kr_variable_device[-1]))
        return super()._create_variable(next_creator, **kwargs)

    def replica_device(self, replica_context, index: int) -> str | None:
        """The device of logical device `index` of the replica running in `replica_context`.

        None where the replica's id is a tensor (a step traced once: one device per
        replica, whose ops the trace leaves unplaced).
        """
        replica = getattr(replica_context, "_replica_id_in_sync_group", None)
        if not isinstance(replica, int):
            return None
        return self.mesh.device(replica - self._get_replica_id_in_sync_group(0), index)


class ReplicatorExtended(_TraceOnce, _LogicalDevices, mirrored_strategy.MirroredExtended):
    """Single-worker replication engine: `MirroredExtended` made safe for Keras 3."""

    def __init__(self, container_strategy, devices, cross_device_ops=None, communication=None,
                 trace_once=True, cross_device_ops_chosen=False, devices_per_replica=1):
        _give_collective_keys(container_strategy)
        self._kr_init_trace_once(trace_once)
        self._kr_init_mesh(devices_per_replica)
        # TensorFlow's replicas are the replicas' logical devices 0.
        devices = self._kr_make_mesh(devices, "local").input_devices
        self._kr_chosen_ops = cross_device_ops if cross_device_ops_chosen else None
        # Read by _make_collective_ops_with_fallbacks during super().__init__.
        self._kr_communication = communication
        super().__init__(container_strategy, devices=devices, cross_device_ops=cross_device_ops)
        self._kr_make_logical_collectives(self._cross_device_ops)

    def _make_collective_ops_with_fallbacks(self):
        ops_obj = super()._make_collective_ops_with_fallbacks()
        if self._kr_communication is not None and isinstance(
            ops_obj, tf_cross_device_ops.CollectiveAllReduce
        ):
            # An explicit communication= replaces TensorFlow's choice for the local all-reduce.
            self._communication_options = tf.distribute.experimental.CommunicationOptions(
                implementation=self._kr_communication
            )
            ops_obj = tf_cross_device_ops.CollectiveAllReduce(
                devices=self._devices,
                group_size=len(self._devices),
                options=self._communication_options,
                collective_keys=self._collective_keys,
            )
        return make_control_flow_safe(ops_obj)

    def _initialize_strategy(self, devices):
        super()._initialize_strategy(devices)
        # A user-given CollectiveAllReduce needs the same fix as the default one.
        make_control_flow_safe(self._cross_device_ops)

    @property
    def cross_device_ops(self) -> tf.distribute.CrossDeviceOps:
        """The cross-device ops the engine all-reduces with."""
        return self._cross_device_ops

    def _kr_collectives(self):
        chosen = self._kr_chosen_ops
        if chosen is not None and not isinstance(chosen, tf_cross_device_ops.CollectiveAllReduce):
            return None  # the user's choice does every all-reduce, through merge_call
        ops_obj = chosen if chosen is not None else self._collective_ops
        return ops_obj if isinstance(ops_obj, tf_cross_device_ops.CollectiveAllReduce) else None

    num_workers = 1
    worker_index = 0
    is_chief = True
    cluster_resolver = None

    def lost_worker_error(self, error: Exception) -> WorkerLostError | None:
        return None


class ReplicatorMultiWorkerExtended(
    _TraceOnce, _LogicalDevices, collective_all_reduce_strategy.CollectiveAllReduceExtended
):
    """Multi-worker replication engine: `CollectiveAllReduceExtended` made safe for Keras 3.

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
        trace_once: bool = True,
        devices_per_replica: int = 1,
    ):
        _give_collective_keys(container_strategy)
        self._kr_init_trace_once(trace_once)
        self._kr_init_mesh(devices_per_replica)
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
                raise ClusterStartupError(
                    f"{me}: this process already joined another cluster; a process can be part of "
                    "one cluster only."
                )
            # Same cluster: its server and coordination already run (read by super()).
            self._std_server_started = True
            self._enable_check_health = False
        elif coordination.tensorflow_initialized():
            raise ClusterStartupError(
                f"{me}: TensorFlow had already started when the multi-worker ReplicatorStrategy was "
                "created. Create the strategy first thing in the program, before any tensor, model "
                "or dataset (kr.simulate_devices may come before it)."
            )
        coordination.configure_coordination_service(
            spec, heartbeat_timeout=self._kr_failure_timeout, startup_timeout=self._kr_startup_timeout
        )
        try:
            super()._initialize_multi_worker(cluster_resolver)
        except (tf.errors.OpError, RuntimeError) as e:
            mine = f"/job:{cluster_resolver.task_type}/replica:0/task:{cluster_resolver.task_id}"
            raise coordination.startup_error(
                e, spec, mine, cluster.task_names(spec), self._kr_startup_timeout
            ) from e
        _joined_cluster = key
        make_control_flow_safe(self._cross_device_ops)
        make_control_flow_safe(self._host_cross_device_ops)
        self._kr_make_logical_collectives(self._cross_device_ops)

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
        mesh = self._kr_make_mesh([f"{worker_device}{n}" for n in names], f"{worker_device}'s")
        return mesh.input_devices, kind

    @property
    def cross_device_ops(self) -> tf.distribute.CrossDeviceOps:
        """The cross-device ops the engine all-reduces with."""
        return self._cross_device_ops

    def _kr_collectives(self):
        return self._cross_device_ops

    @property
    def num_workers(self) -> int:
        return self._num_workers

    @property
    def worker_index(self) -> int:
        return self._id_in_cluster

    @property
    def is_chief(self) -> bool:
        return bool(self._is_chief)

    @property
    def cluster_resolver(self):
        return self._cluster_resolver

    @property
    def failure_timeout(self) -> float:
        """Seconds without a heartbeat after which a worker counts as lost."""
        return self._kr_failure_timeout

    def lost_worker_error(self, error: Exception) -> WorkerLostError | None:
        """A WorkerLostError naming the lost worker(s) if `error` came from one, else None."""
        return coordination.lost_worker_error(
            error, names=self._task_names, my_task=self._my_task,
            failure_timeout=self._kr_failure_timeout,
        )
