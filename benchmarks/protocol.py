"""How the runner and a benchmark worker process talk: the command, the result line, the turns.

A worker is ``python -m benchmarks.worker '<spec as JSON>'``, run from the
repository's root (:data:`ROOT`). It prints exactly one line ``RESULT <json>``
(:func:`emit_result`; :func:`read_result` finds it in the output). In turns mode
(see ``processes.run_group``) it prints ``TURN`` between two timed windows and
waits for the runner's answer on stdin: :data:`GO` to time one more window,
:data:`STOP` to take no more (the planned windows are done, or the run's time
limit is near).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT_PREFIX = "RESULT "
TURN = "TURN"  # a worker in turns mode is between two timed windows
GO, STOP = "go", "stop"


def worker_command(spec: dict[str, Any]) -> list[str]:
    """The command line of a worker process measuring ``spec`` (run it with ``cwd=ROOT``)."""
    return [sys.executable, "-m", "benchmarks.worker", json.dumps(spec)]


def emit_result(result: dict[str, Any]) -> None:
    """Prints the one ``RESULT <json>`` line of a worker."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def finish_worker(result: dict[str, Any]) -> None:
    """Prints a worker's result line and ends its process at once, skipping the interpreter's
    teardown (see ``benchmarks/worker.py``)."""
    emit_result(result)
    sys.stdout.flush()
    os._exit(0)


def read_result(lines: Iterable[str]) -> dict[str, Any] | None:
    """The last ``RESULT`` line's result in a worker's output lines, or None if there is none."""
    found = [ln for ln in lines if ln.startswith(RESULT_PREFIX)]
    return json.loads(found[-1][len(RESULT_PREFIX):]) if found else None


def take_turn() -> bool:
    """In turns mode: says this process is between timed windows and waits until the
    runner gives it the machine again.

    Returns ``True`` to time another window, ``False`` to stop here (``STOP``):
    the process then finishes without another turn.
    """
    print(TURN, flush=True)
    line = sys.stdin.readline()
    if not line:
        raise SystemExit("the benchmark runner went away")
    return line.strip() != STOP
