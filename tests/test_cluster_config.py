"""Where am I in a cluster: TF_CONFIG, Slurm and explicit resolvers, and the errors
a bad description gets before any worker waits for another."""

from __future__ import annotations

import json
import re

import pytest
import tensorflow as tf

import keras_replicator as kr
from keras_replicator import cluster

TWO = {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}


def config(cluster_dict=None, task=None, **extra) -> str:
    body = {"cluster": TWO if cluster_dict is None else cluster_dict,
            "task": {"type": "worker", "index": 0} if task is None else task}
    return json.dumps({**body, **extra})


# --- TF_CONFIG ---------------------------------------------------------------------


def test_tf_config_is_read_into_a_resolver(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", config(task={"type": "worker", "index": 1}))
    resolver = cluster.tf_config_cluster()
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("worker", 1, "grpc")
    assert resolver.cluster_spec().as_dict() == TWO
    with_chief = {"chief": ["10.0.0.1:2222"], "worker": ["10.0.0.2:2222"]}
    resolver = cluster.tf_config_cluster(config(with_chief, {"type": "chief", "index": 0}))
    assert resolver.cluster_spec().as_dict() == with_chief


@pytest.mark.parametrize("text", ["", "   ", "{}", '{"cluster": {}}'])
def test_no_cluster_means_one_machine(text):
    assert cluster.tf_config_cluster(text) is None


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "TF_CONFIG is not valid JSON"),
        ("[1, 2]", "TF_CONFIG must be a JSON object"),
        ('{"task": {"type": "worker", "index": 0}, "cluster": {}}', 'TF_CONFIG has a "task" but no "cluster"'),
        (json.dumps({"cluster": TWO}), 'TF_CONFIG needs "task": {"type": "worker", "index": i}'),
        (config(task={"type": "worker"}), 'TF_CONFIG needs "task"'),
        (config(task={"type": "chief", "index": 0}), "this task's type 'chief' is not a job of the cluster ['worker']"),
        (config(task={"type": "worker", "index": 2}), "this task's index must be an integer in [0, 2) for job 'worker', got 2"),
        (config(task={"type": "worker", "index": "1"}), "got '1'"),
        (config({"worker": ["127.0.0.1"]}), "cluster[\"worker\"][0] must be host:port, got '127.0.0.1'"),
        (config({"worker": ["127.0.0.1:70000"]}), "port 70000 of '127.0.0.1:70000' is not in 1..65535"),
        (config({"worker": ["a:1", "a:1"]}), "several tasks share the address(es) ['a:1']"),
        (config({"worker": "a:1,b:1"}), 'cluster["worker"] must be a non-empty list'),
        (config({"worker": ["a:1"], "ps": ["b:1"]}), '"ps" (parameter server) tasks'),
        (config({"worker": ["a:1"], "evaluator": ["b:1"]}), "job 'evaluator' is not supported"),
        (config({"chief": ["a:1", "b:1"], "worker": ["c:1"]}), 'there can be only one "chief"'),
        (config(rpc_layer="grpc+verbs"), '"rpc_layer" must be "grpc"'),
        (config(taks={"type": "worker"}), "TF_CONFIG has unknown key(s) ['taks']"),
    ],
)
def test_malformed_tf_config_is_named(text, message):
    with pytest.raises(cluster.ClusterConfigError, match=re.escape(message)):
        cluster.tf_config_cluster(text)


def test_strategy_creation_reports_a_malformed_tf_config_before_any_work(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", config(task={"type": "worker", "index": 5}))
    with pytest.raises(kr.ClusterConfigError, match=re.escape("must be an integer in [0, 2)")):
        kr.ReplicatorStrategy()


def test_multi_worker_strategy_must_come_before_tensorflow_starts(monkeypatch):
    # In this process TensorFlow already runs (conftest simulated devices, other tests).
    tf.constant(1.0)
    monkeypatch.setenv("TF_CONFIG", config(task={"type": "worker", "index": 1}))
    with pytest.raises(kr.ClusterStartupError, match="Create the strategy first thing in the program"):
        kr.ReplicatorStrategy()


def test_single_task_cluster_is_one_machine(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", config({"worker": ["127.0.0.1:2222"]}))
    strategy = kr.ReplicatorStrategy()
    assert (strategy.num_workers, strategy.worker_index, strategy.is_chief) == (1, 0, True)
    assert strategy.cluster_resolver is None
    assert strategy.num_replicas_in_sync == len(kr.local_devices())


# --- strategy arguments -----------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"communication": "tcp"}, ValueError, "communication must be one of 'auto', 'nccl', 'ring'; got 'tcp'"),
        ({"communication": None}, ValueError, "communication must be one of"),
        ({"failure_timeout": 0}, ValueError, "failure_timeout must be a positive number, got 0"),
        ({"failure_timeout": float("inf")}, ValueError, "failure_timeout must be a positive number"),
        ({"startup_timeout": -1}, ValueError, "startup_timeout must be a positive number, got -1"),
        ({"startup_timeout": True}, ValueError, "startup_timeout must be a positive number"),
        ({"cluster_resolver": "127.0.0.1:2222"}, TypeError, "cluster_resolver must be a tf.distribute.cluster_resolver.ClusterResolver"),
    ],
)
def test_bad_strategy_arguments(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        kr.ReplicatorStrategy(**kwargs)


def _resolver(spec, task_type="worker", task_id=0):
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(spec), task_type=task_type, task_id=task_id
    )


def test_explicit_resolver_is_checked_like_tf_config():
    with pytest.raises(kr.ClusterConfigError, match="SimpleClusterResolver describes an empty cluster"):
        kr.ReplicatorStrategy(cluster_resolver=_resolver({}))
    with pytest.raises(kr.ClusterConfigError, match=re.escape("this task's index must be an integer in [0, 2)")):
        kr.ReplicatorStrategy(cluster_resolver=_resolver(TWO, task_id=3))
    with pytest.raises(kr.ClusterConfigError, match="sparse task indices"):
        kr.ReplicatorStrategy(cluster_resolver=_resolver({"worker": {0: "a:1", 3: "b:1"}}))


def test_multi_worker_arguments_are_checked_before_joining():
    with pytest.raises(ValueError, match='choose communication="ring" or "nccl" instead'):
        kr.ReplicatorStrategy(cluster_resolver=_resolver(TWO), cross_device_ops=tf.distribute.ReductionToOneDevice())
    with pytest.raises(ValueError, match="names a job or task. In a multi-worker job, devices= lists this worker's local devices"):
        kr.ReplicatorStrategy(["/job:worker/task:1/cpu:0"], cluster_resolver=_resolver(TWO))
    with pytest.raises(ValueError, match="devices has duplicates"):
        kr.ReplicatorStrategy(["/cpu:0", "/device:CPU:0"], cluster_resolver=_resolver(TWO))


def test_explicit_communication_on_one_machine():
    strategy = kr.ReplicatorStrategy(communication="ring")
    assert strategy.extended._communication_options.implementation == (
        tf.distribute.experimental.CommunicationImplementation.RING
    )

    @tf.function
    def total():
        return strategy.run(lambda: kr.all_reduce(tf.cast(kr.replica_id(), tf.float32), "sum"))

    n = strategy.num_replicas_in_sync
    assert [float(v) for v in strategy.experimental_local_results(total())] == [n * (n - 1) / 2] * n


# --- Slurm -------------------------------------------------------------------------------


def slurm(**overrides) -> dict[str, str]:
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_PROCID": "3",
        "SLURM_STEP_NUM_TASKS": "5",
        "SLURM_STEP_NODELIST": "gpu[07-08],cpu3",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
        "SLURMD_NODENAME": "gpu08",
    }
    env.update(overrides)
    return {k: v for k, v in env.items() if v is not None}


def test_slurm_job_step_is_a_cluster_in_block_order():
    resolver = cluster.slurm_cluster(slurm())
    base = 12000 + 32 * (4242 % 1000)
    assert resolver.cluster_spec().as_dict() == {
        "worker": [f"gpu07:{base}", f"gpu07:{base + 1}", f"gpu08:{base}", f"gpu08:{base + 1}", f"cpu3:{base}"]
    }
    assert (resolver.task_type, resolver.task_id) == ("worker", 3)
    chosen = cluster.slurm_cluster(slurm(KERAS_REPLICATOR_SLURM_PORT_BASE="30000"))
    assert chosen.cluster_spec().as_dict()["worker"][4] == "cpu3:30000"


def test_hostlist_forms():
    assert cluster._expand_hostlist("n[1-3,10],big-node,x[08-09]y") == [
        "n1", "n2", "n3", "n10", "big-node", "x08y", "x09y"]
    assert cluster._expand_tasks_per_node("4(x3),2") == [4, 4, 4, 2]


@pytest.mark.parametrize(
    "env, expected",
    [({}, None), (slurm(SLURM_STEP_NUM_TASKS=None), None), (slurm(SLURM_STEP_NUM_TASKS="1", SLURM_PROCID="0"), None)],
)
def test_no_slurm_step_or_one_task_is_not_a_cluster(env, expected):
    assert cluster.slurm_cluster(env) is expected


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"SLURMD_NODENAME": "gpu07"}, "Slurm task 3 runs on 'gpu07', but block placement puts it on 'gpu08'"),
        ({"SLURM_STEP_TASKS_PER_NODE": "2,2"}, "these disagree"),
        ({"SLURM_STEP_NODELIST": None}, "SLURM_STEP_NODELIST"),
        ({"SLURM_PROCID": "x"}, "Slurm's SLURM_PROCID='x' is not an integer"),
        ({"SLURM_STEP_NUM_TASKS": "five"}, "Slurm's SLURM_STEP_NUM_TASKS='five' is not an integer"),
        ({"SLURM_PROCID": "9"}, "SLURM_PROCID=9 is not in [0, 5)"),
        ({"SLURM_STEP_NODELIST": "gpu[07-08"}, "Slurm's SLURM_STEP_NODELIST='gpu[07-08' is not a node list"),
        ({"SLURM_STEP_TASKS_PER_NODE": "2(y2)"}, "Slurm's SLURM_STEP_TASKS_PER_NODE='2(y2)' is not a task count"),
        ({"KERAS_REPLICATOR_SLURM_PORT_BASE": "70000"}, "is not a usable port number"),
    ],
)
def test_inconsistent_slurm_environment_is_named(overrides, message):
    with pytest.raises(cluster.ClusterConfigError, match=re.escape(message)):
        cluster.slurm_cluster(slurm(**overrides))


def test_tf_config_wins_over_slurm(monkeypatch):
    for k, v in slurm().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("TF_CONFIG", config())
    assert cluster.resolve_cluster().cluster_spec().as_dict() == TWO
    monkeypatch.delenv("TF_CONFIG")
    assert cluster.resolve_cluster().task_id == 3


# --- devices per worker, task names, errors ----------------------------------------------------------


def test_devices_per_worker_variable(monkeypatch):
    n = len(kr.local_devices())
    monkeypatch.setenv(cluster.DEVICES_PER_WORKER_ENV, str(n))
    assert cluster.simulate_devices_from_env() == n  # what this process already has: harmless
    monkeypatch.setenv(cluster.DEVICES_PER_WORKER_ENV, str(n + 1))
    with pytest.raises(kr.DeviceConfigurationError, match=f"KERAS_REPLICATOR_DEVICES_PER_WORKER={n + 1} asks for"):
        kr.ReplicatorStrategy()
    monkeypatch.setenv(cluster.DEVICES_PER_WORKER_ENV, "two")
    with pytest.raises(kr.ClusterConfigError, match="must be a positive integer"):
        cluster.simulate_devices_from_env()
    monkeypatch.delenv(cluster.DEVICES_PER_WORKER_ENV)
    assert cluster.simulate_devices_from_env() is None


def test_task_names_and_worker_lost_error():
    names = cluster.task_names(tf.train.ClusterSpec({"chief": ["a:1"], "worker": ["b:2", "c:3"]}))
    assert names == {
        "/job:chief/replica:0/task:0": "chief 0 (/job:chief/task:0 at a:1)",
        "/job:worker/replica:0/task:0": "worker 0 (/job:worker/task:0 at b:2)",
        "/job:worker/replica:0/task:1": "worker 1 (/job:worker/task:1 at c:3)",
    }
    error = kr.WorkerLostError("Lost worker 1", ["worker 1 (...)"])
    assert isinstance(error, tf.errors.UnavailableError) and error.message == "Lost worker 1"
    assert error.lost_workers == ["worker 1 (...)"]
