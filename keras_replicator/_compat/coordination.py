"""TensorFlow's runtime context and coordination service; naming a lost worker.

Uses the private `Context` methods `configure_coordination_service`,
`_coordination_service_config`, `check_collective_ops_peer_health` and
`_context_handle` (TensorFlow 2.16-2.21; no public equivalents). All of the
lost-worker diagnosis lives here: bounding the waits (`configure_coordination_service`),
probing peers (`unhealthy_peers`), and turning a failed step or start-up into an
error that names the worker (`lost_worker_error`, `startup_error`).
"""

from __future__ import annotations

import re

import tensorflow as tf
from tensorflow.python.eager import context

from keras_replicator.errors import ClusterStartupError, WorkerLostError


def tensorflow_initialized() -> bool:
    """True once TensorFlow's runtime context (and so its device list) exists.

    `tf.config.set_logical_device_configuration` only works before this point.
    """
    return context.context()._context_handle is not None


def coordination_leader(cluster_spec: tf.train.ClusterSpec) -> str:
    """The task that runs the coordination service (the chief, else worker 0)."""
    job = "chief" if "chief" in cluster_spec.jobs else "worker"
    return f"/job:{job}/replica:0/task:0"


def configure_coordination_service(
    cluster_spec: tf.train.ClusterSpec, *, heartbeat_timeout: float, startup_timeout: float
) -> bool:
    """Configures TensorFlow's coordination service with our failure timeouts.

    Why: `CollectiveAllReduceExtended._initialize_multi_worker` enables the
    coordination service with TensorFlow's defaults (no bound on the wait for
    other workers at start-up) unless one is already configured; the service's
    heartbeats are what detect a dead worker (its Python-level health check
    thread is turned off when the service is on). Configuring it first bounds
    both: a worker silent for `heartbeat_timeout` seconds aborts every
    collective on the others, and a cluster not complete within
    `startup_timeout` seconds fails strategy creation. Returns False when a
    service was already configured (a second strategy in the process) and so
    keeps its settings.
    """
    try:  # TF 2.21
        from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    except ImportError:  # older layouts
        from tensorflow.tsl.protobuf import coordination_config_pb2

    ctx = context.context()
    if ctx.coordination_service is not None:
        return False
    jobs = [
        coordination_config_pb2.CoordinatedJob(name=job, num_tasks=cluster_spec.num_tasks(job))
        for job in ("chief", "worker")
        if job in cluster_spec.jobs
    ]
    ctx.configure_coordination_service(
        service_type="standalone",
        service_leader=coordination_leader(cluster_spec),
        enable_health_check=True,
        cluster_register_timeout_in_ms=int(startup_timeout * 1000),
        heartbeat_timeout_in_ms=int(heartbeat_timeout * 1000),
        shutdown_barrier_timeout_in_ms=int(heartbeat_timeout * 1000),
        coordinated_jobs=jobs,
    )
    # Without the barrier the leader waits for the other tasks with no bound,
    # whatever cluster_register_timeout says (TF 2.21); not exposed by the method.
    config = ctx._coordination_service_config
    if "cluster_register_with_barrier" in config.DESCRIPTOR.fields_by_name:
        config.cluster_register_with_barrier = True
    return True


def unhealthy_peers(tasks, timeout: float) -> tuple[list[str], list[str]]:
    """Probes `tasks` ("/job:worker/replica:0/task:1", ...): (those lost, those unknown).

    Asks each peer's worker service whether it is the same live process:
    unreachable, restarted or silent for `timeout` seconds counts as lost; any
    other error leaves the peer unknown.
    """
    lost, unknown = [], []
    for task in tasks:
        try:
            context.context().check_collective_ops_peer_health(
                task, timeout_in_ms=int(timeout * 1000)
            )
        except (tf.errors.UnavailableError, tf.errors.FailedPreconditionError,
                tf.errors.DeadlineExceededError):
            lost.append(task)
        except tf.errors.OpError:
            unknown.append(task)
    return lost, unknown


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


def first_line(error: Exception) -> str:
    """The first line of a TensorFlow error's message, without its function-node prefix."""
    text = re.sub(r"\{\{[^}]*\}\}", "", str(getattr(error, "message", error))).strip()
    return text.splitlines()[0].strip() if text else type(error).__name__


def _tasks_mentioned(error: Exception) -> set[str]:
    return {f"/job:{j}/replica:0/task:{i}" for j, i in _TASK_IN_MESSAGE.findall(str(error))}


def startup_error(
    error: Exception, cluster_spec: tf.train.ClusterSpec, my_task: str, names: dict[str, str],
    startup_timeout: float,
) -> ClusterStartupError:
    """A `ClusterStartupError` naming the tasks that did not answer at start-up."""
    leader = coordination_leader(cluster_spec)
    silent = sorted(_tasks_mentioned(error) - {my_task})
    if not silent and my_task != leader:
        silent = [leader]  # the others register with the leader: it did not answer
    who = f"no answer from {' and '.join(names[t] for t in silent)}. " if silent else ""
    return ClusterStartupError(
        f"{names[my_task]} could not join the cluster of {len(names)} tasks within "
        f"startup_timeout={startup_timeout:g} s: {who}Check that every worker was "
        "started with the same cluster, that each address is reachable from every worker, "
        f"and that no other program uses the ports. TensorFlow said: {first_line(error)}"
    )


def lost_worker_error(
    error: Exception, *, names: dict[str, str], my_task: str, failure_timeout: float
) -> WorkerLostError | None:
    """A `WorkerLostError` naming the lost worker(s) if `error` came from one, else None.

    TensorFlow's message usually names the lost task; a probe confirms it (a
    peer that aborted only because of another one's loss answers). Then the
    rest are probed.
    """
    if isinstance(error, WorkerLostError) or not isinstance(error, _PEER_ERRORS):
        return None
    peers = [t for t in names if t != my_task]
    mentioned = [t for t in peers if t in _tasks_mentioned(error)]
    timeout = min(2.0, failure_timeout)
    lost, unknown = unhealthy_peers(mentioned, timeout)
    if not lost:
        lost, more_unknown = unhealthy_peers([t for t in peers if t not in mentioned], timeout)
        unknown += more_unknown
    if not lost:
        lost = [t for t in mentioned if t in unknown]  # could not probe: trust the message
    if not lost:
        return None  # every peer answers: not a lost worker
    lost_names = [names[t] for t in lost]
    return WorkerLostError(
        f"Lost {' and '.join(lost_names)}: it stopped responding (no heartbeat for "
        f"failure_timeout={failure_timeout:g} s, or its connection closed), so training "
        f"stopped on {names[my_task]}. Restart every worker of the job; "
        "keras.callbacks.BackupAndRestore resumes it from the last saved epoch. "
        f"TensorFlow said: {first_line(error)}",
        lost_names,
    )
