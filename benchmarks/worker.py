"""One benchmark configuration in a fresh interpreter.

Usage: ``python -m benchmarks.worker '<spec as JSON>'``. The spec's ``kind`` says
what to measure (``env``, ``memcopy``, ``allreduce``, ``train``,
``multiworker``, ``model_parallel``, ...; :data:`KINDS`); the other keys are that kind's parameters
(see the ``run_<kind>`` functions). The worker prints exactly one line
``RESULT <json>`` on stdout (:mod:`benchmarks.protocol`), and exits non-zero on
failure.

The simulated CPU device count must be set before TensorFlow starts, so the
worker configures devices first thing, and imports TensorFlow only inside the
functions that need it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from benchmarks.allreduce import run_allreduce
from benchmarks.machine import cpu_seconds, run_env, run_memcopy
from benchmarks.model_parallel_budget import run_lever
from benchmarks.multiworker import run_multiworker, run_mw_task
from benchmarks.protocol import emit_result
from benchmarks.training_throughput import run_train

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def run_input_pipeline(spec: dict[str, Any]) -> dict[str, Any]:
    """``benchmarks/input_pipeline.py``'s own measurements (``run(quick) -> dict``)."""
    from benchmarks import input_pipeline

    return dict(input_pipeline.run(bool(spec.get("quick", False))))


KINDS = {
    "env": run_env,
    "memcopy": run_memcopy,
    "allreduce": run_allreduce,
    "train": run_train,
    "multiworker": run_multiworker,
    "mw_task": run_mw_task,
    "input_pipeline": run_input_pipeline,
    "model_parallel": run_lever,
}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m benchmarks.worker '<spec json>'", file=sys.stderr)
        return 2
    spec = json.loads(argv[0])
    t0 = time.perf_counter()
    result = KINDS[spec["kind"]](spec)
    result["wall_seconds"] = time.perf_counter() - t0
    result["cpu_seconds"] = cpu_seconds()
    emit_result(result)
    return 0


if __name__ == "__main__":
    status = main(sys.argv[1:])
    # The result is out: skip the interpreter's teardown, which after a long
    # TensorFlow run took up to 38 s (ResNet-50's batch-norm layers, 200 steps
    # on 4 replicas; 2 s after 24 steps), and in a group delays the next one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
