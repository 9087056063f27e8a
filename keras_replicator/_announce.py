"""The one line a strategy says when it starts: what it is, its replicas and devices, its all-reduce.

TensorFlow's own start-up lines ("Using MirroredStrategy with devices ...") name the
engine, not the strategy the user made, and are kept from users at the default
verbosity (`keras_replicator._compat.tf_logging`). The line goes to the
``keras_replicator`` logger at INFO, which prints to stderr by default; silence it with
``logging.getLogger("keras_replicator").setLevel("WARNING")`` (before creating the
strategy, or after: the level is only set when the application has not set one).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

logger = logging.getLogger("keras_replicator")


def _default_handler() -> None:
    """A handler at INFO unless the application configured this logger itself.

    As TensorFlow's logger does: stdout in an interactive session (Jupyter, where stderr
    shows as an alarming red block), else stderr.
    """
    if logger.handlers or logger.level != logging.NOTSET:
        return
    interactive = hasattr(sys, "ps1") or bool(sys.flags.interactive)
    handler = logging.StreamHandler(sys.stdout if interactive else sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _short_devices(devices: Sequence[str]) -> str:
    """'/job:localhost/replica:0/task:0/device:CPU:0', ... as 'CPU:0, CPU:1' (one worker's)."""
    names = [d.rsplit("device:", 1)[-1] if "device:" in d else d.lstrip("/") for d in devices]
    return ", ".join(names)


def all_reduce_name(cross_device_ops, communication: str | None = None) -> str:
    """How gradients are all-reduced, in words: the ops' class, and the collective's implementation."""
    name = type(cross_device_ops).__name__ if cross_device_ops is not None else "none"
    if communication and communication != "auto":
        return f"{name} ({communication})"
    return name


def strategy_all_reduce(extended, communication: str, given_ops, per_replica_steps: bool) -> str:
    """The start-up line's all-reduce: outside steps and, where it differs, inside them.

    ``per_replica_steps``: a given non-collective ``given_ops`` makes every step traced per
    replica (said once, at WARNING).
    """
    all_reduce = all_reduce_name(extended.cross_device_ops, communication)
    in_steps = extended.step_all_reduce()
    if in_steps is not None and in_steps is not extended.cross_device_ops:
        return f"{all_reduce_name(in_steps, communication)} in steps, {all_reduce} outside them"
    if given_ops is not None and in_steps is None and per_replica_steps:
        per_replica_ops(type(given_ops).__name__)
        return all_reduce + " (in steps too: steps traced per replica)"
    return all_reduce


def announce(what: str, num_replicas: int, devices: Sequence[str], all_reduce: str,
             num_workers: int = 1, worker_index: int = 0) -> str:
    """Logs (and returns) the strategy's start-up line."""
    _default_handler()
    where = f"{len(devices)} local device(s): {_short_devices(devices)}"
    if num_workers > 1:
        where = f"{num_workers} workers (this is worker {worker_index}), {where}"
    line = f"{what}: {num_replicas} replica(s) on {where}; all-reduce: {all_reduce}"
    logger.info(line)
    return line


def per_replica_ops(name: str) -> str:
    """Logs (at WARNING, once per strategy) that a given non-collective all-reduce is kept in steps."""
    _default_handler()
    line = (f"cross_device_ops={name}() is not a collective all-reduce: it does the all-reduces "
            "inside steps too, through merge_call, so each step is traced once per replica (the "
            "time to the first step grows with the replicas). For one trace, leave "
            'cross_device_ops out, or pass communication="nccl" (or "ring").')
    logger.warning(line)
    return line


def announce_async(num_workers: int, num_ps: int) -> str:
    """Logs (and returns) `AsyncReplicatorStrategy`'s start-up line, on the chief."""
    _default_handler()
    line = (f"AsyncReplicatorStrategy: {num_workers} worker(s) stepping asynchronously, variables "
            f"on {num_ps} parameter server(s); all-reduce: none (each worker applies its own "
            "gradients)")
    logger.info(line)
    return line
