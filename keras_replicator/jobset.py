"""Where am I in a Kubernetes JobSet: the cluster of a pod, from its environment.

JobSet (``jobset.x-k8s.io/v1alpha2``, kubernetes-sigs/jobset) runs each
replicated job as ``replicas`` Kubernetes Jobs of Indexed completion, and gives
each pod:

- labels ``jobset.sigs.k8s.io/jobset-name``, ``.../replicatedjob-name`` and
  ``.../job-index`` (the pod reads them through the downward API: the manifest
  ``keras-replicator k8s`` writes maps them to ``JOBSET_NAME``,
  ``REPLICATED_JOB_NAME`` and ``JOB_INDEX``);
- ``JOB_COMPLETION_INDEX``, the pod's index in its Job (set by Kubernetes for
  Indexed Jobs);
- a stable DNS name through the JobSet's headless service:
  ``<jobset>-<replicatedJob>-<jobIndex>-<podIndex>.<subdomain>``, the subdomain
  being the JobSet's name unless ``spec.network.subdomain`` says otherwise.

What JobSet does not give a pod is the size of the other replicated jobs, nor
the port: the manifest sets them as ``KERAS_REPLICATOR_JOBSET_JOBS``
(e.g. ``chief=1,worker=4,ps=2``) and ``KERAS_REPLICATOR_JOBSET_PORT``.

Nothing here imports TensorFlow until an error is raised (the command line that
writes the manifest reads these names); `keras_replicator.cluster.jobset_cluster` builds the resolver.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def ClusterConfigError(message: str) -> ValueError:  # noqa: N802 (raised as the class it returns)
    """A `keras_replicator.errors.ClusterConfigError`, imported only when one is raised.

    ``errors`` imports TensorFlow, which the command line writing the manifest
    must not start.
    """
    from keras_replicator.errors import ClusterConfigError as error

    return error(message)

# Read from the pod's labels through the downward API (see `pod_environment`).
JOBSET_NAME_ENV = "JOBSET_NAME"
REPLICATED_JOB_NAME_ENV = "REPLICATED_JOB_NAME"
JOB_INDEX_ENV = "JOB_INDEX"
# Set by Kubernetes in every pod of an Indexed Job.
JOB_COMPLETION_INDEX_ENV = "JOB_COMPLETION_INDEX"
# Set by the manifest: TASK_TYPE=[REPLICATED_JOB:]JOBS[xPODS], comma-separated.
JOBS_ENV = "KERAS_REPLICATOR_JOBSET_JOBS"
PORT_ENV = "KERAS_REPLICATOR_JOBSET_PORT"
# Optional: the JobSet's spec.network.subdomain when it is not the JobSet's name.
SUBDOMAIN_ENV = "KERAS_REPLICATOR_JOBSET_SUBDOMAIN"
# Outside Kubernetes only (a test, a dry run on one machine): a JSON object mapping
# each pod's DNS name to the "host:port" that stands for it. The manifest never sets it.
ADDRESS_MAP_ENV = "KERAS_REPLICATOR_JOBSET_ADDRESS_MAP"

# The labels JobSet puts on every pod (api/jobset/v1alpha2/jobset_types.go).
POD_LABELS = {
    JOBSET_NAME_ENV: "jobset.sigs.k8s.io/jobset-name",
    REPLICATED_JOB_NAME_ENV: "jobset.sigs.k8s.io/replicatedjob-name",
    JOB_INDEX_ENV: "jobset.sigs.k8s.io/job-index",
}
# Any of these says "a JobSet pod" (JOB_INDEX alone is too common a name to say so).
_TRIGGERS = (JOBS_ENV, JOBSET_NAME_ENV, REPLICATED_JOB_NAME_ENV)
_TASK_TYPES = ("chief", "worker", "ps")
_ENTRY = re.compile(r"(?P<type>[a-z]+)=(?:(?P<rjob>[a-z0-9]([-a-z0-9]*[a-z0-9])?):)?"
                    r"(?P<jobs>\d+)(?:x(?P<pods>\d+))?")


@dataclass(frozen=True)
class ReplicatedJob:
    """One TensorFlow job of the cluster as a JobSet replicated job.

    ``jobs`` Kubernetes Jobs of ``pods`` pods each; task ``i`` of ``task_type``
    is pod ``i % pods`` of Job ``i // pods``.
    """

    task_type: str
    name: str
    jobs: int
    pods: int = 1

    @property
    def tasks(self) -> int:
        return self.jobs * self.pods


def format_jobs(jobs: list[ReplicatedJob]) -> str:
    """The ``KERAS_REPLICATOR_JOBSET_JOBS`` value describing ``jobs``.

    Example:
        ```python
        from keras_replicator.jobset import ReplicatedJob, format_jobs
        print(format_jobs([ReplicatedJob("worker", "worker", 4)]))   # worker=4
        ```
    """
    parts = []
    for j in jobs:
        rjob = "" if j.name == j.task_type else f"{j.name}:"
        shape = f"{j.jobs}" if j.pods == 1 else f"{j.jobs}x{j.pods}"
        parts.append(f"{j.task_type}={rjob}{shape}")
    return ",".join(parts)


def parse_jobs(text: str) -> list[ReplicatedJob]:
    """``KERAS_REPLICATOR_JOBSET_JOBS`` read: ``chief=1,worker=4,ps=2`` or ``worker=node:1x4``.

    Example:
        ```python
        from keras_replicator.jobset import parse_jobs
        print(parse_jobs("worker=node:1x4")[0].tasks)   # 4
        ```
    """
    jobs: list[ReplicatedJob] = []
    for entry in text.split(","):
        m = _ENTRY.fullmatch(entry.strip())
        if not m:
            raise ClusterConfigError(
                f"{JOBS_ENV}={text!r}: {entry.strip()!r} is not of the form TASK_TYPE=JOBS, "
                "TASK_TYPE=JOBSxPODS or TASK_TYPE=REPLICATED_JOB:JOBSxPODS (e.g. worker=4)."
            )
        task_type = m.group("type")
        if task_type not in _TASK_TYPES:
            raise ClusterConfigError(f"{JOBS_ENV}={text!r}: task type {task_type!r} is not one of {_TASK_TYPES}.")
        job = ReplicatedJob(task_type, m.group("rjob") or task_type, int(m.group("jobs")),
                            int(m.group("pods") or 1))
        if job.tasks < 1:
            raise ClusterConfigError(f"{JOBS_ENV}={text!r}: {task_type} has no tasks.")
        if any(j.task_type == job.task_type or j.name == job.name for j in jobs):
            raise ClusterConfigError(f"{JOBS_ENV}={text!r}: {task_type!r} or {job.name!r} is listed twice.")
        jobs.append(job)
    return jobs


def pod_hostname(jobset: str, replicated_job: str, job_index: int, pod_index: int, subdomain: str) -> str:
    """A JobSet pod's DNS name in its namespace: ``<jobset>-<rjob>-<job>-<pod>.<subdomain>``.

    The form JobSet's ``placement.GenPodName`` gives the pod's hostname, under
    the headless service named after the subdomain.

    Example:
        ```python
        from keras_replicator.jobset import pod_hostname
        print(pod_hostname("train", "worker", 1, 0, "train"))   # train-worker-1-0.train
        ```
    """
    return f"{jobset}-{replicated_job}-{job_index}-{pod_index}.{subdomain}"


def _int(env: Mapping[str, str], name: str) -> int:
    value = env[name].strip()
    if not value.isdigit():
        raise ClusterConfigError(f"{name}={env[name]!r} must be a non-negative integer.")
    return int(value)


def _address_map(env: Mapping[str, str]) -> dict[str, str] | None:
    text = env.get(ADDRESS_MAP_ENV, "").strip()
    if not text:
        return None
    try:
        mapping = json.loads(text)
    except json.JSONDecodeError as e:
        raise ClusterConfigError(f"{ADDRESS_MAP_ENV} is not valid JSON ({e}).") from None
    if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
        raise ClusterConfigError(f'{ADDRESS_MAP_ENV} must be a JSON object {{"pod DNS name": "host:port"}}.')
    return mapping


def jobset_cluster_dict(environ: Mapping[str, str] | None = None) -> tuple[dict[str, list[str]], str, int] | None:
    """The cluster of a JobSet pod as ``(cluster, task_type, task_index)``; ``None`` outside one.

    Pure Python; `keras_replicator.cluster.jobset_cluster` makes it a resolver.

    Example:
        ```python
        from keras_replicator.jobset import jobset_cluster_dict
        env = {"JOBSET_NAME": "train", "REPLICATED_JOB_NAME": "worker", "JOB_INDEX": "1",
               "JOB_COMPLETION_INDEX": "0", "KERAS_REPLICATOR_JOBSET_JOBS": "worker=2",
               "KERAS_REPLICATOR_JOBSET_PORT": "2222"}
        print(jobset_cluster_dict(env))
        # ({'worker': ['train-worker-0-0.train:2222', 'train-worker-1-0.train:2222']}, 'worker', 1)
        ```

    Raises:
        ClusterConfigError: some of the variables are set and others missing or
            inconsistent (the message names them).
    """
    env = os.environ if environ is None else environ
    present = [v for v in _TRIGGERS if env.get(v, "").strip()]
    if not present:
        return None
    needed = (*_TRIGGERS, JOB_INDEX_ENV, JOB_COMPLETION_INDEX_ENV, PORT_ENV)
    missing = [v for v in needed if not env.get(v, "").strip()]
    if missing:
        raise ClusterConfigError(
            f"A JobSet pod's environment is half set: {present} are set but {missing} are not. "
            "Generate the JobSet with `keras-replicator k8s`, which sets them all (the names, "
            "sizes and port, and the pod's labels through the downward API), or unset them."
        )
    jobs = parse_jobs(env[JOBS_ENV])
    port = _int(env, PORT_ENV)
    if not 1 <= port <= 65535:
        raise ClusterConfigError(f"{PORT_ENV}={port} is not in 1..65535.")
    jobset = env[JOBSET_NAME_ENV].strip()
    subdomain = env.get(SUBDOMAIN_ENV, "").strip() or jobset
    mine = env[REPLICATED_JOB_NAME_ENV].strip()
    by_name = {j.name: j for j in jobs}
    if mine not in by_name:
        raise ClusterConfigError(
            f"{REPLICATED_JOB_NAME_ENV}={mine!r} is not one of the replicated jobs "
            f"{sorted(by_name)} of {JOBS_ENV}={env[JOBS_ENV]!r}."
        )
    job_index, pod_index = _int(env, JOB_INDEX_ENV), _int(env, JOB_COMPLETION_INDEX_ENV)
    me = by_name[mine]
    if job_index >= me.jobs or pod_index >= me.pods:
        raise ClusterConfigError(
            f"This pod is Job {job_index}, pod {pod_index} of replicated job {mine!r}, which has "
            f"{me.jobs} Job(s) of {me.pods} pod(s) ({JOBS_ENV}={env[JOBS_ENV]!r})."
        )
    mapping = _address_map(env)
    cluster: dict[str, list[str]] = {}
    for j in jobs:
        addresses = []
        for task in range(j.tasks):
            host = pod_hostname(jobset, j.name, task // j.pods, task % j.pods, subdomain)
            if mapping is None:
                addresses.append(f"{host}:{port}")
            elif host in mapping:
                addresses.append(mapping[host])
            else:
                raise ClusterConfigError(f"{ADDRESS_MAP_ENV} has no address for the pod {host!r}.")
        cluster[j.task_type] = addresses
    return cluster, me.task_type, job_index * me.pods + pod_index


def pod_environment(jobs: list[ReplicatedJob], port: int) -> list[dict[str, Any]]:
    """The container ``env`` from which `jobset_cluster_dict` reads a pod of this JobSet.

    Example:
        ```python
        from keras_replicator.jobset import ReplicatedJob, pod_environment
        env = pod_environment([ReplicatedJob("worker", "worker", 2)], 2222)
        ```
    """
    env: list[dict[str, Any]] = [
        {"name": name, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{label}']"}}}
        for name, label in POD_LABELS.items()
    ]
    env += [{"name": JOBS_ENV, "value": format_jobs(jobs)}, {"name": PORT_ENV, "value": str(port)}]
    return env
