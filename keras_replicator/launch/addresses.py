"""Addresses: THE ``host:port`` parser and formatter of the package, free ports, ``TF_CONFIG``."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Mapping, Sequence

from keras_replicator._validation import ArgumentError, check_int

# A host: a bracketed IPv6 address, or a name or IPv4 address (no spaces, ':', brackets, '/' or ',').
_HOST = r"\[[0-9A-Fa-f:.]+\]|[^\s:\[\]/,]+"
_ADDRESS = re.compile(rf"(?P<host>{_HOST}):(?P<port>\d{{1,5}})")
_HOST_COUNT = re.compile(rf"\s*(?P<host>{_HOST}):(?P<count>\d+)\s*")


def split_address(address: object, what: str = "address") -> tuple[str, int]:
    """``(host, port)`` of ``"host:port"`` (``"[ipv6]:port"``): the package's one address parser.

    Example:
        ```python
        from keras_replicator.launch import split_address
        split_address("10.0.0.1:2222")   # ('10.0.0.1', 2222)
        split_address("[::1]:2222")      # ('::1', 2222)
        ```

    Args:
        address: the address.
        what: how the error message names it.

    Raises:
        ValueError: not ``host:port``, or a port outside 1..65535.
    """
    m = _ADDRESS.fullmatch(address) if isinstance(address, str) else None
    if not m:
        raise ArgumentError(f"{what} must be host:port, got {address!r}.")
    port = int(m["port"])
    if not 1 <= port <= 65535:
        raise ArgumentError(f"{what}: port {port} of {address!r} is not in 1..65535.")
    return m["host"].strip("[]"), port


def format_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets: the inverse of `split_address`.

    Example:
        ```python
        from keras_replicator.launch import format_address
        format_address("::1", 2222)   # '[::1]:2222'
        ```
    """
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


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
        raise ArgumentError("addresses is empty: give one host:port per worker.")
    for job, tasks in cluster.items():
        for a in tasks:
            split_address(a, "A worker's address" if job == "worker" else f"The {job} task's address")
    if task_type not in cluster:
        raise ArgumentError(f"task_type {task_type!r} is not a job of the cluster {sorted(cluster)}.")
    n = len(cluster[task_type])
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n:
        raise ArgumentError(f"index must be an integer in [0, {n}), got {index!r}.")
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
            m = _HOST_COUNT.fullmatch(part)
            if not m:
                raise ArgumentError(
                    f"hosts must be comma-separated host:count entries such as 'h1:2,h2:2', "
                    f"got {spec!r} ({part!r} is not host:count)."
                )
            pairs.append((m["host"].strip("[]"), int(m["count"])))
    else:
        pairs = list(spec)
    if not pairs:
        raise ArgumentError("hosts is empty: give host:count for every node.")
    for entry in pairs:
        if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str) and entry[0]):
            raise ArgumentError(f"Each host must be a (host, count) pair, got {entry!r}.")
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
            raise ArgumentError(f"Ports {first}..{first + count - 1} of host {host!r} exceed 65535.")
        addresses += [format_address(host, first + i) for i in range(count)]
        next_port[host] = first + count
    return addresses
