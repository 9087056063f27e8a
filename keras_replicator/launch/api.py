"""`launch`: runs one node's share of a multi-worker job, from a `LaunchConfig` or its arguments.

The model is torch's ``launcher/api.py``: the config says what to run, this
module works out the cluster (free ports, a static host list or a rendezvous)
and the GPUs, and the `Supervisor` runs the processes.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

from keras_replicator._validation import ArgumentError
from keras_replicator.launch.addresses import cluster_addresses, format_address, free_ports
from keras_replicator.launch.config import LaunchConfig
from keras_replicator.launch.gpus import _detect_gpus, gpu_assignment
from keras_replicator.launch.supervisor import Console, RestartPolicy, Supervisor, Task, WorkerSpec
from keras_replicator.launch.tcp_rendezvous import rendezvous

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(LaunchConfig) if f.name != "script"}


def launch(
    script: str | LaunchConfig,
    args: Sequence[str] = (),
    *,
    workers: int | str | None = None,
    devices_per_worker: int | None = None,
    host: str = "127.0.0.1",
    hosts: str | Sequence[tuple[str, int]] | None = None,
    node_rank: int | None = None,
    port: int = 2222,
    nnodes: int | None = None,
    master: str | None = None,
    rendezvous_timeout: float = 300.0,
    max_restarts: int = 0,
    ps: int = 0,
    log_dir: str | None = None,
    tee: str = "all",
    gpus: Sequence[str] | None = None,
    grace: float | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    python: str = sys.executable,
    output: TextIO | None = None,
    module: bool = False,
    min_workers: int | None = None,
    worker_failures: int | None = None,
) -> int:
    """Runs ``script`` as the local worker processes of one multi-worker job.

    On one machine (``workers=N``), each worker gets a ``TF_CONFIG`` naming
    every worker at ``host`` on free ports (worker 0 is the chief), so a
    `ReplicatorStrategy` created in the script joins the cluster. On several
    machines (``hosts="h1:2,h2:2"``), run the same command on every machine with
    its ``node_rank``; every launcher derives the same cluster from ``hosts``
    and ``port`` and starts its own node's workers.

    Each line a worker prints is written to ``output`` prefixed with
    ``[worker i]`` (``tee`` chooses whose) and, with ``log_dir``, to
    ``log_dir/worker_i.log``. When a worker exits with an error, the others are
    stopped (SIGTERM, then SIGKILL after ``grace`` seconds) and, while
    ``max_restarts`` allows, every local worker is started again (workers get
    ``KERAS_REPLICATOR_RESTART_COUNT``; ``keras.callbacks.BackupAndRestore``
    resumes the job). SIGINT, SIGTERM and SIGHUP sent to the launcher are
    forwarded to every worker; the launcher waits for them (SIGKILL after
    ``grace`` seconds, or at once on a second signal) and never exits before them.

    ``script`` may also be a `LaunchConfig` (then no other argument but
    ``output``): the arguments below are its fields.

    Example:
        ```python
        from keras_replicator.launch import LaunchConfig, launch
        code = launch("train.py", ["--epochs", "2"], workers=2, devices_per_worker=2)
        code = launch(LaunchConfig("train.py", ["--epochs", "2"], workers=2, devices_per_worker=2))
        # a module, as `python -m`:
        code = launch("keras_replicator.applications.sngan", ["--dataset", "digits", "--out", "run"],
                      module=True, workers=2, devices_per_worker=2)
        ```

    Args:
        script: path of the Python script every worker runs (with ``module``, a
            module name).
        args: command-line arguments for the script.
        workers: number of worker processes on this machine (a one-machine job),
            or ``"MIN:MAX"``: an elastic job of ``MAX`` workers that goes on
            with fewer, down to ``MIN``, when a worker cannot be restarted (it
            was the first to fail on ``worker_failures`` starts in a row): the
            job restarts without it, the others renumbered, and
            ``BackupAndRestore`` resumes it (see `RestartPolicy`).
        devices_per_worker: simulate this many CPU devices in each worker (sets
            ``KERAS_REPLICATOR_DEVICES_PER_WORKER``; it takes precedence over the
            script's own `kr.simulate_devices` call). ``None``: the real devices.
        host: the address workers reach each other on (one-machine jobs). Keep
            ``127.0.0.1`` unless the network is private: TensorFlow's workers
            accept unauthenticated connections.
        hosts: every node and its worker count, ``"h1:2,h2:2"`` (instead of
            ``workers`` and ``host``).
        node_rank: this machine's position in ``hosts`` (required with more
            than one node).
        port: with ``hosts``, the first port of every node's workers.
        nnodes: the number of nodes of a job whose nodes find each other
            through ``master`` (instead of ``hosts``): each node starts
            ``workers`` workers on free ports of ``host`` (its address the
            others reach), and node ``node_rank`` 0 collects and shares every
            node's addresses (see `rendezvous`).
        master: ``host:port`` of node 0's rendezvous server (with ``nnodes``).
        rendezvous_timeout: seconds to wait for every node (with ``nnodes``).
        max_restarts: how many times a failed job is restarted. In a
            parameter-server job (``ps``), how many times each failed worker is
            restarted alone instead (as Kubernetes' ``restartPolicy: OnFailure``);
            after that the job goes on without it (the chief runs its steps on
            the other workers). A failed chief or ps task ends that job (see
            `RestartPolicy`).
        ps: parameter-server tasks: with ``ps=M``, the job is one ``chief`` (the
            coordinator), ``workers`` workers and ``M`` ps tasks on this machine,
            each with its ``TF_CONFIG``; it ends when the chief exits (the others
            are then stopped).
        log_dir: also write each task's output to ``log_dir/worker_i.log``
            (``chief_0.log``, ``ps_j.log`` in a parameter-server job).
        tee: whose output is printed: ``"all"``, ``"chief"`` (worker 0, or the chief task) or
            ``"none"``. A failing worker's last lines are printed anyway.
        gpus: the GPU ids to split among the local workers
            (``CUDA_VISIBLE_DEVICES`` per worker); ``None`` detects them
            (``CUDA_VISIBLE_DEVICES`` of the launcher, else ``nvidia-smi -L``).
        grace: seconds between forwarding a stop signal and SIGKILL. ``None``:
            5 s, grown to ``2 x save + 5`` s once the chief recorded how long a backup
            takes to save (`keras_replicator.launch.grace`); a grace given and shorter
            than that is warned about.
        env: extra environment variables for the workers.
        timeout: stop every worker and return 124 after this many seconds.
        python: the interpreter to run the script with.
        output: where worker output goes (default ``sys.stdout``).
        module: ``script`` is a module that every worker runs as
            ``python -m script`` (as torchrun's ``-m``).
        min_workers: ``MIN`` of ``workers="MIN:MAX"``, given apart
            (``workers`` being then ``MAX``).
        worker_failures: an elastic job leaves out a worker that was the first
            to fail on this many starts in a row (default 2: it failed, and
            failed again after a restart).

    Returns:
        0 when every local worker succeeded, else the exit code of the last
        attempt's first failure (128 + N for a worker killed by signal N),
        128 + N when the launcher was stopped by signal N, or 124 on timeout.
    """
    options = {name: value for name, value in locals().items() if name not in ("script", "output")}
    if isinstance(script, LaunchConfig):
        given = sorted(name for name, value in options.items() if value is not _DEFAULTS[name]
                       and value != _DEFAULTS[name])
        if given:
            raise ArgumentError(f"launch(config) takes no other argument but output=, got {given}.")
        config = script
    else:
        config = LaunchConfig(script, **options)
    console = Console(output if output is not None else sys.stdout)
    tasks, cluster = _plan(config)
    spec_env = dict(os.environ, **config.env)
    gpus_of = _assign_gpus(_detect_gpus(spec_env) if config.gpus is None else list(config.gpus), tasks, console)
    logs: dict[Task, TextIO] = {}
    if config.log_dir is not None:
        os.makedirs(config.log_dir, exist_ok=True)
        logs = {t: open(os.path.join(config.log_dir, f"{t[0]}_{t[1]}.log"), "w") for t in tasks}
    try:
        spec = WorkerSpec(config.command, spec_env, config.devices_per_worker, gpus_of, config.tee, logs)
        policy = RestartPolicy(config.max_restarts, parameter_servers=config.ps > 0,
                               min_workers=config.min_workers, worker_failures=config.worker_failures or 2)
        return Supervisor(spec, tasks, policy, console, config.grace, config.timeout).run(cluster)
    finally:
        for f in logs.values():
            f.close()


def _plan(config: LaunchConfig) -> tuple[list[Task], Callable[[], dict[str, list[str]]]]:
    """This node's tasks, and the cluster of each start of the job."""
    if config.mode == "nnodes":
        mine = [format_address(config.host, p) for p in free_ports(config.workers, config.host)]
        table = rendezvous(config.master, config.nnodes, config.node_rank, mine, config.rendezvous_timeout)
        fixed = {"worker": [a for node in table for a in node]}
        first = sum(len(node) for node in table[: config.node_rank])
        return [("worker", i) for i in range(first, first + config.workers)], lambda: fixed
    if config.mode == "hosts":
        fixed = {"worker": cluster_addresses(config.hosts, config.port)}
        first = sum(count for _, count in config.hosts[: config.node_rank])
        count = config.hosts[config.node_rank][1]
        return [("worker", i) for i in range(first, first + count)], lambda: fixed
    tasks: list[Task] = [("worker", i) for i in range(config.workers)]
    if config.ps:  # a parameter-server job: one chief (the coordinator), the workers, the ps tasks
        tasks = [("chief", 0), *tasks, *(("ps", j) for j in range(config.ps))]

    def free_cluster() -> dict[str, list[str]]:  # free ports, chosen again at every start
        addresses = iter(format_address(config.host, p) for p in free_ports(len(tasks), config.host))
        jobs: dict[str, list[str]] = {}
        for job, _ in tasks:
            jobs.setdefault(job, []).append(next(addresses))
        return jobs

    return tasks, free_cluster


def _assign_gpus(gpus: list[str], tasks: list[Task], console: Console) -> dict[Task, str]:
    """``CUDA_VISIBLE_DEVICES`` of the local tasks that compute (not the ps tasks), if the GPUs go round."""
    computing = [t for t in tasks if t[0] != "ps"]
    visible = gpu_assignment(gpus, len(computing))
    if gpus and visible is None:
        console.say(f"{len(computing)} local workers but {len(gpus)} GPU(s): they share them "
                    "(CUDA_VISIBLE_DEVICES left as it is)")
    return {} if visible is None else dict(zip(computing, visible))
