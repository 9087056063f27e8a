"""Kubernetes: the manifests of ``keras-replicator k8s`` (a JobSet validated against JobSet's
published CRD schema, the TFJob, the Kubeflow Trainer TrainJob), the resolver that reads a
JobSet pod's environment, and a 2-worker job started with that environment on 127.0.0.1."""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
import time

import jsonschema
import keras
import numpy as np
import pytest
import yaml

from keras_replicator import cluster, jobset
from keras_replicator.__main__ import main
from keras_replicator.launch import free_ports, k8s_manifest
from keras_replicator.launch.kubernetes import KubernetesJob, manifests
from tests.helpers import (
    LAUNCHED_JOB_BATCH,
    LAUNCHED_JOB_EXAMPLES,
    ROOT,
    dense_model,
    regression_data,
    run_markdown_example,
)

pytestmark = pytest.mark.devices(1)

CRD = os.path.join(ROOT, "tests", "vendor", "jobset", "jobset.x-k8s.io_jobsets.yaml")


# --- The JobSet CRD's schema, as the API server applies it ---------------------------------------


def _structural(schema):
    """A CRD's ``openAPIV3Schema`` as JSON Schema, with Kubernetes's own keywords applied.

    ``x-kubernetes-int-or-string``: an integer or a string (the CRD spells it
    ``anyOf: [integer, string]`` too; added where it does not). An object with
    ``properties`` and neither ``additionalProperties`` nor
    ``x-kubernetes-preserve-unknown-fields`` gets ``additionalProperties: false``:
    the API server's strict field validation (``kubectl apply``'s default) refuses
    unknown fields there, so a misspelt field fails here too. The other
    ``x-kubernetes-*`` keywords (list types, map types, CEL validations) are
    ignored: jsonschema does not know them, and no CEL rule concerns what we write.
    """
    if isinstance(schema, list):
        return [_structural(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _structural(v) for k, v in schema.items()}
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


_VALIDATOR = None


def jobset_validator() -> jsonschema.Draft7Validator:
    global _VALIDATOR
    if _VALIDATOR is None:
        with open(CRD) as f:
            crd = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # 0.8 MB: C if there
        (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
        schema = _structural(version["schema"]["openAPIV3Schema"])
        _VALIDATOR = jsonschema.Draft7Validator(schema)
    return _VALIDATOR


def check_jobset(manifest: dict) -> None:
    errors = sorted(jobset_validator().iter_errors(manifest), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors[:10])


def test_the_schema_check_can_fail():
    good = manifests(KubernetesJob("t.py", workers=2, image="i:1"))[0]
    check_jobset(good)
    for path, value in [(("spec", "failurePolicy", "maxRestart"), 3),                  # misspelt
                        (("spec", "replicatedJobs", 0, "replicas"), "two"),             # wrong type
                        (("spec", "successPolicy", "operator"), "Most")]:               # not in the enum
        bad = copy.deepcopy(good)
        node = bad
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with pytest.raises(AssertionError):
            check_jobset(bad)


# --- The JobSet ----------------------------------------------------------------------------------


def _env_of(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_workers_jobset(capsys):
    assert main(["k8s", "--workers", "3", "--image", "reg.io/train:1", "--name", "resnet", "--namespace",
                 "research", "--max-restarts", "2", "/app/train.py", "--epochs", "3", "--note", 'a: "b" #c']) == 0
    out = capsys.readouterr().out
    manifest = yaml.safe_load(out)
    check_jobset(manifest)
    assert manifest["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and manifest["kind"] == "JobSet"
    assert manifest["metadata"] == {"name": "resnet", "namespace": "research"}
    spec = manifest["spec"]
    assert spec["network"]["enableDNSHostnames"] is True
    assert spec["failurePolicy"]["maxRestarts"] == 2
    assert spec["successPolicy"] == {"operator": "All"}
    (worker,) = spec["replicatedJobs"]
    assert worker["name"] == "worker" and worker["replicas"] == 3
    job = worker["template"]["spec"]
    assert (job["parallelism"], job["completions"], job["completionMode"], job["backoffLimit"]) == (1, 1, "Indexed", 0)
    assert job["template"]["spec"]["restartPolicy"] == "Never"
    (container,) = job["template"]["spec"]["containers"]
    # The script itself, no wrapper, its arguments intact.
    assert container["command"] == ["python", "/app/train.py", "--epochs", "3", "--note", 'a: "b" #c']
    assert "resources" not in container
    env = _env_of(container)
    assert env["KERAS_REPLICATOR_JOBSET_JOBS"] == "worker=3" and env["KERAS_REPLICATOR_JOBSET_PORT"] == "2222"
    for name, label in [("JOBSET_NAME", "jobset-name"), ("REPLICATED_JOB_NAME", "replicatedjob-name"),
                        ("JOB_INDEX", "job-index")]:
        assert env[name] == {"fieldRef": {"fieldPath": f"metadata.labels['jobset.sigs.k8s.io/{label}']"}}


def test_parameter_server_jobset_with_gpus(capsys):
    assert main(["k8s", "--workers", "4", "--ps", "2", "--gpus-per-worker", "8", "--max-restarts", "1",
                 "--image", "img:1", "-m", "trainers.job", "--fast"]) == 0
    manifest = yaml.safe_load(capsys.readouterr().out)
    check_jobset(manifest)
    spec = manifest["spec"]
    jobs = {r["name"]: r for r in spec["replicatedJobs"]}
    assert list(jobs) == ["chief", "worker", "ps"]
    assert {n: r["replicas"] for n, r in jobs.items()} == {"chief": 1, "worker": 4, "ps": 2}
    # The job succeeds when the chief does; a worker pod is replaced alone, the chief or a ps
    # failing restarts the JobSet.
    assert spec["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["chief"]}
    assert {n: r["template"]["spec"]["backoffLimit"] for n, r in jobs.items()} == {"chief": 0, "worker": 1, "ps": 0}
    for name, rjob in jobs.items():
        (container,) = rjob["template"]["spec"]["template"]["spec"]["containers"]
        assert container["command"] == ["python", "-m", "trainers.job", "--fast"]
        assert _env_of(container)["KERAS_REPLICATOR_JOBSET_JOBS"] == "chief=1,worker=4,ps=2"
        assert container.get("resources") == (None if name == "ps" else {"limits": {"nvidia.com/gpu": 8}})


@pytest.mark.parametrize(
    "args, message",
    [
        (["--workers", "2", "--name", "My_Job"], "name must be a Kubernetes name"),
        (["--workers", "2", "--name", "7up"], "name '7up' must start with a letter"),
        (["--workers", "2", "--name", "x" * 50], "is too long for a jobset: its pods' names"),
        (["--workers", "2", "--namespace", "Team"], "namespace must be a Kubernetes name"),
        (["--workers", "2", "--image", "my image"], "image must be a container image reference"),
        (["--workers", "2", "--restart-policy", "Never"], "restart_policy (--restart-policy) applies to --kind tfjob"),
        (["--workers", "2", "--kind", "tfjob", "--max-restarts", "1"], "max_restarts (--max-restarts) applies to"),
        (["--workers", "2", "--kind", "trainjob", "--ps", "1"], "--kind trainjob runs workers only"),
        (["--workers", "2", "--kind", "mpijob"], "argument --kind: invalid choice: 'mpijob'"),
        (["--workers", "0"], "argument --workers: must be at least 1, got 0"),
        (["--workers", "2", "--port", "70000"], "argument --port: must be in 1..65535"),
        (["--workers", "2", "-m", "trainers/job.py"], "module must be a dotted module name"),
    ],
)
def test_bad_arguments_are_refused_before_printing(args, message, capsys):
    argv = ["k8s", *args]
    if "--image" not in argv:
        argv[1:1] = ["--image", "img:1"]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "t.py"] if "-m" not in argv else argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"workers": 0}, "workers must be a positive integer"),
        ({"name": "-job"}, "name must be a Kubernetes name"),
        ({"name": "x" * 64}, "name must be a Kubernetes name"),
        ({"gpus_per_worker": -1}, "gpus_per_worker must be a non-negative integer"),
        ({"ps": -1}, "ps must be a non-negative integer"),
        ({"max_restarts": 1.5}, "max_restarts must be a non-negative integer"),
        ({"kind": "tfjob", "restart_policy": "Sometimes"}, "restart_policy must be one of"),
        ({"kind": "TFJob"}, "kind must be one of ('jobset', 'tfjob', 'trainjob')"),
        ({"python": " "}, "python must be the interpreter command"),
    ],
)
def test_bad_arguments_from_python(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        k8s_manifest("t.py", **{"workers": 2, "image": "img:1", **kwargs})


# --- Preemptions restart without counting ------------------------------------------------------

# What the API servers check beyond the CRD's schema, from their sources: a Job's podFailurePolicy
# (Kubernetes' batch validation, as the field descriptions in the CRD state it, and the
# "onPodConditions[0].status: Required value" it answers without a status) and a JobSet's rules
# (JobSet v0.12.0, pkg/webhooks/jobset_webhook.go: validOnJobFailureReasons, ruleNameRegexp).
_JOB_FAILURE_REASONS = {"BackoffLimitExceeded", "DeadlineExceeded", "FailedIndexes", "MaxFailedIndexesExceeded",
                        "PodFailurePolicy"}
_RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")


def check_failure_rules(spec: dict) -> None:
    """Checks a JobSet spec's failure rules and its Jobs' pod failure policies as the API servers would."""
    names = [rule["name"] for rule in spec["failurePolicy"].get("rules", [])]
    assert len(set(names)) == len(names) and all(_RULE_NAME.fullmatch(n) and len(n) <= 128 for n in names)
    for rule in spec["failurePolicy"].get("rules", []):
        assert set(rule.get("onJobFailureReasons", [])) <= _JOB_FAILURE_REASONS
    for replicated in spec["replicatedJobs"]:
        job = replicated["template"]["spec"]
        assert job["template"]["spec"]["restartPolicy"] == "Never"  # required by a podFailurePolicy
        rules = job["podFailurePolicy"]["rules"]
        assert 1 <= len(rules) <= 20
        for rule in rules:
            assert rule["action"] in ("FailJob", "Ignore", "Count")  # FailIndex needs backoffLimitPerIndex
            assert ("onExitCodes" in rule) != ("onPodConditions" in rule)  # one of them, not both
            if "onExitCodes" in rule:
                codes = rule["onExitCodes"]
                assert codes["operator"] in ("In", "NotIn")
                assert codes["values"] == sorted(set(codes["values"])) and 1 <= len(codes["values"]) <= 255
                assert codes["operator"] != "In" or 0 not in codes["values"]
            else:
                for pattern in rule["onPodConditions"]:
                    assert pattern["type"] and pattern["status"] in ("True", "False", "Unknown")


def _outcome(spec: dict, replicated_job: str, exit_code: int, conditions: tuple[str, ...] = ()) -> str:
    """What JobSet and the Job controller do when a pod of ``replicated_job`` fails, as they document it.

    The Job: the first podFailurePolicy rule that matches (a pod condition with its status, or an
    exit code) applies: FailJob fails the Job with reason PodFailurePolicy, Ignore replaces the pod
    uncounted, Count (or no rule) counts it against backoffLimit, past which the Job fails with
    BackoffLimitExceeded. The JobSet: the first failurePolicy rule whose onJobFailureReasons holds
    the reason applies, else RestartJobSet, counted against maxRestarts.
    """
    (replicated,) = [r for r in spec["replicatedJobs"] if r["name"] == replicated_job]
    job = replicated["template"]["spec"]
    action = "Count"
    for rule in job.get("podFailurePolicy", {}).get("rules", []):
        if "onPodConditions" in rule:
            matched = any(p["type"] in conditions and p["status"] == "True" for p in rule["onPodConditions"])
        else:
            matched = (exit_code in rule["onExitCodes"]["values"]) == (rule["onExitCodes"]["operator"] == "In")
        if matched:
            action = rule["action"]
            break
    if action == "Ignore":
        return "pod replaced, not counted"
    if action == "Count" and job["backoffLimit"] > 0:
        return "pod replaced, counted"
    reason = "PodFailurePolicy" if action == "FailJob" else "BackoffLimitExceeded"
    for rule in spec["failurePolicy"].get("rules", []):
        if reason in rule.get("onJobFailureReasons", [reason]):
            return {"RestartJobSetAndIgnoreMaxRestarts": "restart, not counted", "RestartJobSet": "restart, counted",
                    "FailJobSet": "fail"}[rule["action"]]
    return "restart, counted"


def test_the_preemption_exit_code_is_the_one_workers_exit_with():
    from keras_replicator._compat import preemption
    from keras_replicator.launch import kubernetes

    assert kubernetes.PREEMPTION_EXIT_CODE == preemption.EXIT_CODE == 128 + signal.SIGTERM


@pytest.mark.parametrize("ps", [0, 2])
def test_preemptions_restart_without_counting(ps, capsys):
    assert main(["k8s", "--workers", "3", "--ps", str(ps), "--max-restarts", "2", "--image", "img:1", "t.py"]) == 0
    manifest = yaml.safe_load(capsys.readouterr().out)
    check_jobset(manifest)
    spec = manifest["spec"]
    check_failure_rules(spec)
    assert spec["failurePolicy"] == {"maxRestarts": 2, "rules": [
        {"name": "PreemptionRestartsUncounted", "action": "RestartJobSetAndIgnoreMaxRestarts",
         "onJobFailureReasons": ["PodFailurePolicy"]}]}
    restarting = ["chief", "ps"] if ps else ["worker"]
    for name in restarting:
        # Preempted: our SIGTERM exit, or evicted/preempted/node drained (killed at the grace period's end: 137).
        assert _outcome(spec, name, 143) == "restart, not counted"
        assert _outcome(spec, name, 137, ("DisruptionTarget",)) == "restart, not counted"
        # Real failures count: an error, an OOM kill, a SIGKILL with no disruption.
        for code in (1, 2, 137, 139):
            assert _outcome(spec, name, code) == "restart, counted"
    if ps:  # a worker pod is replaced alone, and a preempted one without counting against backoffLimit
        assert _outcome(spec, "worker", 143) == "pod replaced, not counted"
        assert _outcome(spec, "worker", 1, ("DisruptionTarget",)) == "pod replaced, not counted"
        assert _outcome(spec, "worker", 1) == "pod replaced, counted"
    # The model of the controllers can tell: without the rules every preemption counts.
    plain = copy.deepcopy(spec)
    del plain["failurePolicy"]["rules"]
    for replicated in plain["replicatedJobs"]:
        del replicated["template"]["spec"]["podFailurePolicy"]
    assert _outcome(plain, restarting[0], 143) == "restart, counted"


def test_the_failure_rules_check_can_fail():
    good = manifests(KubernetesJob("t.py", workers=2, image="i:1"))[0]["spec"]
    rules = ["failurePolicy", "rules", 0]
    pod_rules = ["replicatedJobs", 0, "template", "spec", "podFailurePolicy", "rules"]
    for path, value in [([*rules, "name"], "preemption-uncounted"),                  # '-' not allowed
                        ([*rules, "onJobFailureReasons"], ["Preempted"]),            # not a Job failure reason
                        ([*pod_rules, 0, "onPodConditions", 0, "status"], None),     # status required
                        ([*pod_rules, 1, "onExitCodes", "values"], [143, 0]),        # unordered, 0 with In
                        ([*pod_rules, 1, "onPodConditions"], []),                    # both requirements
                        (["replicatedJobs", 0, "template", "spec", "template", "spec", "restartPolicy"], "OnFailure")]:
        bad = copy.deepcopy(good)
        node = bad
        for key in path[:-1]:
            node = node[key]
        if value is None:
            del node[path[-1]]
        else:
            node[path[-1]] = value
        with pytest.raises((AssertionError, KeyError)):
            check_failure_rules(bad)


# --- TFJob and TrainJob --------------------------------------------------------------------------


def test_tfjob_behind_kind(capsys):
    assert main(["k8s", "--kind", "tfjob", "--workers", "4", "--ps", "2", "--image", "img:1",
                 "--gpus-per-worker", "1", "--restart-policy", "ExitCode", "t.py", "--fast"]) == 0
    manifest = yaml.safe_load(capsys.readouterr().out)
    assert manifest["apiVersion"] == "kubeflow.org/v1" and manifest["kind"] == "TFJob"
    specs = manifest["spec"]["tfReplicaSpecs"]
    assert {kind: spec["replicas"] for kind, spec in specs.items()} == {"Chief": 1, "Worker": 4, "PS": 2}
    for kind, spec in specs.items():
        assert spec["restartPolicy"] == "ExitCode"
        (container,) = spec["template"]["spec"]["containers"]
        assert container["name"] == "tensorflow"
        assert container["command"] == ["python", "t.py", "--fast"]
        assert ("resources" in container) == (kind != "PS")
    plain = yaml.safe_load(k8s_manifest("t.py", workers=2, image="i", kind="tfjob"))
    assert set(plain["spec"]["tfReplicaSpecs"]) == {"Worker"}
    assert plain["spec"]["tfReplicaSpecs"]["Worker"]["restartPolicy"] == "OnFailure"


def test_trainjob_and_its_runtime(capsys):
    assert main(["k8s", "--kind", "trainjob", "--workers", "3", "--gpus-per-worker", "2", "--max-restarts", "1",
                 "--image", "img:1", "--name", "mnist", "train.py"]) == 0
    runtime, train_job = yaml.safe_load_all(capsys.readouterr().out)
    assert (runtime["apiVersion"], runtime["kind"]) == ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime")
    assert (train_job["apiVersion"], train_job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert train_job["spec"]["runtimeRef"] == {"name": "mnist-runtime", "apiGroup": "trainer.kubeflow.org",
                                               "kind": "ClusterTrainingRuntime"}
    trainer = train_job["spec"]["trainer"]
    assert trainer["numNodes"] == 3 and trainer["command"] == ["python", "train.py"]
    assert trainer["resourcesPerNode"] == {"limits": {"nvidia.com/gpu": 2}}
    assert trainer["env"] == [{"name": "KERAS_REPLICATOR_JOBSET_JOBS", "value": "worker=node:1x3"}]
    # The runtime's template is a JobSet spec: the JobSet CRD's schema checks it.
    template = runtime["spec"]["template"]["spec"]
    check_jobset({"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": "mnist"},
                  "spec": template})
    (node,) = template["replicatedJobs"]
    assert node["name"] == "node"  # Kubeflow Trainer's trainer step: its container is "node" too
    assert node["template"]["metadata"]["labels"] == {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}
    assert node["template"]["spec"]["template"]["spec"]["containers"][0]["name"] == "node"
    assert template["failurePolicy"]["maxRestarts"] == 1
    # Trainer builds the JobSet from the runtime's template, rules included: preemptions are not counted.
    check_failure_rules(template)
    assert _outcome(template, "node", 143) == "restart, not counted"
    assert _outcome(template, "node", 1) == "restart, counted"
    # What the pods of the JobSet Trainer makes get (the TrainJob's env joins the runtime's) resolves:
    # one Job of 3 pods, pod i being worker i.
    env = _env_of(node["template"]["spec"]["template"]["spec"]["containers"][0])
    pod_env = {"JOBSET_NAME": "mnist", "REPLICATED_JOB_NAME": "node", "JOB_INDEX": "0", "JOB_COMPLETION_INDEX": "2",
               "KERAS_REPLICATOR_JOBSET_PORT": env["KERAS_REPLICATOR_JOBSET_PORT"], "KERAS_REPLICATOR_JOBSET_JOBS":
               trainer["env"][0]["value"]}
    spec, task_type, index = jobset.jobset_cluster_dict(pod_env)
    assert spec == {"worker": [f"mnist-node-0-{i}.mnist:2222" for i in range(3)]}
    assert (task_type, index) == ("worker", 2)


# --- The resolver --------------------------------------------------------------------------------


def pod(replicated_job: str, job_index: int, pod_index: int = 0, jobs: str = "worker=2", **extra) -> dict:
    """A JobSet pod's environment, as the manifest's env and JobSet's labels make it."""
    env = {"JOBSET_NAME": "train", "REPLICATED_JOB_NAME": replicated_job, "JOB_INDEX": str(job_index),
           "JOB_COMPLETION_INDEX": str(pod_index), "KERAS_REPLICATOR_JOBSET_JOBS": jobs,
           "KERAS_REPLICATOR_JOBSET_PORT": "2222"}
    return {k: v for k, v in {**env, **extra}.items() if v is not None}


def test_the_manifest_env_and_the_resolver_agree():
    """The env the manifest writes, with the labels JobSet sets, is what the resolver reads."""
    job = KubernetesJob("t.py", workers=2, ps=1, image="i:1", name="train")
    (container,) = manifests(job)[0]["spec"]["replicatedJobs"][1]["template"]["spec"]["template"]["spec"][
        "containers"]
    labels = {"jobset.sigs.k8s.io/jobset-name": "train", "jobset.sigs.k8s.io/replicatedjob-name": "worker",
              "jobset.sigs.k8s.io/job-index": "1"}
    env = {"JOB_COMPLETION_INDEX": "0"}
    for e in container["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            env[e["name"]] = labels[re.fullmatch(r"metadata\.labels\['(.+)'\]", e["valueFrom"]["fieldRef"]["fieldPath"])[1]]
    resolver = cluster.jobset_cluster(env, parameter_servers=True)
    assert resolver.cluster_spec().as_dict() == {
        "chief": ["train-chief-0-0.train:2222"],
        "worker": ["train-worker-0-0.train:2222", "train-worker-1-0.train:2222"],
        "ps": ["train-ps-0-0.train:2222"],
    }
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("worker", 1, "grpc")


def test_jobset_pods_resolve_to_their_task():
    for i in range(2):
        resolver = cluster.jobset_cluster(pod("worker", i))
        assert resolver.cluster_spec().as_dict() == {"worker": ["train-worker-0-0.train:2222",
                                                                "train-worker-1-0.train:2222"]}
        assert (resolver.task_type, resolver.task_id) == ("worker", i)
    # Jobs of several pods (JobSet's own examples): worker i is pod i % 2 of Job i // 2.
    spec, task_type, index = jobset.jobset_cluster_dict(pod("worker", 1, 1, jobs="worker=2x2",
                                                            KERAS_REPLICATOR_JOBSET_SUBDOMAIN="net"))
    assert spec == {"worker": ["train-worker-0-0.net:2222", "train-worker-0-1.net:2222",
                               "train-worker-1-0.net:2222", "train-worker-1-1.net:2222"]}
    assert (task_type, index) == ("worker", 3)
    # A JobSet of one worker is one machine; no JobSet, no cluster.
    assert cluster.jobset_cluster(pod("worker", 0, jobs="worker=1")) is None
    assert cluster.jobset_cluster({"JOB_COMPLETION_INDEX": "3", "JOB_INDEX": "1", "PATH": "/bin"}) is None


def test_tf_config_wins_over_a_jobset_and_a_jobset_over_slurm(monkeypatch):
    for name, value in pod("worker", 1).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "n[1-2]")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "1(x2)")
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert cluster.resolve_cluster().task_id == 1  # the JobSet's, not Slurm's task 0
    tf_config = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config))
    assert cluster.resolve_cluster().cluster_spec().as_dict() == tf_config["cluster"]


@pytest.mark.parametrize(
    "env, message",
    [
        (pod("worker", 0, JOB_INDEX=None), "half set: ['KERAS_REPLICATOR_JOBSET_JOBS', 'JOBSET_NAME', "
                                           "'REPLICATED_JOB_NAME'] are set but ['JOB_INDEX'] are not"),
        ({"JOBSET_NAME": "train"}, "are not. Generate the JobSet with `keras-replicator k8s`"),
        (pod("worker", 0, KERAS_REPLICATOR_JOBSET_PORT=None), "but ['KERAS_REPLICATOR_JOBSET_PORT'] are not"),
        (pod("worker", 0, jobs="worker:2"), "'worker:2' is not of the form TASK_TYPE=JOBS"),
        (pod("worker", 0, jobs="evaluator=1,worker=2"), "task type 'evaluator' is not one of"),
        (pod("worker", 0, jobs="worker=2,worker=1"), "is listed twice"),
        (pod("launcher", 0), "REPLICATED_JOB_NAME='launcher' is not one of the replicated jobs ['worker']"),
        (pod("worker", 2), "This pod is Job 2, pod 0 of replicated job 'worker', which has 2 Job(s) of 1 pod(s)"),
        (pod("worker", 0, JOB_COMPLETION_INDEX="-1"), "JOB_COMPLETION_INDEX='-1' must be a non-negative integer"),
        (pod("worker", 0, KERAS_REPLICATOR_JOBSET_PORT="99999"), "KERAS_REPLICATOR_JOBSET_PORT=99999 is not in"),
        (pod("worker", 0, jobs="worker=2,ps=1"), '"ps" (parameter server) tasks'),
        (pod("worker", 0, KERAS_REPLICATOR_JOBSET_ADDRESS_MAP='{"train-worker-0-0.train": "127.0.0.1:1"}'),
         "has no address for the pod 'train-worker-1-0.train'"),
    ],
)
def test_a_half_set_or_inconsistent_jobset_environment_is_named(env, message):
    with pytest.raises(cluster.ClusterConfigError, match=re.escape(message)):
        cluster.jobset_cluster(env)


def test_an_async_jobset_needs_a_chief():
    with pytest.raises(cluster.ClusterConfigError, match=re.escape('AsyncReplicatorStrategy needs one "chief"')):
        cluster.jobset_cluster(pod("worker", 0, jobs="worker=2,ps=1"), parameter_servers=True)


# --- A 2-worker job started with a JobSet pod's environment --------------------------------------

JOB = os.path.join(ROOT, "tests", "launched_job.py")
TIMEOUT = 240


def test_two_jobset_pods_on_127_0_0_1_train(tmp_path):
    """Each worker runs the script directly, with a JobSet pod's environment and nothing else.

    Outside Kubernetes no DNS serves the pods' names: the address map stands in for it, one
    127.0.0.1 port per pod name. It is keyed by the DNS names the resolver computes (a missing
    name fails), so the names are those of the production path.
    """
    ports = free_ports(2)
    names = [f"train-worker-{i}-0.train" for i in range(2)]
    address_map = json.dumps({n: f"127.0.0.1:{p}" for n, p in zip(names, ports)})
    base = {k: v for k, v in os.environ.items()
            if k not in ("TF_CONFIG", "KR_TEST_DEVICES", "KERAS_REPLICATOR_DEVICES_PER_WORKER")
            and not k.startswith("SLURM_")}
    base.update(PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3", KERAS_REPLICATOR_JOBSET_ADDRESS_MAP=address_map)
    workers = []
    start = time.monotonic()
    try:
        for i in range(2):
            env = dict(base, **pod("worker", i))
            workers.append(subprocess.Popen([sys.executable, JOB, str(tmp_path), "2"], cwd=ROOT, env=env,
                                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                            start_new_session=True))
        outputs = [w.communicate(timeout=TIMEOUT)[0] for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                os.killpg(w.pid, signal.SIGKILL)
                w.wait()
    print(f"2 JobSet pods trained in {time.monotonic() - start:.1f} s")
    assert [w.returncode for w in workers] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    reports = []
    for i in range(2):
        with open(os.path.join(tmp_path, f"worker{i}.restart0.json")) as f:
            reports.append(json.load(f))
    assert [r["worker_index"] for r in reports] == [0, 1]
    assert all(r["replicas_in_scope"] == 2 for r in reports)  # 2 pods x 1 device: one job
    x, y = regression_data(LAUNCHED_JOB_EXAMPLES)
    reference = dense_model()
    reference.compile(keras.optimizers.SGD(0.05), "mse")
    reference.fit(x, y, batch_size=LAUNCHED_JOB_BATCH, epochs=2, shuffle=False, verbose=0)
    for a, b, want in zip(reports[0]["weights"], reports[1]["weights"], reference.get_weights()):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, want, atol=2e-5, rtol=1e-4)


# --- The guide (docs/kubernetes.md) runs as written ----------------------------------------------


def test_the_guides_commands_print_valid_manifests(capsys):
    with open(os.path.join(ROOT, "docs", "kubernetes.md")) as f:
        text = f.read()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for command in block.replace("\\\n", " ").splitlines():
            if command.startswith("keras-replicator k8s"):
                commands.append(command.split(">")[0].split()[1:])
    assert len(commands) == 4
    for argv in commands:
        assert main(argv) == 0
        documents = list(yaml.safe_load_all(capsys.readouterr().out))
        if documents[0]["kind"] == "JobSet":
            check_jobset(documents[0])
    result = run_markdown_example("docs/kubernetes.md", 0)
    assert result.stdout.splitlines() == [
        "{'worker': ['resnet50-worker-0-0.resnet50:2222', 'resnet50-worker-1-0.resnet50:2222']}", "worker 1"]
