"""The asynchronous regime: AsyncReplicatorStrategy on a chief, workers and parameter servers.

Each test starts real processes (``tests/async_job.py``, every task with its own
``TF_CONFIG`` on 127.0.0.1 ports) and checks what the chief reports: Keras 3
fit/evaluate/predict/save through the coordinator, a worker killed and
restarted mid-epoch, a parameter server killed (a clear error, then a restart
that resumes from the backup), and the bad inputs. Every process is killed
(SIGKILL to its process group) when the test ends.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

import keras_replicator as kr
from keras_replicator import cluster
from keras_replicator.launch import free_ports
from tests import async_job as job
from tests.helpers import ROOT

JOB = os.path.join(ROOT, "tests", "async_job.py")


def _env(**extra) -> dict[str, str]:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1", PYTHONPATH=ROOT)
    for name in ("KR_TEST_DEVICES", "TF_CONFIG", "KERAS_REPLICATOR_DEVICES_PER_WORKER"):
        env.pop(name, None)
    return dict(env, **extra)


def async_tf_config(cluster_spec: dict, task_type: str, index: int) -> str:
    """What a launcher sets for each task: the whole cluster, and this task's place."""
    return json.dumps({"cluster": cluster_spec, "task": {"type": task_type, "index": index}})


class Job:
    """A chief, ``workers`` workers and ``ps`` parameter servers of tests/async_job.py."""

    def __init__(self, tmp_path, mode: str, workers: int = 2, ps: int = 2, **env):
        self.out = tmp_path / "out"
        self.logs = tmp_path / "logs"
        self.out.mkdir(exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        self.mode, self.env = mode, _env(**env)
        ports = free_ports(1 + workers + ps)
        address = [f"127.0.0.1:{p}" for p in ports]
        self.cluster = {"chief": address[:1], "worker": address[1 : 1 + workers], "ps": address[1 + workers :]}
        self.processes: dict[tuple[str, int], subprocess.Popen] = {}
        self.starts = 0

    def start(self, task_type: str, index: int) -> None:
        self.starts += 1
        log = open(self.logs / f"{task_type}{index}.{self.starts}.log", "w")
        env = dict(self.env, TF_CONFIG=async_tf_config(self.cluster, task_type, index))
        self.processes[(task_type, index)] = subprocess.Popen(
            [sys.executable, JOB, self.mode, str(self.out)], env=env, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
        log.close()

    def start_all(self) -> None:
        for task_type in ("ps", "worker", "chief"):
            for index in range(len(self.cluster[task_type])):
                self.start(task_type, index)

    def kill(self, task_type: str, index: int) -> None:
        p = self.processes[(task_type, index)]
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()

    def output(self, task_type: str, index: int) -> str:
        texts = []
        for path in sorted(self.logs.glob(f"{task_type}{index}.*.log")):
            texts.append(path.read_text())
        return "\n".join(texts)

    def wait_for(self, text: str, timeout: float) -> float:
        """Waits until the chief's output has ``text``; the time it appeared."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.output("chief", 0):
                return time.time()
            if self.processes[("chief", 0)].poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"The chief did not print {text!r}:\n{self.output('chief', 0)[-5000:]}")

    def wait(self, task_type: str = "chief", index: int = 0, timeout: float = 240) -> int:
        try:
            return self.processes[(task_type, index)].wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{task_type} {index} did not end:\n{self.output(task_type, index)[-5000:]}") from None

    def report(self) -> dict:
        with open(self.out / "chief.json") as f:
            return json.load(f)

    def stop(self) -> None:
        for p in self.processes.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()


@pytest.fixture
def start_job(tmp_path):
    jobs: list[Job] = []

    def start(mode: str, **kwargs) -> Job:
        j = Job(tmp_path, mode, **kwargs)
        jobs.append(j)
        j.start_all()
        return j

    yield start
    for j in jobs:
        j.stop()
