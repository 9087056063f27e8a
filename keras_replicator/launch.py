"""Starting a multi-worker job: local worker processes, and a Kubeflow ``TFJob`` manifest.

:func:`launch` (``keras-replicator launch``) runs one training script as ``N``
worker processes on this machine, each with its own ``TF_CONFIG`` on free ports
of ``127.0.0.1``: the quickest way to try multi-worker code, and the way the test
suite runs it. :func:`k8s_manifest` (``keras-replicator k8s``) writes the same job
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

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

# Read by ReplicatorStrategy (through cluster.py) at creation: simulate this many
# CPU devices per worker. The launcher sets it for --devices-per-worker.
DEVICES_PER_WORKER_ENV = "KERAS_REPLICATOR_DEVICES_PER_WORKER"
# Set for each launched worker: its index, so scripts and logs can tell them apart.
WORKER_INDEX_ENV = "KERAS_REPLICATOR_WORKER_INDEX"

# A multi-worker TensorFlow process takes SIGTERM as a preemption notice and keeps
# running (the coordination service's preemption notifier catches it), so the
# launcher follows SIGTERM with SIGKILL after this grace period.
_STOP_GRACE_SECONDS = 5.0


def _check_positive_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return value


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
    _check_positive_int("n", n)
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


def tf_config(addresses: Sequence[str], index: int) -> str:
    """The ``TF_CONFIG`` JSON for worker ``index`` of a cluster of ``addresses``.

    Every task is a ``worker``; worker 0 is the chief (it writes checkpoints).

    Example:
        ```python
        from keras_replicator.launch import tf_config
        tf_config(["10.0.0.1:2222", "10.0.0.2:2222"], 1)
        # '{"cluster": {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]}, "task": {"type": "worker", "index": 1}}'
        ```

    Args:
        addresses: ``host:port`` of every worker, in worker order.
        index: this worker's position in ``addresses``.
    """
    addresses = list(addresses)
    if not addresses:
        raise ValueError("addresses is empty: give one host:port per worker.")
    for a in addresses:
        if not isinstance(a, str) or not re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[^\s:\[\]]+):\d{1,5}", a):
            raise ValueError(f"Worker address {a!r} is not of the form host:port.")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(addresses):
        raise ValueError(f"index must be an integer in [0, {len(addresses)}), got {index!r}.")
    return json.dumps({"cluster": {"worker": addresses}, "task": {"type": "worker", "index": index}})


def _exit_code(returncode: int) -> int:
    """A process's return code as a shell reports it (128 + signal when killed)."""
    return 128 - returncode if returncode < 0 else returncode


def _pump(stream, index: int, out: TextIO, lock: threading.Lock) -> None:
    prefix = f"[worker {index}] "
    for line in iter(stream.readline, ""):
        with lock:
            out.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
            out.flush()
    stream.close()


def _stop(processes: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM every live process group, then SIGKILL what is left after ``grace`` seconds."""
    for p in processes:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    for p in processes:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def launch(
    script: str,
    args: Sequence[str] = (),
    *,
    workers: int,
    devices_per_worker: int | None = None,
    host: str = "127.0.0.1",
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    python: str = sys.executable,
    output: TextIO | None = None,
) -> int:
    """Runs ``script`` as ``workers`` local worker processes of one multi-worker job.

    Each worker gets ``TF_CONFIG`` naming every worker at ``host`` on free ports
    (worker 0 is the chief), so a :class:`~keras_replicator.ReplicatorStrategy`
    created in the script joins the cluster. Each line a worker prints is
    written to ``output`` prefixed with ``[worker i]``. When a worker exits with
    an error, the others are stopped (SIGTERM, then SIGKILL after 5 s) and its
    exit code is returned.

    Example:
        ```python
        from keras_replicator.launch import launch
        code = launch("train.py", ["--epochs", "2"], workers=2, devices_per_worker=2)
        ```

    Args:
        script: path of the Python script every worker runs.
        args: command-line arguments for the script.
        workers: number of worker processes, >= 1.
        devices_per_worker: simulate this many CPU devices in each worker (sets
            ``KERAS_REPLICATOR_DEVICES_PER_WORKER``, which the strategy applies
            when it is created). ``None``: the worker's real devices.
        host: the address workers reach each other on. Keep the default
            ``127.0.0.1`` unless you know the network is private: TensorFlow's
            workers accept unauthenticated connections (and listen on every
            interface of the machine whatever this address).
        env: extra environment variables for the workers.
        timeout: stop every worker and return 124 after this many seconds.
        python: the interpreter to run the script with.
        output: where worker output goes (default ``sys.stdout``).

    Returns:
        0 when every worker succeeded, else the first non-zero exit code
        (128 + N for a worker killed by signal N), or 124 on timeout.
    """
    if not isinstance(script, str) or not script:
        raise ValueError(f"script must be a path to a Python file, got {script!r}.")
    if not os.path.isfile(script):
        raise FileNotFoundError(f"Script {script!r} does not exist.")
    args = list(args)
    if not all(isinstance(a, str) for a in args):
        raise TypeError(f"args must be strings, got {args!r}.")
    _check_positive_int("workers", workers)
    if devices_per_worker is not None:
        _check_positive_int("devices_per_worker", devices_per_worker)
    if not isinstance(host, str) or not host or any(c.isspace() for c in host):
        raise ValueError(f"host must be an address such as '127.0.0.1', got {host!r}.")
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}.")
    out = output if output is not None else sys.stdout

    addresses = [_format_address(host, p) for p in free_ports(workers, host)]
    processes: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    lock = threading.Lock()
    try:
        for i in range(workers):
            worker_env = dict(os.environ, **(env or {}))
            worker_env.update(
                TF_CONFIG=tf_config(addresses, i),
                PYTHONUNBUFFERED="1",
                **{WORKER_INDEX_ENV: str(i)},
            )
            if devices_per_worker is not None:
                worker_env[DEVICES_PER_WORKER_ENV] = str(devices_per_worker)
            p = subprocess.Popen(
                [python, script, *args],
                env=worker_env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                start_new_session=True,  # its own process group: stopped as a whole
            )
            processes.append(p)
            t = threading.Thread(target=_pump, args=(p.stdout, i, out, lock), daemon=True)
            t.start()
            pumps.append(t)

        deadline = None if timeout is None else time.monotonic() + timeout
        result = 0
        while True:
            running = [p for p in processes if p.poll() is None]
            failed = [p for p in processes if p.returncode not in (None, 0)]
            if failed:
                result = _exit_code(failed[0].returncode)
                index = processes.index(failed[0])
                with lock:
                    out.write(f"[launcher] worker {index} exited with code {result}; stopping the others\n")
                    out.flush()
                break
            if not running:
                break
            if deadline is not None and time.monotonic() > deadline:
                result = 124
                with lock:
                    out.write(f"[launcher] timeout after {timeout:g} s; stopping every worker\n")
                    out.flush()
                break
            time.sleep(0.05)
        return result
    finally:
        # Also reached on KeyboardInterrupt: never leave workers behind.
        _stop(processes, _STOP_GRACE_SECONDS)
        for t in pumps:
            t.join(timeout=5)


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
) -> str:
    """A Kubeflow ``TFJob`` manifest (YAML) running ``script`` on ``workers`` pods.

    The training operator creates one pod per worker and sets ``TF_CONFIG`` in
    each, so the same script that :func:`launch` runs locally runs unchanged.
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

    Returns:
        The manifest, for ``kubectl apply -f -``.
    """
    if not isinstance(script, str) or not script:
        raise ValueError(f"script must be a path inside the image, got {script!r}.")
    args = list(args)
    if not all(isinstance(a, str) for a in args):
        raise TypeError(f"args must be strings, got {args!r}.")
    _check_positive_int("workers", workers)
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
    _check_positive_int("gpus_per_worker", gpus_per_worker, minimum=0)
    policies = ("OnFailure", "Always", "Never", "ExitCode")
    if restart_policy not in policies:
        raise ValueError(f"restart_policy must be one of {policies}, got {restart_policy!r}.")

    command = ", ".join(_yaml_str(c) for c in [python, script, *args])
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
        "    Worker:",
        f"      replicas: {workers}",
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
    if gpus_per_worker:
        lines += [
            "              resources:",
            "                limits:",
            f"                  nvidia.com/gpu: {gpus_per_worker}",
        ]
    return "\n".join(lines) + "\n"
