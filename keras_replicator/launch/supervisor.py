"""Process supervision: start, wait for, stop and restart the local worker processes of a job.

The model is torch's ``elastic/multiprocessing`` (start / wait / close) with
one restart policy: `RestartPolicy` says what a failure leads to, and
`Supervisor` carries it out (a task restarted alone, the job going on without a
worker, every local task restarted, the job restarted without a worker that
keeps failing, or the job ended).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

from keras_replicator._validation import check_int
from keras_replicator.launch.addresses import tf_config
from keras_replicator.launch.environment import (
    DEVICES_PER_WORKER_ENV,
    PREEMPTED_EXIT_CODE,
    RESTART_COUNT_ENV,
    SAVE_RECORD_ENV,
    WORKER_INDEX_ENV,
)
from keras_replicator.launch.grace import SaveRecordWatch

Task = tuple[str, int]  # (job, index): ("worker", 1), ("chief", 0), ("ps", 0)

_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_TAIL_LINES = 20


def _exit_code(returncode: int) -> int:
    """A process's return code as a shell reports it (128 + signal when killed)."""
    return 128 - returncode if returncode < 0 else returncode


class Action(enum.Enum):
    """What a task's failure leads to (see `RestartPolicy`)."""

    RESTART_TASK = "restart the task alone"
    GO_ON = "go on without the task"
    RESTART_JOB = "restart every local task"
    SHRINK = "restart the job without the task"
    END = "end the job"


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """The one place that decides what happens when a task fails.

    A synchronous job (every task a ``worker``) cannot lose a worker: its
    collectives need them all, so the whole job is restarted while
    ``max_restarts`` allows (``keras.callbacks.BackupAndRestore`` resumes it),
    then ended. A parameter-server job (``chief`` + ``worker`` + ``ps``) can:
    TensorFlow's coordinator runs a lost worker's steps on the others, so a
    failed worker is restarted alone (as Kubernetes' ``restartPolicy:
    OnFailure``; it rejoins the coordinator) while ``max_restarts`` allows for
    it, and the job goes on without it afterwards. The chief (the coordinator)
    and the parameter servers (the variables) cannot be lost: their failure
    ends the job.

    An elastic synchronous job (``min_workers``, the launcher's ``--workers
    MIN:MAX``) restarts as a plain one, except that a worker that cannot be
    restarted is left out: one that was the first to fail on
    ``worker_failures`` starts of the job in a row (a preempted worker,
    exit 143, is not blamed). The job then restarts with the others, if at
    least ``min_workers`` are left; ``BackupAndRestore`` resumes it from the
    backup. Every restart counts against ``max_restarts``, the shrinking ones
    included.

    Example:
        ```python
        from keras_replicator.launch import RestartPolicy
        policy = RestartPolicy(max_restarts=1, parameter_servers=True)
        policy.after_failure(("worker", 1), task_restarts=0, job_restarts=0)  # Action.RESTART_TASK
        policy.after_failure(("worker", 1), task_restarts=1, job_restarts=0)  # Action.GO_ON
        policy.after_failure(("ps", 0), task_restarts=0, job_restarts=0)      # Action.END
        elastic = RestartPolicy(max_restarts=3, min_workers=1)
        elastic.after_failure(("worker", 1), 0, 0, failures_in_a_row=1, workers=2)  # Action.RESTART_JOB
        elastic.after_failure(("worker", 1), 0, 1, failures_in_a_row=2, workers=2)  # Action.SHRINK
        ```

    Args:
        max_restarts: restarts of the job (synchronous), or of each worker
            (parameter-server job).
        parameter_servers: whether the job is a parameter-server job.
        min_workers: an elastic synchronous job: the fewest workers it may go
            on with (``None``: not elastic).
        worker_failures: an elastic job leaves out a worker that was the first
            to fail on this many starts in a row.
    """

    max_restarts: int = 0
    parameter_servers: bool = False
    min_workers: int | None = None
    worker_failures: int = 2

    def __post_init__(self) -> None:
        check_int("max_restarts", self.max_restarts, minimum=0)
        check_int("min_workers", self.min_workers, minimum=1, optional=True)
        check_int("worker_failures", self.worker_failures, minimum=1)
        if self.parameter_servers and self.min_workers is not None:
            raise ValueError("min_workers (an elastic synchronous job) does not go with parameter_servers.")

    def after_failure(self, task: Task, task_restarts: int, job_restarts: int, *,
                      failures_in_a_row: int = 1, workers: int | None = None) -> Action:
        """What to do when ``task`` failed, after ``task_restarts`` of it and ``job_restarts`` of the job.

        ``failures_in_a_row``: on how many starts of the job in a row (this one
        included) ``task`` was the first to fail; ``workers``: how many workers
        the job has now (both for an elastic job).
        """
        if not self.parameter_servers:
            if job_restarts >= self.max_restarts:
                return Action.END
            if (self.min_workers is not None and workers is not None and failures_in_a_row >= self.worker_failures
                    and workers - 1 >= self.min_workers):
                return Action.SHRINK
            return Action.RESTART_JOB
        if task[0] != "worker":
            return Action.END
        return Action.RESTART_TASK if task_restarts < self.max_restarts else Action.GO_ON


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


class Console:
    """The launcher's output: worker lines and its own ``[launcher]`` messages, one writer at a time."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.lock = threading.Lock()

    def say(self, message: str) -> None:
        with self.lock:
            self.out.write(f"[launcher] {message}\n")
            self.out.flush()


class _Worker:
    """One task's process, the thread copying its output, and its last lines."""

    def __init__(self, task: Task, process: subprocess.Popen, echo: bool, console: Console,
                 log: TextIO | None):
        self.task, self.process, self.echo = task, process, echo
        self.name = f"{task[0]} {task[1]}"
        self.tail: deque[str] = deque(maxlen=_TAIL_LINES)
        self._console, self._log = console, log
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        prefix = f"[{self.name}] "
        stream = self.process.stdout
        for line in iter(stream.readline, ""):
            line = line if line.endswith("\n") else line + "\n"
            self.tail.append(line)
            with self._console.lock:
                if self._log is not None:
                    self._log.write(line)
                    self._log.flush()
                if self.echo:
                    self._console.out.write(prefix + line)
                    self._console.out.flush()
        stream.close()

    def signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.process.pid, signum)  # the worker's session: it and its children
        except (ProcessLookupError, PermissionError):
            pass

    def print_tail(self) -> None:
        """Prints the last lines of a task whose output was not echoed."""
        if self.echo:
            return
        self.thread.join(timeout=5)
        with self._console.lock:
            self._console.out.write(f"[launcher] the last lines of {self.name}:\n")
            self._console.out.writelines(f"[{self.name}] {line}" for line in self.tail)
            self._console.out.flush()


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What every local task runs, and the environment it gets besides its ``TF_CONFIG``.

    Args:
        command: the interpreter and script (or ``-m module``) with its arguments.
        env: the base environment.
        devices_per_worker: ``KERAS_REPLICATOR_DEVICES_PER_WORKER``, if set.
        gpus_of: ``CUDA_VISIBLE_DEVICES`` of the tasks that get GPUs.
        tee: whose output is printed: ``"all"``, ``"chief"`` or ``"none"``.
        logs: an open log file per task.
    """

    command: Sequence[str]
    env: Mapping[str, str]
    devices_per_worker: int | None = None
    gpus_of: Mapping[Task, str] = dataclasses.field(default_factory=dict)
    tee: str = "all"
    logs: Mapping[Task, TextIO] = dataclasses.field(default_factory=dict)


class Supervisor:
    """Starts the local tasks of a job, waits for them, stops them, restarts them by `RestartPolicy`.

    SIGINT, SIGTERM and SIGHUP sent to the launcher meanwhile are forwarded to
    every task; the supervisor waits for them (SIGKILL after ``grace`` seconds,
    or at once on a second signal) and never returns before them. ``grace=None``:
    5 s, grown to fit the chief's measured backup save (`keras_replicator.launch.grace`).

    Example:
        ```python
        import sys
        from keras_replicator.launch.supervisor import Console, RestartPolicy, Supervisor, WorkerSpec
        spec = WorkerSpec([sys.executable, "-c", "print('hi')"], env={})
        supervisor = Supervisor(spec, [("worker", 0)], RestartPolicy(), Console(sys.stdout))
        supervisor.run(lambda: {"worker": ["127.0.0.1:2222"]})   # 0, after "[worker 0] hi"
        ```
    """

    def __init__(self, spec: WorkerSpec, tasks: Sequence[Task], policy: RestartPolicy,
                 console: Console, grace: float | None = None, timeout: float | None = None):
        self.spec, self.tasks, self.policy, self.console = spec, list(tasks), policy, console
        self.timeout = timeout
        # The chief records each backup's save time in a file `run` makes (atomic_files.record_save);
        # the watch fits the grace to it, or warns when the grace given is shorter.
        self.save_record = SaveRecordWatch("", grace, console.say)
        self.chief: Task = ("chief", 0) if policy.parameter_servers else ("worker", 0)
        # Each task's slot: the task it was at the first start, whose GPUs and log it keeps
        # after an elastic job left a worker out and renumbered the others.
        self.slots: dict[Task, Task] = {t: t for t in self.tasks}
        self._failures_in_a_row: dict[Task, int] = {}  # slot -> starts in a row it failed first
        self._workers: list[_Worker] = []
        self._cluster: dict[str, list[str]] = {}
        self._signals = _Signals()

    def run(self, cluster: Callable[[], dict[str, list[str]]]) -> int:
        """Runs the job to its end, restarting it as the policy says; its exit code.

        Args:
            cluster: the cluster of a start of the job (called once per start).

        Returns:
            0 when the job succeeded, else the first failure's exit code of the
            last start (128 + N for a task killed by signal N), 128 + N when
            the launcher got signal N, 124 on timeout.
        """
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        record_dir = tempfile.mkdtemp(prefix="keras_replicator_launch_")
        self.save_record.path = os.path.join(record_dir, "last_save.json")
        try:
            return self._run(cluster, deadline)
        finally:
            shutil.rmtree(record_dir, ignore_errors=True)

    @property
    def grace(self) -> float:
        """Seconds between forwarding a stop signal and SIGKILL (grown to fit a measured save
        when not given)."""
        return self.save_record.grace

    def _run(self, cluster: Callable[[], dict[str, list[str]]], deadline: float | None) -> int:
        with self._signals:
            for attempt in range(self.policy.max_restarts + 1):
                if attempt:
                    self.console.say(f"restarting every worker (restart {attempt} of {self.policy.max_restarts})")
                    for f in self.spec.logs.values():
                        f.write(f"[launcher] restart {attempt} of {self.policy.max_restarts}\n")
                try:
                    self.start(self._cluster_of(cluster()), attempt)
                    code, action = self.wait(attempt, deadline)
                finally:  # also on an unexpected error: never leave workers behind
                    self.stop(signal.SIGTERM)
                if action not in (Action.RESTART_JOB, Action.SHRINK):
                    break
        return code

    def _cluster_of(self, jobs: dict[str, list[str]]) -> dict[str, list[str]]:
        """An elastic job's cluster has the addresses of the workers it has now (the first ones)."""
        if self.policy.min_workers is None:
            return jobs
        return {**jobs, "worker": jobs["worker"][: len(self.tasks)]}

    def start(self, cluster: dict[str, list[str]], restart: int = 0) -> None:
        """Starts every local task in ``cluster``."""
        self._workers = [self._start(cluster, task, restart) for task in self.tasks]
        self._cluster = cluster

    def _start(self, cluster: dict[str, list[str]], task: Task, restart: int) -> _Worker:
        job, index = task
        slot = self.slots[task]
        env = dict(self.spec.env)
        env.update(TF_CONFIG=tf_config(cluster, index, job), PYTHONUNBUFFERED="1",
                   **{RESTART_COUNT_ENV: str(restart)})
        if self.save_record.path:
            env[SAVE_RECORD_ENV] = self.save_record.path
        if job == "worker":
            env[WORKER_INDEX_ENV] = str(index)
        if self.spec.devices_per_worker is not None:
            env[DEVICES_PER_WORKER_ENV] = str(self.spec.devices_per_worker)
        if slot in self.spec.gpus_of:
            env["CUDA_VISIBLE_DEVICES"] = self.spec.gpus_of[slot]
        process = subprocess.Popen(
            list(self.spec.command),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,  # its own process group: signalled as a whole
        )
        echo = self.spec.tee == "all" or (self.spec.tee == "chief" and task == self.chief)
        return _Worker(task, process, echo, self.console, self.spec.logs.get(slot))

    def wait(self, attempt: int = 0, deadline: float | None = None) -> tuple[int, Action]:
        """Waits until the started tasks end the job; its exit code and what the policy says next."""
        restarts = dict.fromkeys(self.tasks, 0)  # per-task restarts (parameter-server jobs)
        lost: set[Task] = set()  # workers a parameter-server job goes on without
        while True:
            self.save_record.poll()
            if self._signals.received:
                signum = self._signals.received[0]
                self.console.say(f"got {signal.Signals(signum).name}: forwarding it to every worker "
                                 f"(SIGKILL after {self.grace:g} s or on a second signal)")
                self.stop(signum)
                self.console.say("every worker has exited")
                return 128 + signum, Action.END
            if self.policy.parameter_servers and self._workers[0].process.poll() == 0:
                self.console.say("the chief finished; stopping the workers and ps tasks")
                return 0, Action.END  # the coordinator finished: the job is done
            for w in [w for w in self._workers if w.process.poll() not in (None, 0) and w.task not in lost]:
                code = _exit_code(w.process.returncode)
                action = self.policy.after_failure(w.task, restarts[w.task], attempt, workers=len(self.tasks),
                                                   failures_in_a_row=self._blame(w.task, code))
                if action is Action.RESTART_TASK:
                    restarts[w.task] += 1
                    self.console.say(f"{w.name} exited with code {code}; restarting it (restart "
                                     f"{restarts[w.task]} of {self.policy.max_restarts})")
                    self._restart(w, restarts[w.task])
                    continue
                if action is Action.GO_ON and len(lost) + 1 < sum(t[0] == "worker" for t in self.tasks):
                    lost.add(w.task)
                    self.console.say(f"{w.name} exited with code {code}; the job goes on without it "
                                     "(the chief runs its steps on the other workers)")
                    w.print_tail()
                    continue
                if action is Action.SHRINK:
                    self.console.say(
                        f"{w.name} exited with code {code}, the first to fail on {self.policy.worker_failures} "
                        f"starts in a row: stopping the others and leaving it out; the job goes on with "
                        f"{len(self.tasks) - 1} worker(s) (at least {self.policy.min_workers})")
                else:
                    self.console.say(f"{w.name} exited with code {code}; stopping the others"
                                     + _why_the_job_ends(w.task, self.policy, action))
                self.stop(signal.SIGTERM)
                w.print_tail()
                if action is Action.SHRINK:
                    self._leave_out(w.task)
                return code, action
            if all(w.process.poll() is not None for w in self._workers):
                return 0, Action.END
            if deadline is not None and time.monotonic() > deadline:
                self.console.say(f"timeout after {self.timeout:g} s; stopping every worker")
                self.stop(signal.SIGTERM)
                return 124, Action.END
            time.sleep(0.05)

    def _blame(self, task: Task, code: int) -> int:
        """On how many starts in a row (this one included) ``task``'s slot failed first.

        A preempted worker (exit 143) is not to blame, and breaks every row.
        """
        slot = self.slots[task]
        in_a_row = 0 if code == PREEMPTED_EXIT_CODE else self._failures_in_a_row.get(slot, 0) + 1
        self._failures_in_a_row = {slot: in_a_row} if in_a_row else {}
        return in_a_row

    def _leave_out(self, task: Task) -> None:
        """The job's next start is without ``task``: the other workers, renumbered 0, 1, ... in order."""
        kept = [self.slots[t] for t in self.tasks if t != task]
        self.tasks = [("worker", i) for i in range(len(kept))]
        self.slots = dict(zip(self.tasks, kept))
        self._failures_in_a_row = {}

    def _restart(self, w: _Worker, restart: int) -> None:
        """Restarts one task alone, at the same address (the others keep running)."""
        w.print_tail()
        w.signal_group(signal.SIGKILL)  # anything it left behind
        w.thread.join(timeout=5)
        self._workers[self._workers.index(w)] = self._start(self._cluster, w.task, restart)

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Sends ``signum`` to every live task, waits up to ``grace`` s, then SIGKILLs what is left.

        A further signal to the launcher during the grace period kills at once.
        Returns only when every task has exited and been reaped.
        """
        workers = self._workers
        self.save_record.poll()
        for w in workers:
            if w.process.poll() is None:
                w.signal_group(signum)
        seen = len(self._signals.received)
        deadline = time.monotonic() + self.grace
        while any(w.process.poll() is None for w in workers):
            if time.monotonic() > deadline or len(self._signals.received) > seen:
                break
            time.sleep(0.02)
        for w in workers:
            # Also the children a worker left behind in its session (its group outlives it).
            w.signal_group(signal.SIGKILL)
            w.process.wait()
        for w in workers:
            w.thread.join(timeout=5)


def _why_the_job_ends(task: Task, policy: RestartPolicy, action: Action) -> str:
    """The reason a parameter-server job ends on ``task``'s failure, for the launcher's message."""
    if not policy.parameter_servers:
        return ""
    if task[0] == "ps":
        return " (a parameter-server job cannot go on without a parameter server: its variables are lost)"
    if task[0] == "chief":
        return " (the chief is the coordinator: the job cannot go on without it)"
    return " (no worker is left)"
