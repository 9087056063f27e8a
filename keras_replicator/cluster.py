"""Where am I: local devices, simulated CPU replicas, and the cluster of a multi-worker job.

A multi-worker job is described by ``TF_CONFIG`` (Kubeflow, the launcher), by
a Kubernetes JobSet pod's environment, by Slurm's environment (``srun``), or by an explicit
``tf.distribute.cluster_resolver.ClusterResolver``; `resolve_cluster`
picks and checks it, so that a malformed description fails with a clear message
before any worker waits for another.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Mapping
from typing import TypeVar

import tensorflow as tf

from keras_replicator._compat.coordination import tensorflow_initialized
from keras_replicator._validation import ArgumentError, check_int
from keras_replicator.errors import (
    ClusterConfigError,
    DeviceConfigurationError,
)
from keras_replicator.jobset import jobset_cluster_dict
from keras_replicator.launch.addresses import split_address
from keras_replicator.launch.environment import DEVICES_PER_WORKER_ENV

_T = TypeVar("_T")




def simulate_devices(n: int) -> list[str]:
    """Splits the host CPU into ``n`` logical devices, so replication runs without GPUs.

    Call it at the top of a program, before anything makes TensorFlow create its
    runtime (building a tensor, a model, a strategy, or listing logical devices).
    Calling it again with the same ``n`` is harmless.

    Under ``keras-replicator launch --devices-per-worker K`` the launcher's ``K``
    wins: a call with another ``n`` simulates ``K`` devices and logs one warning
    saying so, so the same script runs alone and under the launcher.

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
    n = check_int("n", n, minimum=1)
    launcher = _devices_per_worker_from_env()
    if launcher is not None and launcher != n:
        logging.getLogger(__name__).warning(
            "keras_replicator: simulate_devices(%d) ignored: the launcher's --devices-per-worker "
            "(%s=%d) applies, so this worker simulates %d CPU devices.",
            n, DEVICES_PER_WORKER_ENV, launcher, launcher,
        )
        n = launcher
    return _simulate(n)


def _simulate(n: int) -> list[str]:
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if tensorflow_initialized():
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
    `simulate_devices` split it).

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



# --- Multi-worker: which cluster am I part of? -------------------------------

# Optional first port of a Slurm job's workers on each node (see slurm_cluster).
SLURM_PORT_BASE_ENV = "KERAS_REPLICATOR_SLURM_PORT_BASE"
# How many tasks of a Slurm job step are parameter servers (AsyncReplicatorStrategy).
SLURM_NUM_PS_ENV = "KERAS_REPLICATOR_SLURM_NUM_PS"

# Jobs of a TF_CONFIG cluster that take part in synchronous all-reduce training,
# and in asynchronous parameter-server training (AsyncReplicatorStrategy).
_TRAINING_JOBS = ("chief", "worker")
_PS_JOBS = ("chief", "worker", "ps")






def _check_address(address, where: str) -> str:
    try:
        split_address(address, where)
    except ValueError as e:
        raise ClusterConfigError(str(e)) from None
    return address


def _check_cluster(cluster, task_type, task_id, source: str, parameter_servers: bool = False) -> None:
    """Validates a cluster dict {job: [address, ...]} and this task's place in it.

    ``parameter_servers``: the cluster of an ``AsyncReplicatorStrategy`` (one
    "chief", one or more "worker" and "ps" tasks) instead of a synchronous one.
    """
    if not isinstance(cluster, dict) or not cluster:
        raise ClusterConfigError(
            f'{source}: "cluster" must be an object such as {{"worker": ["host1:2222", "host2:2222"]}}, '
            f"got {cluster!r}."
        )
    for job, addresses in cluster.items():
        if job == "ps" and not parameter_servers:
            raise ClusterConfigError(
                f'{source}: the cluster has "ps" (parameter server) tasks. ReplicatorStrategy trains '
                'synchronously with all-reduce: describe the machines as "worker" tasks (and '
                'optionally one "chief"), or use kr.AsyncReplicatorStrategy for asynchronous '
                "training with parameter servers."
            )
        if job not in (_PS_JOBS if parameter_servers else _TRAINING_JOBS):
            if parameter_servers:
                raise ClusterConfigError(
                    f'{source}: job {job!r} is not supported by AsyncReplicatorStrategy; its cluster '
                    'has one "chief", one or more "worker" and one or more "ps" (parameter server) '
                    "tasks. Evaluate in the chief (model.evaluate), or in a separate program."
                )
            raise ClusterConfigError(
                f'{source}: job {job!r} is not supported; use "worker" (and optionally one "chief"). '
                "An evaluator does not take part in training: evaluate in the chief, or in a separate "
                "program without TF_CONFIG."
            )
        if not isinstance(addresses, list) or not addresses:
            raise ClusterConfigError(
                f'{source}: cluster["{job}"] must be a non-empty list of "host:port" strings, got {addresses!r}.'
            )
        for i, a in enumerate(addresses):
            _check_address(a, f'{source}: cluster["{job}"][{i}]')
    if len(cluster.get("chief", [])) > 1:
        raise ClusterConfigError(f'{source}: there can be only one "chief", got {cluster["chief"]}.')
    if parameter_servers:
        missing = [job for job in _PS_JOBS if job not in cluster]
        if missing:
            what = {"chief": 'one "chief" (the task that runs the training script\'s loop)',
                    "worker": 'at least one "worker"',
                    "ps": 'at least one "ps" (parameter server: it holds the variables)'}
            raise ClusterConfigError(
                f"{source}: AsyncReplicatorStrategy needs {' and '.join(what[j] for j in missing)}; "
                f"the cluster has {sorted(cluster)}. Launch with e.g. --workers 2 --ps 1, or use "
                "kr.ReplicatorStrategy for synchronous training without parameter servers."
            )
    everything = [a for job in cluster for a in cluster[job]]
    duplicates = sorted({a for a in everything if everything.count(a) > 1})
    if duplicates:
        raise ClusterConfigError(f"{source}: several tasks share the address(es) {duplicates}.")
    if task_type not in cluster:
        raise ClusterConfigError(
            f'{source}: this task\'s type {task_type!r} is not a job of the cluster {sorted(cluster)}.'
        )
    n = len(cluster[task_type])
    if isinstance(task_id, bool) or not isinstance(task_id, int) or not 0 <= task_id < n:
        raise ClusterConfigError(
            f"{source}: this task's index must be an integer in [0, {n}) for job {task_type!r}, "
            f"got {task_id!r}."
        )


def tf_config_cluster(
    tf_config: str | None = None,
    *,
    parameter_servers: bool = False,
) -> tf.distribute.cluster_resolver.ClusterResolver | None:
    """The cluster that ``TF_CONFIG`` describes, checked; ``None`` if there is none.

    ``TF_CONFIG`` is the JSON that Kubeflow's TFJob operator, the launcher and
    most cluster managers set for TensorFlow jobs:
    ``{"cluster": {"worker": ["host1:2222", "host2:2222"]}, "task": {"type": "worker", "index": 0}}``.
    An optional ``"chief"`` job (one address) is the chief; otherwise worker 0 is.

    Example:
        ```python
        import json, os
        import keras_replicator as kr
        os.environ["TF_CONFIG"] = json.dumps({
            "cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]},
            "task": {"type": "worker", "index": 1}})
        resolver = kr.cluster.tf_config_cluster()
        print(resolver.task_type, resolver.task_id)   # worker 1
        ```

    Args:
        tf_config: the JSON text; ``None`` reads the ``TF_CONFIG`` environment
            variable.
        parameter_servers: check it as the cluster of an ``AsyncReplicatorStrategy``:
            one ``"chief"``, one or more ``"worker"`` and ``"ps"`` tasks, and no
            other job.

    Returns:
        A ``tf.distribute.cluster_resolver.SimpleClusterResolver``, or ``None``
        when ``TF_CONFIG`` is unset, empty or ``{}``.

    Raises:
        ClusterConfigError: the JSON is malformed or inconsistent (the message
            says what to fix).
    """
    text = os.environ.get("TF_CONFIG", "") if tf_config is None else tf_config
    if not isinstance(text, str):
        raise ArgumentError(f"tf_config must be a JSON string, got {type(text).__name__}.")
    if not text.strip():
        return None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ClusterConfigError(f"TF_CONFIG is not valid JSON ({e}): {text[:200]!r}") from None
    if not isinstance(config, dict):
        raise ClusterConfigError(f"TF_CONFIG must be a JSON object, got {text[:200]!r}.")
    if not config.get("cluster"):
        if config.get("task"):
            raise ClusterConfigError('TF_CONFIG has a "task" but no "cluster".')
        return None
    unknown = sorted(set(config) - {"cluster", "task", "rpc_layer", "environment"})
    if unknown:
        raise ClusterConfigError(
            f'TF_CONFIG has unknown key(s) {unknown}; expected "cluster", "task" '
            '(and optionally "rpc_layer", "environment").'
        )
    task = config.get("task")
    if not isinstance(task, dict) or "type" not in task or "index" not in task:
        raise ClusterConfigError(
            'TF_CONFIG needs "task": {"type": "worker", "index": i} saying which task this process is, '
            f"got {task!r}."
        )
    rpc_layer = config.get("rpc_layer", "grpc")
    if rpc_layer != "grpc":
        raise ClusterConfigError(f'TF_CONFIG "rpc_layer" must be "grpc", got {rpc_layer!r}.')
    _check_cluster(config["cluster"], task["type"], task["index"], "TF_CONFIG", parameter_servers)
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(config["cluster"]),
        task_type=task["type"],
        task_id=task["index"],
        rpc_layer=rpc_layer,
    )


def _expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed node list ('node[01-03,7],gpu5') as a list of host names."""
    hosts, i, n = [], 0, len(hostlist)
    while i < n:
        j = i
        while j < n and hostlist[j] not in ",[":
            j += 1
        prefix = hostlist[i:j]
        if j < n and hostlist[j] == "[":
            k = hostlist.index("]", j)
            suffix_end = k + 1
            while suffix_end < n and hostlist[suffix_end] != ",":
                suffix_end += 1
            suffix = hostlist[k + 1 : suffix_end]
            for part in hostlist[j + 1 : k].split(","):
                lo, _, hi = part.partition("-")
                width = len(lo)
                for number in range(int(lo), int(hi or lo) + 1):
                    hosts.append(f"{prefix}{number:0{width}d}{suffix}")
            i = suffix_end + 1
        else:
            if prefix:
                hosts.append(prefix)
            i = j + 1
    return hosts


def _expand_tasks_per_node(spec: str) -> list[int]:
    """Slurm's '2(x3),1' as [2, 2, 2, 1]."""
    counts = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise ValueError(part)
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _read_slurm(env: Mapping[str, str], name: str, parse: Callable[[str], _T], form: str) -> _T:
    """``parse(env[name])``; a ClusterConfigError naming the variable if it cannot be read."""
    try:
        return parse(env[name])
    except ValueError:
        raise ClusterConfigError(f"Slurm's {name}={env[name]!r} is not {form}.") from None


def slurm_cluster(
    environ: Mapping[str, str] | None = None,
    *,
    num_ps: int | None = 0,
) -> tf.distribute.cluster_resolver.ClusterResolver | None:
    """The cluster of the current Slurm job step (``srun``); ``None`` outside one.

    Each Slurm task is a worker; task ``SLURM_PROCID`` is worker ``SLURM_PROCID``
    and task 0 the chief. Tasks are placed on nodes in blocks (Slurm's default
    ``--distribution=block``); a task's port is a per-job base plus its index on
    its node. The base is ``12000 + 32 * (SLURM_JOB_ID mod 1000)``, so jobs
    sharing a node rarely collide; set ``KERAS_REPLICATOR_SLURM_PORT_BASE`` to
    choose it.

    Example:
        ```python
        # in a script started by: srun --nodes=2 --ntasks-per-node=1 python train.py
        import keras_replicator as kr
        strategy = kr.ReplicatorStrategy()   # finds the Slurm cluster by itself
        ```

    With ``num_ps > 0`` (the cluster of an ``AsyncReplicatorStrategy``), task 0
    is the chief, tasks ``1 .. num_ps`` the parameter servers (``ps`` 0 ..
    ``num_ps - 1``) and the rest the workers, at the same addresses.

    Args:
        environ: the environment to read (default ``os.environ``).
        num_ps: how many of the tasks are parameter servers (0: every task is a
            worker). ``None`` reads ``KERAS_REPLICATOR_SLURM_NUM_PS`` (default 0).

    Returns:
        A ``SimpleClusterResolver``, or ``None`` when not in a Slurm job step
        with more than one task.

    Raises:
        ClusterConfigError: the Slurm variables are inconsistent.
    """
    env = os.environ if environ is None else environ
    if "SLURM_PROCID" not in env or "SLURM_STEP_NUM_TASKS" not in env:
        return None
    num_tasks = _read_slurm(env, "SLURM_STEP_NUM_TASKS", int, "an integer")
    rank = _read_slurm(env, "SLURM_PROCID", int, "an integer")
    if num_tasks <= 1:
        return None
    missing = [v for v in ("SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE") if not env.get(v)]
    if missing:
        raise ClusterConfigError(f"A Slurm job step with {num_tasks} tasks but {missing} unset.")
    hosts = _read_slurm(
        env, "SLURM_STEP_NODELIST", _expand_hostlist, "a node list such as 'gpu[01-04],cpu7'"
    )
    per_node = _read_slurm(
        env, "SLURM_STEP_TASKS_PER_NODE", _expand_tasks_per_node, "a task count list such as '2(x3),1'"
    )
    if len(hosts) != len(per_node) or sum(per_node) != num_tasks:
        raise ClusterConfigError(
            f"Slurm says {num_tasks} tasks on nodes {hosts} with {per_node} tasks each; these disagree."
        )
    if not 0 <= rank < num_tasks:
        raise ClusterConfigError(f"SLURM_PROCID={rank} is not in [0, {num_tasks}).")
    if env.get(SLURM_PORT_BASE_ENV):
        base = env[SLURM_PORT_BASE_ENV]
        if not base.isdigit() or not 1 <= int(base) <= 65535 - max(per_node):
            raise ClusterConfigError(f"{SLURM_PORT_BASE_ENV}={base!r} is not a usable port number.")
        base = int(base)
    else:
        job = env.get("SLURM_JOB_ID", "0")
        base = 12000 + 32 * (int(job) % 1000 if job.isdigit() else 0)
    addresses, owner = [], []
    for host, count in zip(hosts, per_node):
        for local in range(count):
            addresses.append(f"{host}:{base + local}")
            owner.append(host)
    me = env.get("SLURMD_NODENAME")
    if me and me != owner[rank]:
        raise ClusterConfigError(
            f"Slurm task {rank} runs on {me!r}, but block placement puts it on {owner[rank]!r}. "
            "Start the job step with srun --distribution=block (the default)."
        )
    if num_ps is None:
        value = env.get(SLURM_NUM_PS_ENV, "0").strip() or "0"
        if not value.isdigit():
            raise ClusterConfigError(f"{SLURM_NUM_PS_ENV}={value!r} must be a non-negative integer.")
        num_ps = int(value)
    if num_ps:
        if num_tasks < num_ps + 2:
            raise ClusterConfigError(
                f"A Slurm job step of {num_tasks} tasks cannot hold a chief, {num_ps} parameter "
                f"server(s) and at least one worker: start at least {num_ps + 2} tasks."
            )
        jobs = {"chief": addresses[:1], "ps": addresses[1 : 1 + num_ps], "worker": addresses[1 + num_ps :]}
        if rank == 0:
            task_type, task_id = "chief", 0
        elif rank <= num_ps:
            task_type, task_id = "ps", rank - 1
        else:
            task_type, task_id = "worker", rank - 1 - num_ps
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(jobs), task_type=task_type, task_id=task_id, rpc_layer="grpc"
        )
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": addresses}), task_type="worker", task_id=rank, rpc_layer="grpc"
    )


def jobset_cluster(
    environ: Mapping[str, str] | None = None,
    *,
    parameter_servers: bool = False,
) -> tf.distribute.cluster_resolver.ClusterResolver | None:
    """The cluster of the Kubernetes JobSet pod this process runs in; ``None`` outside one.

    Reads what the JobSet of ``keras-replicator k8s`` gives each pod: its
    replicated job, Job index and completion index say which task it is; the
    replicated jobs' sizes, the JobSet's name and the port give every task's
    address, the pods' DNS names under the JobSet's headless service
    (``<jobset>-<replicatedJob>-<jobIndex>-<podIndex>.<subdomain>:<port>``).
    See `keras_replicator.jobset` for the variables.

    Example:
        ```python
        import keras_replicator as kr
        env = {"JOBSET_NAME": "train", "REPLICATED_JOB_NAME": "worker", "JOB_INDEX": "0",
               "JOB_COMPLETION_INDEX": "0", "KERAS_REPLICATOR_JOBSET_JOBS": "worker=2",
               "KERAS_REPLICATOR_JOBSET_PORT": "2222"}
        resolver = kr.cluster.jobset_cluster(env)
        print(resolver.cluster_spec().as_dict())
        # {'worker': ['train-worker-0-0.train:2222', 'train-worker-1-0.train:2222']}
        ```

    Args:
        environ: the environment to read (default ``os.environ``).
        parameter_servers: check it as the cluster of an ``AsyncReplicatorStrategy``.

    Returns:
        A ``SimpleClusterResolver``, or ``None`` outside a JobSet pod or in a
        JobSet of a single task.

    Raises:
        ClusterConfigError: the environment is half set or inconsistent.
    """
    found = jobset_cluster_dict(environ)
    if found is None or sum(len(a) for a in found[0].values()) == 1:
        return None
    spec, task_type, task_id = found
    _check_cluster(spec, task_type, task_id, "JobSet", parameter_servers)
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(spec), task_type=task_type, task_id=task_id, rpc_layer="grpc"
    )


def resolve_cluster(
    cluster_resolver: tf.distribute.cluster_resolver.ClusterResolver | None = None,
    *,
    parameter_servers: bool = False,
) -> tf.distribute.cluster_resolver.ClusterResolver | None:
    """The cluster this process belongs to: the argument, else ``TF_CONFIG``, a JobSet pod, Slurm.

    Example:
        ```python
        import keras_replicator as kr
        resolver = kr.cluster.resolve_cluster()
        print("multi-worker" if resolver else "one machine")
        ```

    Args:
        cluster_resolver: an explicit ``tf.distribute.cluster_resolver.ClusterResolver``
            (checked like ``TF_CONFIG``).
        parameter_servers: resolve the cluster of an ``AsyncReplicatorStrategy``
            (a chief, workers and parameter servers; see `tf_config_cluster`,
            `jobset_cluster` and `slurm_cluster`).

    Returns:
        A checked resolver, or ``None`` when nothing describes a cluster.

    Raises:
        ClusterConfigError: the description is malformed.
    """
    if cluster_resolver is None:
        if parameter_servers:
            return (tf_config_cluster(parameter_servers=True)
                    or jobset_cluster(parameter_servers=True) or slurm_cluster(num_ps=None))
        return tf_config_cluster() or jobset_cluster() or slurm_cluster()
    if not isinstance(cluster_resolver, tf.distribute.cluster_resolver.ClusterResolver):
        raise ArgumentError(
            "cluster_resolver must be a tf.distribute.cluster_resolver.ClusterResolver such as "
            f"SimpleClusterResolver or SlurmClusterResolver, got {cluster_resolver!r}."
        )
    name = type(cluster_resolver).__name__
    try:
        spec = cluster_resolver.cluster_spec().as_dict()
    except Exception as e:  # a resolver that cannot resolve: say which
        raise ClusterConfigError(f"{name}.cluster_spec() failed: {e}") from e
    if not spec:
        raise ClusterConfigError(f"{name} describes an empty cluster.")
    for job, tasks in spec.items():
        if isinstance(tasks, dict):
            raise ClusterConfigError(f"{name}: job {job!r} has sparse task indices {sorted(tasks)}.")
    _check_cluster(spec, cluster_resolver.task_type, cluster_resolver.task_id, name, parameter_servers)
    return cluster_resolver


def task_names(cluster_spec: tf.train.ClusterSpec) -> dict[str, str]:
    """Human names of every task: ``{"/job:worker/replica:0/task:1": "worker 1 (... at host:port)"}``.

    Example:
        ```python
        names = kr.cluster.task_names(tf.train.ClusterSpec({"worker": ["a:1", "b:1"]}))
        ```
    """
    names = {}
    for job in cluster_spec.jobs:
        for i, address in enumerate(cluster_spec.job_tasks(job)):
            names[f"/job:{job}/replica:0/task:{i}"] = f"{job} {i} (/job:{job}/task:{i} at {address})"
    return names


def _devices_per_worker_from_env() -> int | None:
    value = os.environ.get(DEVICES_PER_WORKER_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ClusterConfigError(f"{DEVICES_PER_WORKER_ENV}={value!r} must be a positive integer.")
    return int(value)


def simulate_devices_from_env() -> int | None:
    """Applies ``KERAS_REPLICATOR_DEVICES_PER_WORKER`` (set by the launcher), if set.

    ``ReplicatorStrategy`` calls this when it is created, so that a script
    started with ``keras-replicator launch --devices-per-worker K`` gets ``K``
    CPU devices per worker without calling `simulate_devices` itself.

    Example:
        ```python
        import os
        import keras_replicator as kr
        os.environ["KERAS_REPLICATOR_DEVICES_PER_WORKER"] = "2"
        kr.cluster.simulate_devices_from_env()   # same as kr.simulate_devices(2)
        ```

    Returns:
        The number of devices simulated, or ``None`` when the variable is unset.
    """
    value = _devices_per_worker_from_env()
    if value is None:
        return None
    try:
        _simulate(value)
    except DeviceConfigurationError as e:
        raise DeviceConfigurationError(
            f"{DEVICES_PER_WORKER_ENV}={value} asks for {value} CPU devices per worker, but {e}"
        ) from None
    return value
