"""Kubernetes manifests for a multi-worker job (``keras-replicator k8s``).

A JobSet (``jobset.x-k8s.io/v1alpha2``, kubernetes-sigs/jobset) by default: the
workers as a replicated job (with ``ps``: a chief, the workers and the
parameter servers as three), each task one pod with a stable DNS name under the
JobSet's headless service. The pod runs the user's script directly; the
strategy finds its cluster in what JobSet gives the pod
(`keras_replicator.cluster.jobset_cluster`). On request, the same job as a
Kubeflow ``TFJob`` (``kubeflow.org/v1``, whose operator sets ``TF_CONFIG``) or
as a Kubeflow Trainer v2 ``TrainJob`` with the ``ClusterTrainingRuntime`` it
runs on (a runtime wrapping a JobSet template).

Manifests are built as data (dicts) and written with ``yaml.safe_dump``. No
TensorFlow here: the command line starts at once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from keras_replicator import jobset as pod
from keras_replicator._validation import ArgumentError, check_int, check_number
from keras_replicator.launch.config import _check_module_name
from keras_replicator.launch.environment import PREEMPTED_EXIT_CODE
from keras_replicator.launch.grace import grace_for

KINDS = ("jobset", "tfjob", "trainjob")
JOBSET_API_VERSION = "jobset.x-k8s.io/v1alpha2"
TFJOB_API_VERSION = "kubeflow.org/v1"
TRAINER_API_VERSION = "trainer.kubeflow.org/v1alpha1"
DEFAULT_PORT = 2222
GPU_RESOURCE = "nvidia.com/gpu"
TFJOB_RESTART_POLICIES = ("OnFailure", "Always", "Never", "ExitCode")
# Kubeflow Trainer's names for the trainer step (pkg/constants/constants.go).
_TRAINER_JOB = "node"
_TRAINER_ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
# What a preempted pod shows: our own exit status after SIGTERM (128 + 15), and the
# condition Kubernetes sets on a pod it evicts, preempts or deletes with its node.
PREEMPTION_EXIT_CODE = PREEMPTED_EXIT_CODE
DISRUPTION_CONDITION = "DisruptionTarget"
# A JobSet rule's name: ^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$ (JobSet's CRD).
PREEMPTION_RULE_NAME = "PreemptionRestartsUncounted"

_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def _check_name(label: str, value: object) -> str:
    if not isinstance(value, str) or len(value) > 63 or not _DNS1123_LABEL.fullmatch(value):
        raise ArgumentError(
            f"{label} must be a Kubernetes name (at most 63 lower-case letters, digits or '-', "
            f"starting and ending with a letter or digit), got {value!r}."
        )
    return value


@dataclass(frozen=True)
class KubernetesJob:
    """What ``keras-replicator k8s`` writes, checked when it is made.

    Example:
        ```python
        from keras_replicator.launch.kubernetes import KubernetesJob, manifests
        job = KubernetesJob("train.py", workers=2, image="registry.example/train:1")
        print(manifests(job)[0]["kind"])   # JobSet
        ```

    Args:
        script: the script's path inside the image (a module name with ``module``).
        args: its command-line arguments.
        workers: number of worker pods, >= 1.
        image: the container image holding TensorFlow, keras_replicator and the script.
        kind: ``"jobset"``, ``"tfjob"`` or ``"trainjob"``.
        name: the job's name (a Kubernetes name; for a JobSet or TrainJob it
            also names the pods and the headless service, so it starts with a letter).
        namespace: the Kubernetes namespace; ``None`` for the current one.
        ps: parameter-server pods: with ``ps=M`` the job has a chief, ``workers``
            workers and ``M`` parameter servers (``AsyncReplicatorStrategy``).
        gpus_per_worker: ``nvidia.com/gpu`` limit of each chief and worker pod.
        max_restarts: JobSet and TrainJob: how many times a failure restarts
            the whole job (``failurePolicy.maxRestarts``); with ``ps``, also how
            many times a failed worker pod is replaced alone. Preemptions (exit
            143, the pod condition ``DisruptionTarget``) restart it without
            counting (`jobset_failure_policy`, `pod_failure_policy`).
        restart_policy: TFJob only: ``"OnFailure"`` (the default), ``"Always"``,
            ``"Never"`` or ``"ExitCode"``.
        python: the interpreter command inside the image.
        module: ``script`` is a module name, run as ``python -m script``.
        port: the port every task listens on (each pod has its own address).
        save_seconds: how long a backup takes to save (measured: the launcher's
            ``KERAS_REPLICATOR_SAVE_RECORD``, or the preemption message's "saved ...
            in N s"); with ``step_seconds`` it sets every pod's
            ``terminationGracePeriodSeconds`` by `keras_replicator.launch.grace.grace_for`
            (``2 x (step + save) + 5``), so that a preempted pod's save is not SIGKILLed.
        step_seconds: how long a training step takes.
        grace: ``terminationGracePeriodSeconds`` given outright (overrides the rule).
    """

    script: str
    args: tuple[str, ...] = ()
    workers: int = 1
    image: str = ""
    kind: str = "jobset"
    name: str = "keras-replicator"
    namespace: str | None = None
    ps: int = 0
    gpus_per_worker: int = 0
    max_restarts: int = 0
    restart_policy: str | None = None
    python: str = "python"
    module: bool = False
    port: int = DEFAULT_PORT
    save_seconds: float = 30.0
    step_seconds: float = 10.0
    grace: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ArgumentError(f"kind must be one of {KINDS}, got {self.kind!r}.")
        if self.module:
            _check_module_name(self.script)
        elif not isinstance(self.script, str) or not self.script:
            raise ArgumentError(f"script must be a path inside the image, got {self.script!r}.")
        if isinstance(self.args, str) or not all(isinstance(a, str) for a in self.args):
            raise ArgumentError(f"args must be a sequence of strings, got {self.args!r}.")
        object.__setattr__(self, "args", tuple(self.args))
        check_int("workers", self.workers, minimum=1)
        if not isinstance(self.image, str) or not self.image or any(c.isspace() for c in self.image):
            raise ArgumentError(f"image must be a container image reference, got {self.image!r}.")
        _check_name("name", self.name)
        if self.namespace is not None:
            _check_name("namespace", self.namespace)
        check_int("ps", self.ps, minimum=0)
        check_int("gpus_per_worker", self.gpus_per_worker, minimum=0)
        check_int("max_restarts", self.max_restarts, minimum=0)
        check_int("port", self.port, minimum=1, maximum=65535)
        check_number("save_seconds", self.save_seconds, non_negative=True)
        check_number("step_seconds", self.step_seconds, non_negative=True)
        check_int("grace", self.grace, minimum=1, optional=True)
        if not isinstance(self.python, str) or not self.python.strip():
            raise ArgumentError(f"python must be the interpreter command inside the image, got {self.python!r}.")
        self._check_kind()

    def termination_grace(self) -> tuple[int, str]:
        """Every pod's ``terminationGracePeriodSeconds`` and how it was chosen (for the reader)."""
        if self.grace is not None:
            return self.grace, f"terminationGracePeriodSeconds: {self.grace} s, as given (--grace)"
        seconds = grace_for(self.save_seconds, self.step_seconds)
        return seconds, (f"terminationGracePeriodSeconds: {seconds} s = 2 x (a step {self.step_seconds:g} s + a "
                         f"backup save {self.save_seconds:g} s) + 5 s: SIGKILL must not land in the save that "
                         "SIGTERM starts (--step-seconds, --save-seconds: measure them; --grace sets it outright)")

    def _check_kind(self) -> None:
        if self.kind == "tfjob":
            if self.max_restarts:
                raise ArgumentError(
                    "max_restarts (--max-restarts) applies to a JobSet or a TrainJob; a TFJob restarts "
                    "its pods through restart_policy (--restart-policy)."
                )
            if self.restart_policy is not None and self.restart_policy not in TFJOB_RESTART_POLICIES:
                raise ArgumentError(
                    f"restart_policy must be one of {TFJOB_RESTART_POLICIES}, got {self.restart_policy!r}."
                )
            return
        if self.restart_policy is not None:
            raise ArgumentError(
                f"restart_policy (--restart-policy) applies to --kind tfjob; a {self.kind} restarts "
                "the whole job after a failure, up to max_restarts (--max-restarts) times."
            )
        if self.kind == "trainjob" and self.ps:
            raise ArgumentError(
                "--kind trainjob runs workers only (Kubeflow Trainer's trainer step is one replicated "
                "job); for a parameter-server job (--ps) use the JobSet (the default kind)."
            )
        if not _DNS1035_LABEL.fullmatch(self.name):
            raise ArgumentError(
                f"name {self.name!r} must start with a letter: a {self.kind} names its headless "
                "service after it (a DNS-1035 label)."
            )
        longest = max((pod_name(self, j) for j in self.replicated_jobs()), key=len)
        if len(longest) + 6 > 63:  # JobSet's webhook allows for the 5-character suffix of a pod
            raise ArgumentError(
                f"name {self.name!r} is too long for a {self.kind}: its pods' names (such as "
                f"{longest!r}, plus a 6-character suffix) must be at most 63 characters."
            )

    def replicated_jobs(self) -> list[pod.ReplicatedJob]:
        """The job's tasks as JobSet replicated jobs, in the order of the manifest."""
        if self.kind == "trainjob":
            return [pod.ReplicatedJob("worker", _TRAINER_JOB, 1, self.workers)]
        if self.ps:
            return [pod.ReplicatedJob("chief", "chief", 1), pod.ReplicatedJob("worker", "worker", self.workers),
                    pod.ReplicatedJob("ps", "ps", self.ps)]
        return [pod.ReplicatedJob("worker", "worker", self.workers)]

    def command(self) -> list[str]:
        """The container's command: the script itself, with its arguments."""
        run = [self.python, "-m", self.script] if self.module else [self.python, self.script]
        return [*run, *self.args]


def pod_name(job: KubernetesJob, replicated: pod.ReplicatedJob) -> str:
    """The longest pod hostname of a replicated job: ``<name>-<rjob>-<last job>-<last pod>``."""
    return f"{job.name}-{replicated.name}-{replicated.jobs - 1}-{replicated.pods - 1}"


def _metadata(job: KubernetesJob, name: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name or job.name}
    if job.namespace:
        meta["namespace"] = job.namespace
    return meta


def _container(job: KubernetesJob, name: str, gpus: bool, env: list[dict[str, Any]]) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": name,
        "image": job.image,
        "command": job.command(),
        "env": env,
        "ports": [{"name": "tf-server", "containerPort": job.port}],
    }
    if gpus and job.gpus_per_worker:
        container["resources"] = {"limits": {GPU_RESOURCE: job.gpus_per_worker}}
    return container


def _job_template(job: KubernetesJob, replicated: pod.ReplicatedJob, container: dict[str, Any]) -> dict[str, Any]:
    """A replicated job's Job: Indexed, its pods never restarted in place.

    A failed pod fails its Job (``backoffLimit: 0``) and JobSet's failure policy
    restarts every Job: a synchronous job's workers cannot go on without one of
    theirs. With parameter servers, a worker's Job replaces a failed pod alone
    (``backoffLimit: max_restarts``): the chief re-runs its steps elsewhere.
    """
    alone = bool(job.ps) and replicated.task_type == "worker"
    return {
        "parallelism": replicated.pods,
        "completions": replicated.pods,
        "completionMode": "Indexed",
        "backoffLimit": job.max_restarts if alone else 0,
        "podFailurePolicy": pod_failure_policy(replaced_alone=alone),
        # podFailurePolicy requires it (and a failed pod is not restarted in place anyway).
        "template": {"spec": {"restartPolicy": "Never", "containers": [container],
                              "terminationGracePeriodSeconds": job.termination_grace()[0]}},
    }


def pod_failure_policy(replaced_alone: bool = False) -> dict[str, Any]:
    """A Job's ``podFailurePolicy`` telling a preempted pod from a failed one.

    A pod that exited with 143 (a worker stopped by SIGTERM, after saving) or
    that carries the ``DisruptionTarget`` condition (evicted, preempted, its
    node drained or gone) fails its Job with the reason ``PodFailurePolicy``,
    which the JobSet's rule (`jobset_failure_policy`) restarts without counting
    against ``maxRestarts``. Any other failure is counted as before
    (``backoffLimit``). A parameter-server job's worker pod, which is replaced
    alone, is instead replaced without counting against its ``backoffLimit``
    (action ``Ignore``).

    Example:
        ```python
        from keras_replicator.launch.kubernetes import pod_failure_policy
        print([r["action"] for r in pod_failure_policy()["rules"]])   # ['FailJob', 'FailJob']
        ```
    """
    action = "Ignore" if replaced_alone else "FailJob"
    return {"rules": [
        {"action": action, "onPodConditions": [{"type": DISRUPTION_CONDITION, "status": "True"}]},
        {"action": action, "onExitCodes": {"operator": "In", "values": [PREEMPTION_EXIT_CODE]}},
    ]}


def jobset_failure_policy(max_restarts: int) -> dict[str, Any]:
    """A JobSet's ``failurePolicy``: ``max_restarts`` real failures, preemptions not counted.

    A Job failed by its ``podFailurePolicy`` (a preempted pod, see
    `pod_failure_policy`) restarts the JobSet without counting
    (``RestartJobSetAndIgnoreMaxRestarts``); any other failure takes JobSet's
    default action, ``RestartJobSet``, counted against ``maxRestarts``.

    Example:
        ```python
        from keras_replicator.launch.kubernetes import jobset_failure_policy
        print(jobset_failure_policy(3)["rules"][0]["action"])   # RestartJobSetAndIgnoreMaxRestarts
        ```
    """
    return {
        "maxRestarts": max_restarts,
        "rules": [{"name": PREEMPTION_RULE_NAME, "action": "RestartJobSetAndIgnoreMaxRestarts",
                   "onJobFailureReasons": ["PodFailurePolicy"]}],
    }


def _jobset_spec(job: KubernetesJob, env: list[dict[str, Any]], container_name: str) -> dict[str, Any]:
    replicated_jobs = []
    for replicated in job.replicated_jobs():
        container = _container(job, container_name, replicated.task_type != "ps", env)
        template: dict[str, Any] = {}
        if job.kind == "trainjob":
            template["metadata"] = {"labels": {_TRAINER_ANCESTOR_LABEL: "trainer"}}
        template["spec"] = _job_template(job, replicated, container)
        replicated_jobs.append({"name": replicated.name, "replicas": replicated.jobs, "template": template})
    success = {"operator": "All"}
    if job.ps:  # workers and parameter servers serve until the chief is done
        success["targetReplicatedJobs"] = ["chief"]
    return {
        "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
        "failurePolicy": jobset_failure_policy(job.max_restarts),
        "successPolicy": success,
        "replicatedJobs": replicated_jobs,
    }


def jobset_manifest(job: KubernetesJob) -> dict[str, Any]:
    """The JobSet of ``job``, as data.

    Example:
        ```python
        from keras_replicator.launch.kubernetes import KubernetesJob, jobset_manifest
        js = jobset_manifest(KubernetesJob("train.py", workers=4, image="train:1", ps=1))
        print([r["name"] for r in js["spec"]["replicatedJobs"]])   # ['chief', 'worker', 'ps']
        ```
    """
    env = pod.pod_environment(job.replicated_jobs(), job.port)
    return {
        "apiVersion": JOBSET_API_VERSION,
        "kind": "JobSet",
        "metadata": _metadata(job),
        "spec": _jobset_spec(job, env, "trainer"),
    }


def tfjob_manifest(job: KubernetesJob) -> dict[str, Any]:
    """The Kubeflow ``TFJob`` of ``job``, as data: its operator sets ``TF_CONFIG`` in each pod.

    Worker 0 is the chief (with ``ps``: a ``Chief`` replica). Kubeflow Trainer
    v2 no longer runs TFJobs; the training operator v1 does.

    Example:
        ```python
        from keras_replicator.launch.kubernetes import KubernetesJob, tfjob_manifest
        tf_job = tfjob_manifest(KubernetesJob("train.py", workers=2, image="train:1", kind="tfjob"))
        ```
    """
    replicas = [("Chief", 1), ("Worker", job.workers), ("PS", job.ps)] if job.ps else [("Worker", job.workers)]
    specs = {}
    for kind, count in replicas:
        container = {
            "name": "tensorflow",  # the training operator expects this name
            "image": job.image,
            "command": job.command(),
            "ports": [{"name": "tfjob-port", "containerPort": DEFAULT_PORT}],
        }
        if job.gpus_per_worker and kind != "PS":
            container["resources"] = {"limits": {GPU_RESOURCE: job.gpus_per_worker}}
        specs[kind] = {
            "replicas": count,
            "restartPolicy": job.restart_policy or "OnFailure",
            "template": {"spec": {"containers": [container],
                                  "terminationGracePeriodSeconds": job.termination_grace()[0]}},
        }
    return {
        "apiVersion": TFJOB_API_VERSION,
        "kind": "TFJob",
        "metadata": _metadata(job),
        "spec": {"runPolicy": {"cleanPodPolicy": "Running"}, "tfReplicaSpecs": specs},
    }


def trainjob_manifests(job: KubernetesJob) -> list[dict[str, Any]]:
    """A Kubeflow Trainer v2 ``ClusterTrainingRuntime`` and the ``TrainJob`` that runs on it.

    The runtime wraps a JobSet template whose trainer step (the replicated job
    ``node``) runs the script; the TrainJob sets the image, the command, the
    number of nodes (one worker each) and their GPUs. The runtime is
    cluster-scoped and named ``<name>-runtime``.

    Example:
        ```python
        from keras_replicator.launch.kubernetes import KubernetesJob, trainjob_manifests
        runtime, train_job = trainjob_manifests(
            KubernetesJob("train.py", workers=2, image="train:1", kind="trainjob"))
        ```
    """
    runtime_name = f"{job.name}-runtime"
    _check_name("the runtime's name", runtime_name)
    env = pod.pod_environment(job.replicated_jobs(), job.port)
    # The number of nodes is the TrainJob's: so is the variable that holds it.
    jobs_env = next(e for e in env if e["name"] == pod.JOBS_ENV)
    spec = _jobset_spec(job, [e for e in env if e is not jobs_env], _TRAINER_JOB)
    runtime = {
        "apiVersion": TRAINER_API_VERSION,
        "kind": "ClusterTrainingRuntime",
        "metadata": {"name": runtime_name, "labels": {"trainer.kubeflow.org/framework": "tensorflow"}},
        "spec": {"mlPolicy": {"numNodes": job.workers}, "template": {"spec": spec}},
    }
    trainer: dict[str, Any] = {"image": job.image, "command": job.command(), "numNodes": job.workers,
                               "env": [jobs_env]}
    if job.gpus_per_worker:
        trainer["resourcesPerNode"] = {"limits": {GPU_RESOURCE: job.gpus_per_worker}}
    train_job = {
        "apiVersion": TRAINER_API_VERSION,
        "kind": "TrainJob",
        "metadata": _metadata(job),
        "spec": {
            "runtimeRef": {"name": runtime_name, "apiGroup": "trainer.kubeflow.org",
                           "kind": "ClusterTrainingRuntime"},
            "trainer": trainer,
        },
    }
    return [runtime, train_job]


def manifests(job: KubernetesJob) -> list[dict[str, Any]]:
    """The manifests of ``job``'s kind, in the order to apply them.

    Example:
        ```python
        from keras_replicator.launch.kubernetes import KubernetesJob, manifests
        print(len(manifests(KubernetesJob("t.py", workers=2, image="i:1", kind="trainjob"))))   # 2
        ```
    """
    if job.kind == "tfjob":
        return [tfjob_manifest(job)]
    if job.kind == "trainjob":
        return trainjob_manifests(job)
    return [jobset_manifest(job)]


def to_yaml(documents: Sequence[dict[str, Any]]) -> str:
    """YAML documents for ``kubectl apply -f -`` (``yaml.safe_dump``; PyYAML: the ``k8s`` extra).

    Example:
        ```python
        from keras_replicator.launch.kubernetes import to_yaml
        print(to_yaml([{"kind": "JobSet"}]))   # kind: JobSet
        ```
    """
    try:
        import yaml
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "keras-replicator k8s writes YAML with PyYAML: pip install pyyaml (or the k8s extra: "
            "pip install '.[k8s]' from the root of your keras_replicator clone)."
        ) from None
    return yaml.safe_dump_all(list(documents), sort_keys=False, default_flow_style=False)


def k8s_manifest(
    script: str,
    args: Sequence[str] = (),
    *,
    workers: int,
    image: str,
    kind: str = "jobset",
    name: str = "keras-replicator",
    namespace: str | None = None,
    gpus_per_worker: int = 0,
    max_restarts: int = 0,
    restart_policy: str | None = None,
    python: str = "python",
    ps: int = 0,
    module: bool = False,
    port: int = DEFAULT_PORT,
    save_seconds: float = 30.0,
    step_seconds: float = 10.0,
    grace: int | None = None,
) -> str:
    """The manifests (YAML) running ``script`` on ``workers`` pods: a JobSet unless ``kind`` says otherwise.

    In a JobSet, each task is a pod running the script directly;
    ``kr.ReplicatorStrategy()`` (or ``kr.AsyncReplicatorStrategy()`` with
    ``ps``) finds the cluster in the pod's environment. With
    ``keras.callbacks.BackupAndRestore`` writing to a volume all pods share, a
    job restarted after a failure (``max_restarts``) resumes from the last
    saved epoch. See `KubernetesJob` for the arguments. The YAML begins with a
    comment saying how every pod's ``terminationGracePeriodSeconds`` was chosen.

    Example:
        ```python
        from keras_replicator.launch import k8s_manifest
        print(k8s_manifest("train.py", workers=4, image="registry.example/train:1"))
        ```

    Returns:
        The manifests, for ``kubectl apply -f -``.
    """
    job = KubernetesJob(
        script, tuple(args) if not isinstance(args, str) else args, workers=workers, image=image,
        kind=kind, name=name, namespace=namespace, ps=ps, gpus_per_worker=gpus_per_worker,
        max_restarts=max_restarts, restart_policy=restart_policy, python=python, module=module, port=port,
        save_seconds=save_seconds, step_seconds=step_seconds, grace=grace,
    )
    return f"# {job.termination_grace()[1]}\n" + to_yaml(manifests(job))
