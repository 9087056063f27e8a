"""Starting a multi-worker job: worker processes on one or several machines, and a Kubeflow ``TFJob``.

`launch` (``keras-replicator launch``) runs one training script as ``N``
worker processes on this machine, each with its own ``TF_CONFIG`` on free ports
of ``127.0.0.1``: the quickest way to try multi-worker code, and the way the test
suite runs it. With ``hosts`` it starts one node's share of a job spanning
several machines. It forwards stop signals to its workers, restarts a failed
job, and writes per-worker logs. `k8s_manifest` (``keras-replicator k8s``) writes the same job
as a Kubeflow ``TFJob``, whose operator sets ``TF_CONFIG`` in every pod.

Security: TensorFlow's gRPC workers are unauthenticated; anyone who can reach
a worker's port can run operations in it. The launcher therefore gives its
workers ``127.0.0.1`` addresses (and probes free ports there) unless told
otherwise, so their traffic stays on the machine. TensorFlow 2.21's server
itself listens on its port on every interface, whatever the address: on a
shared machine, firewall the ports; across machines, keep workers on a private
network.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import TextIO

# No TensorFlow here (nor in anything imported): `keras-replicator launch` and `k8s`
# start in a fraction of a second; tests/test_launch.py checks it.
from keras_replicator._validation import check_choice, check_int, check_number

# Read by ReplicatorStrategy (through cluster.py) at creation: simulate this many
# CPU devices per worker. The launcher sets it for --devices-per-worker.
DEVICES_PER_WORKER_ENV = "KERAS_REPLICATOR_DEVICES_PER_WORKER"
# Set for each launched worker: its index, so scripts and logs can tell them apart.
WORKER_INDEX_ENV = "KERAS_REPLICATOR_WORKER_INDEX"
# Set for each launched worker: 0 at the first start, k at the k-th restart (--max-restarts).
RESTART_COUNT_ENV = "KERAS_REPLICATOR_RESTART_COUNT"


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports that were free on ``host`` a moment ago.

    The operating system picks them (binding port 0); all ``n`` sockets are held
    open together, so the ports are distinct. Another program could take one
    before a worker binds it; that is unlikely and shows as a clear bind error.

    Example:
        ```python
        from keras_replicator.launch import free_ports
        print(free_ports(2))   # e.g. [41327, 38211]
        ```

    Args:
        n: how many ports.
        host: the address to bind.

    Returns:
        The port numbers.
    """
    check_int("n", n, minimum=1)
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(s)
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    except OSError as e:
        raise OSError(f"Cannot bind a port on {host!r}: {e}. Is it an address of this machine?") from e
    finally:
        for s in sockets:
            s.close()


def _format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def tf_config(
    addresses: Sequence[str] | Mapping[str, Sequence[str]], index: int, task_type: str = "worker"
) -> str:
    """The ``TF_CONFIG`` JSON for task ``index`` of a cluster.

    ``addresses`` lists the workers (every task a ``worker``; worker 0 is the
    chief), or maps each job (``"chief"``, ``"worker"``, ``"ps"``) to its tasks'
    addresses, as a parameter-server job needs.

    Example:
        ```python
        from keras_replicator.launch import tf_config
        tf_config(["10.0.0.1:2222", "10.0.0.2:2222"], 1)
        # '{"cluster": {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]}, "task": {"type": "worker", "index": 1}}'
        tf_config({"chief": ["h:1"], "worker": ["h:2"], "ps": ["h:3"]}, 0, "ps")
        ```

    Args:
        addresses: ``host:port`` of every worker in worker order, or
            ``{job: [host:port, ...]}``.
        index: this task's position in its job.
        task_type: this task's job.
    """
    cluster = {k: list(v) for k, v in addresses.items()} if isinstance(addresses, Mapping) else {
        "worker": list(addresses)}
    if not any(cluster.values()):
        raise ValueError("addresses is empty: give one host:port per worker.")
    for job, tasks in cluster.items():
        for a in tasks:
            if not isinstance(a, str) or not re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[^\s:\[\]]+):\d{1,5}", a):
                label = "Worker" if job == "worker" else f"The {job} task's"
                raise ValueError(f"{label} address {a!r} is not of the form host:port.")
    if task_type not in cluster:
        raise ValueError(f"task_type {task_type!r} is not a job of the cluster {sorted(cluster)}.")
    n = len(cluster[task_type])
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n:
        raise ValueError(f"index must be an integer in [0, {n}), got {index!r}.")
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


def parse_hosts(spec: str | Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
    """The hosts of a multi-host job and their worker counts, from ``"h1:2,h2:2"``.

    Example:
        ```python
        from keras_replicator.launch import parse_hosts
        parse_hosts("10.0.0.1:2,10.0.0.2:2")   # [('10.0.0.1', 2), ('10.0.0.2', 2)]
        ```

    Args:
        spec: comma-separated ``host:count`` (``[ipv6]:count`` for IPv6
            addresses), or a list of ``(host, count)`` pairs.

    Returns:
        ``(host, count)`` pairs in node order (node rank 0 first).
    """
    if isinstance(spec, str):
        pairs = []
        for part in spec.split(","):
            m = re.fullmatch(r"\s*(\[[0-9a-fA-F:.]+\]|[^\s:\[\],]+):(\d+)\s*", part)
            if not m:
                raise ValueError(
                    f"hosts must be comma-separated host:count entries such as 'h1:2,h2:2', "
                    f"got {spec!r} ({part!r} is not host:count)."
                )
            pairs.append((m.group(1).strip("[]"), int(m.group(2))))
    else:
        pairs = list(spec)
    if not pairs:
        raise ValueError("hosts is empty: give host:count for every node.")
    for entry in pairs:
        if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str) and entry[0]):
            raise ValueError(f"Each host must be a (host, count) pair, got {entry!r}.")
        check_int(f"the worker count of host {entry[0]!r}", entry[1], minimum=1)
    return pairs


def cluster_addresses(hosts: Sequence[tuple[str, int]], port: int) -> list[str]:
    """Every worker's ``host:port``, in worker order, for a static multi-host job.

    The workers of a host take ports ``port, port + 1, ...``; a host listed
    again continues where it left off, so ``127.0.0.1`` can stand for several
    nodes in a test.

    Example:
        ```python
        from keras_replicator.launch import cluster_addresses
        cluster_addresses([("h1", 2), ("h2", 1)], 2222)   # ['h1:2222', 'h1:2223', 'h2:2222']
        ```

    Args:
        hosts: ``(host, count)`` pairs in node order (see `parse_hosts`).
        port: the first port on every host.
    """
    check_int("port", port, minimum=1, maximum=65535)
    next_port: dict[str, int] = {}
    addresses = []
    for host, count in hosts:
        first = next_port.get(host, port)
        if first + count - 1 > 65535:
            raise ValueError(f"Ports {first}..{first + count - 1} of host {host!r} exceed 65535.")
        addresses += [_format_address(host, first + i) for i in range(count)]
        next_port[host] = first + count
    return addresses


def _split_address(address: str, what: str) -> tuple[str, int]:
    m = re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[^\s:\[\]]+):(\d{1,5})", address) if isinstance(address, str) else None
    if not m or not 1 <= int(m.group(2)) <= 65535:
        raise ValueError(f"{what} must be host:port, got {address!r}.")
    return m.group(1).strip("[]"), int(m.group(2))


def rendezvous(master: str, nnodes: int, node_rank: int, addresses: Sequence[str],
               timeout: float = 300.0) -> list[list[str]]:
    """Exchanges every node's worker addresses through node 0; every node gets the same table.

    Node 0 listens on ``master`` until the other ``nnodes - 1`` nodes have sent
    their rank and addresses, then answers each with the whole table; the others
    connect (retrying until ``timeout``), send theirs and wait for it. The
    exchange is plain, unauthenticated JSON over TCP: keep ``master`` on the
    private network the workers use.

    Example:
        ```python
        from keras_replicator.launch import rendezvous
        # on node 1 of 2, its workers on free ports of its address 10.0.0.2:
        table = rendezvous("10.0.0.1:29400", 2, 1, ["10.0.0.2:41001", "10.0.0.2:41002"])
        # [['10.0.0.1:40411', '10.0.0.1:40412'], ['10.0.0.2:41001', '10.0.0.2:41002']]
        ```

    Args:
        master: ``host:port`` of node 0's rendezvous server.
        nnodes: number of nodes.
        node_rank: this node's rank, ``0 .. nnodes - 1``.
        addresses: this node's workers' ``host:port``.
        timeout: seconds to wait for every node.

    Returns:
        Every node's worker addresses, in node-rank order.
    """
    host, port = _split_address(master, "master")
    nnodes = check_int("nnodes", nnodes, minimum=1)
    node_rank = check_int("node_rank", node_rank, minimum=0, maximum=nnodes - 1)
    timeout = check_number("timeout", timeout, positive=True)
    addresses = list(addresses)
    deadline = time.monotonic() + timeout
    if nnodes == 1:
        return [addresses]
    if node_rank == 0:
        table: dict[int, list[str]] = {0: addresses}
        peers: list[socket.socket] = []
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            with socket.create_server((host, port), family=family) as server:
                server.settimeout(0.5)
                while len(table) < nnodes:
                    if time.monotonic() > deadline:
                        missing = sorted(set(range(nnodes)) - set(table))
                        raise TimeoutError(
                            f"Rendezvous at {master}: node rank(s) {missing} did not arrive within "
                            f"{timeout:g} s (started with the same --nnodes and --master?)."
                        )
                    try:
                        peer, _ = server.accept()
                    except TimeoutError:  # socket.timeout
                        continue
                    peer.settimeout(30)
                    peers.append(peer)
                    message = json.loads(peer.makefile("r").readline() or "{}")
                    rank, count = message.get("rank"), message.get("nnodes")
                    if count != nnodes or not isinstance(rank, int) or not 0 < rank < nnodes or rank in table:
                        raise ValueError(
                            f"Rendezvous at {master}: a node says it is rank {rank!r} of {count!r}, "
                            f"but this job has {nnodes} nodes and ranks {sorted(table)} arrived already."
                        )
                    table[rank] = list(message["addresses"])
            reply = (json.dumps({"nodes": [table[r] for r in range(nnodes)]}) + "\n").encode()
            for peer in peers:
                peer.sendall(reply)
        finally:
            for peer in peers:
                peer.close()
        return [table[r] for r in range(nnodes)]
    while True:
        try:
            peer = socket.create_connection((host, port), timeout=5)
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"Rendezvous: node {node_rank} could not reach node 0 at {master} within "
                    f"{timeout:g} s ({e})."
                ) from None
            time.sleep(0.2)
    with peer:
        peer.settimeout(max(1.0, deadline - time.monotonic()))
        peer.sendall((json.dumps({"rank": node_rank, "nnodes": nnodes, "addresses": addresses}) + "\n").encode())
        try:
            line = peer.makefile("r").readline()
        except TimeoutError:
            raise TimeoutError(
                f"Rendezvous at {master}: node 0 did not answer node {node_rank} within "
                f"{timeout:g} s (is another node missing?)."
            ) from None
    if not line:
        raise TimeoutError(
            f"Rendezvous at {master}: node 0 ended the rendezvous without answering node "
            f"{node_rank} (a different --nnodes, or a --node-rank given twice?); see node 0's error."
        )
    return json.loads(line)["nodes"]


def _exit_code(returncode: int) -> int:
    """A process's return code as a shell reports it (128 + signal when killed)."""
    return 128 - returncode if returncode < 0 else returncode


def _detect_gpus(environ: Mapping[str, str]) -> list[str]:
    """The GPUs this machine offers its workers: ``CUDA_VISIBLE_DEVICES`` if set, else ``nvidia-smi -L``."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [g.strip() for g in environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, _ in enumerate(re.findall(r"^GPU \d+", listing, re.MULTILINE))]


def gpu_assignment(gpus: Sequence[str], local_workers: int) -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` of each local worker: the GPUs split evenly, in order.

    ``None`` when there are no GPUs, or fewer GPUs than workers (the workers
    then share what they see, and ``CUDA_VISIBLE_DEVICES`` is left alone).

    Example:
        ```python
        from keras_replicator.launch import gpu_assignment
        gpu_assignment(["0", "1", "2", "3"], 2)   # ['0,1', '2,3']
        ```

    Args:
        gpus: the GPU ids (``CUDA_VISIBLE_DEVICES`` entries) of this machine.
        local_workers: the number of workers started on this machine.
    """
    gpus = list(gpus)
    if not gpus or len(gpus) < local_workers:
        return None
    k = len(gpus) // local_workers
    return [",".join(gpus[i * k : (i + 1) * k]) for i in range(local_workers)]


_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_TAIL_LINES = 20


class _Signals:
    """While active (in the main thread), SIGINT, SIGTERM and SIGHUP are recorded, not fatal."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for s in _FORWARDED_SIGNALS:
                self._previous[s] = signal.signal(s, self._record)
        return self

    def _record(self, signum, frame) -> None:
        self.received.append(signum)

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


class _Worker:
    """One worker process, the thread copying its output, and its last lines."""

    def __init__(self, task: tuple[str, int], process: subprocess.Popen, echo: bool, out: TextIO,
                 log: TextIO | None, lock: threading.Lock):
        self.task, self.process, self.echo = task, process, echo
        self.name = f"{task[0]} {task[1]}"
        self.tail: deque[str] = deque(maxlen=_TAIL_LINES)
        self._out, self._log, self._lock = out, log, lock
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        prefix = f"[{self.name}] "
        stream = self.process.stdout
        for line in iter(stream.readline, ""):
            line = line if line.endswith("\n") else line + "\n"
            self.tail.append(line)
            with self._lock:
                if self._log is not None:
                    self._log.write(line)
                    self._log.flush()
                if self.echo:
                    self._out.write(prefix + line)
                    self._out.flush()
        stream.close()

    def signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.process.pid, signum)  # the worker's session: it and its children
        except (ProcessLookupError, PermissionError):
            pass


def _say(out: TextIO, lock: threading.Lock, message: str) -> None:
    with lock:
        out.write(f"[launcher] {message}\n")
        out.flush()


def _stop(workers: list[_Worker], signum: int, grace: float, signals: _Signals) -> None:
    """Sends ``signum`` to every live worker, waits up to ``grace`` s, then SIGKILLs what is left.

    A further signal to the launcher during the grace period kills at once. Returns
    only when every worker has exited and been reaped.
    """
    for w in workers:
        if w.process.poll() is None:
            w.signal_group(signum)
    seen = len(signals.received)
    deadline = time.monotonic() + grace
    while any(w.process.poll() is None for w in workers):
        if time.monotonic() > deadline or len(signals.received) > seen:
            break
        time.sleep(0.02)
    for w in workers:
        # Also the children a worker left behind in its session (its group outlives it).
        w.signal_group(signal.SIGKILL)
        w.process.wait()


def _check_module_name(name: object) -> None:
    if not isinstance(name, str) or not all(part.isidentifier() for part in name.split(".")):
        raise ValueError(f"module must be a dotted module name such as 'pkg.train', got {name!r}.")


def _check_module(name: object, pythonpath: str) -> None:
    """Refuses a module ``python -m`` would not find, without importing it (nor TensorFlow).

    Looks where a worker's ``python -m`` looks: its working directory (this one), its
    ``PYTHONPATH``, then this interpreter's ``sys.path`` and finders.
    """
    _check_module_name(name)
    parts = name.split(".")
    first = [os.getcwd(), *(p for p in pythonpath.split(os.pathsep) if p)]
    spec = importlib.machinery.PathFinder.find_spec(parts[0], first) or importlib.util.find_spec(parts[0])
    for i in range(1, len(parts)):
        if spec is None or not spec.submodule_search_locations:
            spec = None
            break
        spec = importlib.machinery.PathFinder.find_spec(
            ".".join(parts[: i + 1]), list(spec.submodule_search_locations))
    if spec is None:
        raise ModuleNotFoundError(f"No module named {name!r} for `python -m` here.")


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
        _split_address(master, "master")
        if node_rank is None:
            raise ValueError(f"nnodes={nnodes}: give node_rank (--node-rank), 0 .. {nnodes - 1}.")
        node_rank = check_int("node_rank", node_rank, minimum=0, maximum=nnodes - 1)
        check_number("rendezvous_timeout", rendezvous_timeout, positive=True)
        mine = [_format_address(host, p) for p in free_ports(workers, host)]
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
        addresses = iter(_format_address(host, p) for p in free_ports(len(tasks), host))
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


class _Job:
    """The local tasks of a job, started together; one `run` per start of the job."""

    def __init__(self, command, args, tasks, devices_per_worker, gpus_of, base_env, tee, logs,
                 grace, max_restarts, out, lock):
        self.command, self.args, self.tasks = command, args, tasks
        self.devices_per_worker, self.gpus_of, self.base_env = devices_per_worker, gpus_of, base_env
        self.tee, self.logs, self.grace = tee, logs, grace
        self.max_restarts, self.out, self.lock = max_restarts, out, lock
        self.parameter_servers = any(job == "ps" for job, _ in tasks)
        self.chief = ("chief", 0) if self.parameter_servers else ("worker", 0)

    def _start(self, cluster, task, restart) -> _Worker:
        job, index = task
        env = dict(self.base_env)
        env.update(TF_CONFIG=tf_config(cluster, index, job), PYTHONUNBUFFERED="1",
                   **{RESTART_COUNT_ENV: str(restart)})
        if job == "worker":
            env[WORKER_INDEX_ENV] = str(index)
        if self.devices_per_worker is not None:
            env[DEVICES_PER_WORKER_ENV] = str(self.devices_per_worker)
        if task in self.gpus_of:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus_of[task]
        process = subprocess.Popen(
            [*self.command, *self.args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,  # its own process group: signalled as a whole
        )
        echo = self.tee == "all" or (self.tee == "chief" and task == self.chief)
        return _Worker(task, process, echo, self.out, self.logs.get(task), self.lock)

    def _print_tail(self, w: _Worker) -> None:
        if w.echo:
            return
        w.thread.join(timeout=5)
        with self.lock:
            self.out.write(f"[launcher] the last lines of {w.name}:\n")
            self.out.writelines(f"[{w.name}] {line}" for line in w.tail)
            self.out.flush()

    def run(self, cluster, attempt, deadline, timeout, signals) -> tuple[int, bool]:
        """One start of the local tasks; (exit code, whether restarting the job may help)."""
        out, lock = self.out, self.lock
        workers: list[_Worker] = []
        restarts = dict.fromkeys(self.tasks, 0)  # per-task restarts (parameter-server jobs)
        try:
            for task in self.tasks:
                workers.append(self._start(cluster, task, attempt))
            while True:
                if signals.received:
                    signum = signals.received[0]
                    name = signal.Signals(signum).name
                    _say(out, lock, f"got {name}: forwarding it to every worker "
                                    f"(SIGKILL after {self.grace:g} s or on a second signal)")
                    _stop(workers, signum, self.grace, signals)
                    _say(out, lock, "every worker has exited")
                    return 128 + signum, False
                if self.parameter_servers:
                    chief = workers[0]
                    if chief.process.poll() == 0:  # the coordinator finished: the job is done
                        _say(out, lock, "the chief finished; stopping the workers and ps tasks")
                        _stop(workers, signal.SIGTERM, self.grace, signals)
                        return 0, False
                failed = [w for w in workers if w.process.poll() not in (None, 0)]
                for w in failed:
                    code = _exit_code(w.process.returncode)
                    if (self.parameter_servers and w.task[0] == "worker"
                            and restarts[w.task] < self.max_restarts):
                        # As Kubernetes' restartPolicy OnFailure: this worker alone, same address.
                        restarts[w.task] += 1
                        _say(out, lock, f"{w.name} exited with code {code}; restarting it (restart "
                                        f"{restarts[w.task]} of {self.max_restarts})")
                        self._print_tail(w)
                        w.signal_group(signal.SIGKILL)  # anything it left behind
                        w.thread.join(timeout=5)
                        workers[workers.index(w)] = self._start(cluster, w.task, restarts[w.task])
                        continue
                    _say(out, lock, f"{w.name} exited with code {code}; stopping the others")
                    _stop(workers, signal.SIGTERM, self.grace, signals)
                    self._print_tail(w)
                    # A parameter-server job restarts its workers alone, never as a whole.
                    return code, not self.parameter_servers
                if all(w.process.poll() is not None for w in workers):
                    return 0, False
                if deadline is not None and time.monotonic() > deadline:
                    _say(out, lock, f"timeout after {timeout:g} s; stopping every worker")
                    _stop(workers, signal.SIGTERM, self.grace, signals)
                    return 124, False
                time.sleep(0.05)
        finally:
            # Also reached on an unexpected error: never leave workers behind.
            _stop(workers, signal.SIGTERM, self.grace, signals)
            for w in workers:
                w.thread.join(timeout=5)


_K8S_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def _yaml_str(s: str) -> str:
    return json.dumps(s)  # a JSON string is a valid YAML double-quoted scalar


def k8s_manifest(
    script: str,
    args: Sequence[str] = (),
    *,
    workers: int,
    image: str,
    name: str = "keras-replicator",
    namespace: str | None = None,
    gpus_per_worker: int = 0,
    restart_policy: str = "OnFailure",
    python: str = "python",
    ps: int = 0,
    module: bool = False,
) -> str:
    """A Kubeflow ``TFJob`` manifest (YAML) running ``script`` on ``workers`` pods.

    The training operator creates one pod per worker and sets ``TF_CONFIG`` in
    each, so the same script that `launch` runs locally runs unchanged.
    Worker 0 is the chief. With ``restart_policy="OnFailure"`` a failed pod is
    restarted; with ``keras.callbacks.BackupAndRestore`` writing to a volume all
    pods share, the job resumes from the last saved epoch.

    Example:
        ```python
        from keras_replicator.launch import k8s_manifest
        print(k8s_manifest("train.py", workers=4, image="registry.example/train:1"))
        ```

    Args:
        script: the script's path inside the image.
        args: its command-line arguments.
        workers: number of worker pods, >= 1.
        image: the container image holding TensorFlow, keras_replicator and the script.
        name: the TFJob's name (a Kubernetes name: lower-case letters, digits, '-').
        namespace: the Kubernetes namespace; ``None`` for the current one.
        gpus_per_worker: ``nvidia.com/gpu`` limit per pod (0: none).
        restart_policy: ``"OnFailure"``, ``"Always"``, ``"Never"`` or ``"ExitCode"``.
        python: the interpreter command inside the image.
        ps: parameter-server pods: with ``ps=M`` the TFJob has a ``Chief`` (the
            coordinator of asynchronous training), ``workers`` ``Worker`` pods and
            ``M`` ``PS`` pods, each with the same container (GPUs for the chief
            and workers only).
        module: ``script`` is a module name, run as ``python -m script``.

    Returns:
        The manifest, for ``kubectl apply -f -``.
    """
    if module:
        _check_module_name(script)
    elif not isinstance(script, str) or not script:
        raise ValueError(f"script must be a path inside the image, got {script!r}.")
    args = list(args)
    if not all(isinstance(a, str) for a in args):
        raise TypeError(f"args must be strings, got {args!r}.")
    check_int("workers", workers, minimum=1)
    if not isinstance(image, str) or not image or any(c.isspace() for c in image):
        raise ValueError(f"image must be a container image reference, got {image!r}.")
    for label, value in (("name", name), ("namespace", namespace)):
        if value is None and label == "namespace":
            continue
        if not isinstance(value, str) or len(value) > 63 or not _K8S_NAME.fullmatch(value):
            raise ValueError(
                f"{label} must be a Kubernetes name (at most 63 lower-case letters, digits or '-', "
                f"starting and ending with a letter or digit), got {value!r}."
            )
    check_int("gpus_per_worker", gpus_per_worker, minimum=0)
    policies = ("OnFailure", "Always", "Never", "ExitCode")
    if restart_policy not in policies:
        raise ValueError(f"restart_policy must be one of {policies}, got {restart_policy!r}.")

    ps = check_int("ps", ps, minimum=0)

    run = [python, "-m", script] if module else [python, script]
    command = ", ".join(_yaml_str(c) for c in [*run, *args])
    lines = [
        "apiVersion: kubeflow.org/v1",
        "kind: TFJob",
        "metadata:",
        f"  name: {name}",
        *([f"  namespace: {namespace}"] if namespace else []),
        "spec:",
        "  runPolicy:",
        "    cleanPodPolicy: Running",
        "  tfReplicaSpecs:",
    ]
    replicas = [("Chief", 1), ("Worker", workers), ("PS", ps)] if ps else [("Worker", workers)]
    for kind, count in replicas:
        lines += [
            f"    {kind}:",
            f"      replicas: {count}",
            f"      restartPolicy: {restart_policy}",
            "      template:",
            "        spec:",
            "          containers:",
            "            - name: tensorflow  # the training operator expects this name",
            f"              image: {_yaml_str(image)}",
            f"              command: [{command}]",
            "              ports:",
            "                - name: tfjob-port",
            "                  containerPort: 2222",
        ]
        if gpus_per_worker and kind != "PS":
            lines += [
                "              resources:",
                "                limits:",
                f"                  nvidia.com/gpu: {gpus_per_worker}",
            ]
    return "\n".join(lines) + "\n"
