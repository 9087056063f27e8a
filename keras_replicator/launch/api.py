"""`launch`: the entry point that runs one node's share of a multi-worker job."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

from keras_replicator._validation import check_choice, check_int, check_number
from keras_replicator.launch.addresses import (
    cluster_addresses,
    format_address,
    free_ports,
    parse_hosts,
    split_address,
)
from keras_replicator.launch.config import _check_module, _check_module_name
from keras_replicator.launch.gpus import _detect_gpus, gpu_assignment
from keras_replicator.launch.rendezvous import rendezvous
from keras_replicator.launch.supervisor import _Job, _say, _Signals


def launch(
    script: str,
    args: Sequence[str] = (),
    *,
    workers: int | None = None,
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
    grace: float = 5.0,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    python: str = sys.executable,
    output: TextIO | None = None,
    module: bool = False,
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

    Example:
        ```python
        from keras_replicator.launch import launch
        code = launch("train.py", ["--epochs", "2"], workers=2, devices_per_worker=2)
        # a module, as `python -m`:
        code = launch("keras_replicator.applications.sngan", ["--dataset", "digits", "--out", "run"],
                      module=True, workers=2, devices_per_worker=2)
        ```

    Args:
        script: path of the Python script every worker runs (with ``module``, a
            module name).
        args: command-line arguments for the script.
        workers: number of worker processes on this machine (a one-machine job).
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
            a failed chief or ps task ends that job.
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
        grace: seconds between forwarding a stop signal and SIGKILL.
        env: extra environment variables for the workers.
        timeout: stop every worker and return 124 after this many seconds.
        python: the interpreter to run the script with.
        output: where worker output goes (default ``sys.stdout``).
        module: ``script`` is a module that every worker runs as
            ``python -m script`` (as torchrun's ``-m``).

    Returns:
        0 when every local worker succeeded, else the exit code of the last
        attempt's first failure (128 + N for a worker killed by signal N),
        128 + N when the launcher was stopped by signal N, or 124 on timeout.
    """
    if module:
        if python == sys.executable:  # another interpreter has its own modules: not checked
            _check_module(script, dict(os.environ, **(env or {})).get("PYTHONPATH", ""))
        else:
            _check_module_name(script)
    elif not isinstance(script, str) or not script:
        raise ValueError(f"script must be a path to a Python file, got {script!r}.")
    elif not os.path.isfile(script):
        raise FileNotFoundError(f"Script {script!r} does not exist.")
    args = list(args)
    if not all(isinstance(a, str) for a in args):
        raise TypeError(f"args must be strings, got {args!r}.")
    check_int("devices_per_worker", devices_per_worker, minimum=1, optional=True)
    if not isinstance(host, str) or not host or any(c.isspace() for c in host):
        raise ValueError(f"host must be an address such as '127.0.0.1', got {host!r}.")
    max_restarts = check_int("max_restarts", max_restarts, minimum=0)
    check_choice("tee", tee, ("all", "chief", "none"))
    grace = check_number("grace", grace, non_negative=True)
    timeout = check_number("timeout", timeout, positive=True, optional=True)
    if log_dir is not None and (not isinstance(log_dir, str) or not log_dir):
        raise ValueError(f"log_dir must be a directory path, got {log_dir!r}.")
    ps = check_int("ps", ps, minimum=0)
    if nnodes is not None:  # nodes that find each other through node 0 (torchrun's style)
        nnodes = check_int("nnodes", nnodes, minimum=1)
        if hosts is not None or ps:
            raise ValueError("nnodes= (with master=) replaces hosts=, and does not take ps=.")
        if workers is None or master is None:
            raise ValueError("nnodes= needs workers= (per node) and master='host:port' (node 0's address).")
        check_int("workers", workers, minimum=1)
        split_address(master, "master")
        if node_rank is None:
            raise ValueError(f"nnodes={nnodes}: give node_rank (--node-rank), 0 .. {nnodes - 1}.")
        node_rank = check_int("node_rank", node_rank, minimum=0, maximum=nnodes - 1)
        check_number("rendezvous_timeout", rendezvous_timeout, positive=True)
        mine = [format_address(host, p) for p in free_ports(workers, host)]
        table = rendezvous(master, nnodes, node_rank, mine, rendezvous_timeout)
        fixed = {"worker": [a for node in table for a in node]}
        first = sum(len(node) for node in table[:node_rank])
        tasks = [("worker", i) for i in range(first, first + workers)]
    elif master is not None:
        raise ValueError("master= goes with nnodes= (the number of nodes).")
    elif hosts is None:
        if workers is None:
            raise ValueError("Give workers=N (one machine) or hosts='h1:2,h2:2' (several).")
        check_int("workers", workers, minimum=1)
        if node_rank not in (None, 0):
            raise ValueError(f"node_rank={node_rank!r} needs hosts= or nnodes= (the nodes of the job).")
        if ps:  # a parameter-server job: one chief (the coordinator), the workers, the ps tasks
            tasks = [("chief", 0), *(("worker", i) for i in range(workers)), *(("ps", j) for j in range(ps))]
        else:
            tasks = [("worker", i) for i in range(workers)]
        fixed = None  # free ports, chosen again at every start
    else:
        if workers is not None:
            raise ValueError("Give either workers= (one machine) or hosts= (several), not both.")
        if ps:
            raise ValueError("ps= runs a parameter-server job on one machine; use workers=, not hosts=.")
        nodes = parse_hosts(hosts)
        if node_rank is None and len(nodes) > 1:
            raise ValueError(
                f"hosts names {len(nodes)} nodes: give node_rank (--node-rank), this machine's "
                f"position in it, 0 .. {len(nodes) - 1}."
            )
        node_rank = check_int("node_rank", node_rank or 0, minimum=0, maximum=len(nodes) - 1)
        fixed = {"worker": cluster_addresses(nodes, port)}
        first = sum(count for _, count in nodes[:node_rank])
        tasks = [("worker", i) for i in range(first, first + nodes[node_rank][1])]
    base_env = dict(os.environ, **(env or {}))
    gpu_list = _detect_gpus(base_env) if gpus is None else [str(g) for g in gpus]
    out = output if output is not None else sys.stdout
    lock = threading.Lock()
    computing = [t for t in tasks if t[0] != "ps"]  # the GPUs go to the tasks that compute
    visible = gpu_assignment(gpu_list, len(computing))
    if gpu_list and visible is None:
        _say(out, lock, f"{len(computing)} local workers but {len(gpu_list)} GPU(s): they share them "
                        "(CUDA_VISIBLE_DEVICES left as it is)")
    gpus_of = {} if visible is None else dict(zip(computing, visible))
    logs: dict[tuple[str, int], TextIO] = {}
    if log_dir is not None:
        os.makedirs(log_dir, exist_ok=True)
        logs = {t: open(os.path.join(log_dir, f"{t[0]}_{t[1]}.log"), "w") for t in tasks}

    def cluster() -> dict[str, list[str]]:
        if fixed is not None:
            return fixed
        addresses = iter(format_address(host, p) for p in free_ports(len(tasks), host))
        jobs: dict[str, list[str]] = {}
        for job, _ in tasks:
            jobs.setdefault(job, []).append(next(addresses))
        return jobs

    command = [python, "-m", script] if module else [python, script]
    job = _Job(command, args, tasks, devices_per_worker, gpus_of, base_env, tee, logs, grace,
               max_restarts, out, lock)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        with _Signals() as signals:
            for attempt in range(max_restarts + 1):
                if attempt:
                    _say(out, lock, f"restarting every worker (restart {attempt} of {max_restarts})")
                    for f in logs.values():
                        f.write(f"[launcher] restart {attempt} of {max_restarts}\n")
                result, retry = job.run(cluster(), attempt, deadline, timeout, signals)
                if not retry:
                    return result
            return result
    finally:
        for f in logs.values():
            f.close()

