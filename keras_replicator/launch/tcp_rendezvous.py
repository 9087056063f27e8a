"""The TCP rendezvous of ``--nnodes``/``--master``: every node learns every node's worker addresses."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Sequence

from keras_replicator._validation import check_int, check_number
from keras_replicator.launch.addresses import split_address


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
    host, port = split_address(master, "master")
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

