"""Process supervision: start, wait for, stop and restart the local worker processes of a job."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections import deque
from typing import TextIO

from keras_replicator.launch.addresses import tf_config
from keras_replicator.launch.environment import (
    DEVICES_PER_WORKER_ENV,
    RESTART_COUNT_ENV,
    WORKER_INDEX_ENV,
)


def _exit_code(returncode: int) -> int:
    """A process's return code as a shell reports it (128 + signal when killed)."""
    return 128 - returncode if returncode < 0 else returncode



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

