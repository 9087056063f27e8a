"""`LaunchConfig`: what to launch and how, validated once, built from the command line or from Python.

The model is torch's ``LaunchConfig`` (``torch/distributed/launcher/api.py``):
a dataclass checked in ``__post_init__``, which the command line
(``keras_replicator/__main__.py``) and `launch` both build, so every bad input
gets its error before any process starts. A job is one of three kinds:

- one machine: ``workers=N`` (with ``ps=M``: a chief, ``N`` workers and ``M``
  parameter servers; with ``workers="MIN:MAX"``, an elastic job that starts
  ``MAX`` workers and may go on with as few as ``MIN``);
- several machines listed up front: ``hosts="h1:2,h2:2"`` and this node's
  ``node_rank``;
- several machines that find each other: ``nnodes``, ``master`` (node 0's
  rendezvous address), ``workers`` per node and ``node_rank``.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence

from keras_replicator._validation import ArgumentError, check_choice, check_int, check_number
from keras_replicator.launch.addresses import cluster_addresses, parse_hosts, split_address


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """One node's share of a multi-worker job, checked when it is built.

    Every field is as in `launch` (which builds one); after construction
    ``args`` is a tuple, ``hosts`` a tuple of ``(host, count)`` pairs,
    ``node_rank`` an integer (0 for a one-machine job), ``gpus`` a tuple of
    strings (or ``None``: detect them), and ``workers="MIN:MAX"`` is
    ``workers=MAX, min_workers=MIN`` (with ``worker_failures`` 2 unless given).

    Example:
        ```python
        from keras_replicator.launch import LaunchConfig
        config = LaunchConfig("json.tool", ["--help"], module=True, workers=2, devices_per_worker=2)
        config.mode       # 'workers'
        config.command    # [sys.executable, '-m', 'json.tool', '--help']
        # launch(config) runs it; LaunchConfig(..., workers=0) raises before anything starts.
        elastic = LaunchConfig("json.tool", module=True, workers="1:4")
        (elastic.min_workers, elastic.workers, elastic.worker_failures)   # (1, 4, 2)
        ```
    """

    script: str
    args: Sequence[str] = ()
    workers: int | str | None = None
    devices_per_worker: int | None = None
    host: str = "127.0.0.1"
    hosts: str | Sequence[tuple[str, int]] | None = None
    node_rank: int | None = None
    port: int = 2222
    nnodes: int | None = None
    master: str | None = None
    rendezvous_timeout: float = 300.0
    max_restarts: int = 0
    ps: int = 0
    log_dir: str | None = None
    tee: str = "all"
    gpus: Sequence[str] | None = None
    grace: float | None = None  # None: 5 s, grown to fit the measured save (launch.grace)
    env: Mapping[str, str] | None = None
    timeout: float | None = None
    python: str = sys.executable
    module: bool = False
    min_workers: int | None = None
    worker_failures: int | None = None

    def __post_init__(self) -> None:
        self._check_what_runs()
        if isinstance(self.workers, str):
            if self.min_workers is not None:
                raise ArgumentError(f"workers={self.workers!r} already gives min_workers; give one of them.")
            minimum, maximum = parse_worker_range(self.workers)
            self._set("workers", maximum)
            self._set("min_workers", minimum)
        self._set("devices_per_worker", check_int("devices_per_worker", self.devices_per_worker, minimum=1,
                                                  optional=True))
        if not isinstance(self.host, str) or not self.host or any(c.isspace() for c in self.host):
            raise ArgumentError(f"host must be an address such as '127.0.0.1', got {self.host!r}.")
        self._set("max_restarts", check_int("max_restarts", self.max_restarts, minimum=0))
        check_choice("tee", self.tee, ("all", "chief", "none"))
        if self.grace is not None:  # None: 5 s, grown to fit the measured save (launch.grace)
            self._set("grace", check_number("grace", self.grace, non_negative=True))
        self._set("timeout", check_number("timeout", self.timeout, positive=True, optional=True))
        if self.log_dir is not None and (not isinstance(self.log_dir, str) or not self.log_dir):
            raise ArgumentError(f"log_dir must be a directory path, got {self.log_dir!r}.")
        self._set("ps", check_int("ps", self.ps, minimum=0))
        if self.nnodes is not None:
            self._check_rendezvous_job()
        elif self.master is not None:
            raise ArgumentError("master= goes with nnodes= (the number of nodes).")
        elif self.hosts is None:
            self._check_one_machine_job()
        else:
            self._check_static_job()
        self._check_elastic()
        if self.gpus is not None:
            self._set("gpus", tuple(str(g) for g in self.gpus))
        self._set("env", dict(self.env or {}))

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)  # normalising a frozen dataclass in __post_init__

    def _check_what_runs(self) -> None:
        if self.module:
            if self.python == sys.executable:  # another interpreter has its own modules: not checked
                _check_module(self.script, dict(os.environ, **(self.env or {})).get("PYTHONPATH", ""))
            else:
                _check_module_name(self.script)
        elif not isinstance(self.script, str) or not self.script:
            raise ArgumentError(f"script must be a path to a Python file, got {self.script!r}.")
        elif not os.path.isfile(self.script):
            raise FileNotFoundError(f"Script {self.script!r} does not exist.")
        if isinstance(self.args, str) or not all(isinstance(a, str) for a in self.args):
            raise ArgumentError(f"args must be strings, got {list(self.args)!r}.")
        self._set("args", tuple(self.args))

    def _check_rendezvous_job(self) -> None:
        """Nodes that find each other through node 0 (torchrun's style)."""
        self._set("nnodes", check_int("nnodes", self.nnodes, minimum=1))
        nnodes = self.nnodes
        if self.hosts is not None or self.ps:
            raise ArgumentError("nnodes= (with master=) replaces hosts=, and does not take ps=.")
        if self.workers is None or self.master is None:
            raise ArgumentError("nnodes= needs workers= (per node) and master='host:port' (node 0's address).")
        check_int("workers", self.workers, minimum=1)
        split_address(self.master, "master")
        if self.node_rank is None:
            raise ArgumentError(f"nnodes={nnodes}: give node_rank (--node-rank), 0 .. {nnodes - 1}.")
        self._set("node_rank", check_int("node_rank", self.node_rank, minimum=0, maximum=nnodes - 1))
        check_number("rendezvous_timeout", self.rendezvous_timeout, positive=True)

    def _check_one_machine_job(self) -> None:
        if self.workers is None:
            raise ArgumentError("Give workers=N (one machine) or hosts='h1:2,h2:2' (several).")
        check_int("workers", self.workers, minimum=1)
        if self.node_rank not in (None, 0):
            raise ArgumentError(f"node_rank={self.node_rank!r} needs hosts= or nnodes= (the nodes of the job).")
        self._set("node_rank", 0)

    def _check_static_job(self) -> None:
        if self.workers is not None:
            raise ArgumentError("Give either workers= (one machine) or hosts= (several), not both.")
        if self.ps:
            raise ArgumentError("ps= runs a parameter-server job on one machine; use workers=, not hosts=.")
        nodes = parse_hosts(self.hosts)
        if self.node_rank is None and len(nodes) > 1:
            raise ArgumentError(
                f"hosts names {len(nodes)} nodes: give node_rank (--node-rank), this machine's "
                f"position in it, 0 .. {len(nodes) - 1}."
            )
        self._set("node_rank", check_int("node_rank", self.node_rank or 0, minimum=0, maximum=len(nodes) - 1))
        self._set("hosts", tuple(nodes))
        cluster_addresses(nodes, self.port)  # checks the port and the port ranges

    def _check_elastic(self) -> None:
        """``min_workers``: a one-machine synchronous job that may shrink (`RestartPolicy`)."""
        if self.min_workers is None:
            if self.worker_failures is not None:
                raise ArgumentError("worker_failures (--worker-failures) applies to an elastic job: "
                                    "give workers='MIN:MAX' (--workers MIN:MAX).")
            return
        self._set("min_workers", check_int("min_workers", self.min_workers, minimum=1))
        if self.mode != "workers" or self.ps:
            raise ArgumentError(
                "workers='MIN:MAX' (--workers MIN:MAX) is for a synchronous job on one machine: "
                "not with hosts=, nnodes= (the nodes of a job on several machines do not find "
                "each other again with fewer members) or ps= (a parameter-server job already "
                "goes on without a failed worker)."
            )
        if self.min_workers > self.workers:
            raise ArgumentError(f"workers='MIN:MAX' needs MIN <= MAX, got {self.min_workers}:{self.workers}.")
        self._set("worker_failures", check_int("worker_failures", 2 if self.worker_failures is None
                                               else self.worker_failures, minimum=1))

    @property
    def mode(self) -> str:
        """``"nnodes"`` (a rendezvous), ``"hosts"`` (a static host list) or ``"workers"`` (one machine)."""
        return "nnodes" if self.nnodes is not None else "hosts" if self.hosts is not None else "workers"

    @property
    def command(self) -> list[str]:
        """What every task runs: the interpreter, the script (or ``-m module``) and its arguments."""
        run = [self.python, "-m", self.script] if self.module else [self.python, self.script]
        return [*run, *self.args]


def parse_worker_range(text: str) -> tuple[int, int]:
    """``"MIN:MAX"`` as ``(MIN, MAX)``, checked (``"4"`` is ``(4, 4)``).

    Example:
        ```python
        from keras_replicator.launch.config import parse_worker_range
        parse_worker_range("1:4")   # (1, 4); "4:1", "0:2" and "1:" raise ArgumentError
        ```
    """
    parts = text.split(":") if isinstance(text, str) else []
    if not 1 <= len(parts) <= 2 or not all(p.strip().isdigit() for p in parts):
        raise ArgumentError(f"workers must be N or MIN:MAX with positive integers such as '2:4', got {text!r}.")
    minimum, maximum = int(parts[0]), int(parts[-1])
    if minimum < 1:
        raise ArgumentError(f"workers MIN:MAX needs MIN >= 1, got {text!r}.")
    if minimum > maximum:
        raise ArgumentError(f"workers MIN:MAX needs MIN <= MAX, got {text!r}.")
    return minimum, maximum


def _check_module_name(name: object) -> None:
    if not isinstance(name, str) or not all(part.isidentifier() for part in name.split(".")):
        raise ArgumentError(f"module must be a dotted module name such as 'pkg.train', got {name!r}.")


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

