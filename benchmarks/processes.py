"""Worker processes: one alone (:func:`run_worker`), or a group taking turns (:func:`run_group`).

Every configuration runs in a fresh interpreter (``python -m benchmarks.worker``)
because the number of simulated CPU devices is fixed when TensorFlow starts.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
import time
from typing import Any

from benchmarks.protocol import GO, ROOT, STOP, TURN, read_result, worker_command


def run_worker(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Runs one worker process; returns its result or raises RuntimeError."""
    try:
        proc = subprocess.run(worker_command(spec), cwd=ROOT, env=worker_env(),
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"timed out after {timeout:.0f} s") from None
    result = read_result(proc.stdout.splitlines()) if proc.returncode == 0 else None
    if result is None:
        raise RuntimeError(f"exit {proc.returncode}:\n{proc.stderr[-2500:]}")
    return result


def worker_env() -> dict[str, str]:
    """The environment of a worker process: TensorFlow's info logs off, none of a job's settings."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    env.pop("TF_CONFIG", None)
    env.pop("KR_TEST_DEVICES", None)
    return env


def run_group(specs: list[dict[str, Any]], timeout: float, deadline: float | None = None,
              min_windows: int = 1) -> list[dict[str, Any] | RuntimeError]:
    """Runs workers (training, all-reduce, two-worker) side by side, taking turns window by window.

    All start together and warm up concurrently; then each timed window runs
    alone, the processes in turn (order reversed every other window), the others
    waiting in a callback. Past ``deadline`` (a ``time.perf_counter()`` value)
    the group takes no more windows once each process has timed
    ``min_windows``; every process then stops after the same window. Returns
    each worker's result, or the error it ended with.
    """
    procs, logs = [], []
    for spec in specs:
        log_file = tempfile.TemporaryFile(mode="w+")
        logs.append(log_file)
        procs.append(subprocess.Popen(
            worker_command(dict(spec, turns=True)), cwd=ROOT, env=worker_env(),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file, text=True, bufsize=1))
    expired = threading.Event()

    def kill_all():
        expired.set()
        for p in procs:
            p.kill()

    watchdog = threading.Timer(timeout, kill_all)
    watchdog.start()
    outputs: list[list[str]] = [[] for _ in procs]
    alive = [True] * len(procs)

    def until_turn(i: int) -> None:
        """Reads worker i's output up to its next turn (or its end)."""
        for line in procs[i].stdout:
            line = line.rstrip("\n")
            if line == TURN:
                return
            outputs[i].append(line)
        alive[i] = False

    def send(i: int, line: str) -> None:
        if alive[i]:
            try:
                procs[i].stdin.write(line + "\n")
                procs[i].stdin.flush()
            except (BrokenPipeError, OSError):
                alive[i] = False

    try:
        for i in range(len(procs)):
            until_turn(i)  # warmed up
        windows = max(int(spec["windows"]) for spec in specs)
        for w in range(windows):
            if deadline is not None and w >= min_windows and time.perf_counter() > deadline:
                break
            for i in (range(len(procs)) if w % 2 == 0 else reversed(range(len(procs)))):
                if alive[i]:
                    send(i, GO)
                    until_turn(i)
        for i in range(len(procs)):
            send(i, STOP)
        for i, p in enumerate(procs):
            for line in p.stdout:
                outputs[i].append(line.rstrip("\n"))
            p.wait()
    finally:
        watchdog.cancel()
        for p in procs:
            if p.poll() is None:
                p.kill()
    results: list[dict[str, Any] | RuntimeError] = []
    for i, p in enumerate(procs):
        logs[i].seek(0)
        stderr = logs[i].read()
        logs[i].close()
        ended = not expired.is_set() and p.returncode == 0
        result = read_result(outputs[i]) if ended else None
        if expired.is_set():
            results.append(RuntimeError(f"timed out after {timeout:.0f} s"))
        elif result is None:
            results.append(RuntimeError(f"exit {p.returncode}:\n{stderr[-2500:]}"))
        else:
            results.append(result)
    return results
