"""The ``keras-replicator launch`` and ``k8s`` commands, with small scripts that need no TensorFlow."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
import yaml

from keras_replicator import cluster
from keras_replicator.__main__ import main
from keras_replicator.launch import free_ports, k8s_manifest, launch, tf_config
from tests.helpers import ROOT


def script(tmp_path, body: str, name: str = "job.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


REPORT = """
    import json, os, sys
    config = json.loads(os.environ["TF_CONFIG"])
    print("index", config["task"]["index"], "args", sys.argv[1:])
    print("devices", os.environ.get("KERAS_REPLICATOR_DEVICES_PER_WORKER"),
          "worker", os.environ["KERAS_REPLICATOR_WORKER_INDEX"])
    print("config", os.environ["TF_CONFIG"])
"""


def lines_of(text: str, worker: int) -> list[str]:
    prefix = f"[worker {worker}] "
    return [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]


def test_workers_get_tf_config_on_localhost_and_prefixed_output(tmp_path):
    out = io.StringIO()
    code = launch(script(tmp_path, REPORT), ["--lr", "0.1"], workers=3, devices_per_worker=2, output=out)
    assert code == 0
    addresses = None
    for i in range(3):
        lines = lines_of(out.getvalue(), i)
        assert lines[:2] == [f"index {i} args ['--lr', '0.1']", f"devices 2 worker {i}"]
        resolver = cluster.tf_config_cluster(lines[2].removeprefix("config "))  # a valid TF_CONFIG
        assert (resolver.task_type, resolver.task_id) == ("worker", i)
        spec = resolver.cluster_spec().as_dict()["worker"]
        assert addresses in (None, spec)
        addresses = spec
    assert len(addresses) == 3 and len(set(addresses)) == 3
    assert all(re.fullmatch(r"127\.0\.0\.1:\d+", a) for a in addresses)
    # Every line of output is a worker's, prefixed.
    assert all(re.match(r"\[worker [0-2]\] ", line) for line in out.getvalue().splitlines())


def test_first_failure_is_returned_and_the_others_are_stopped(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    body = f"""
        import os, signal, sys, time
        index = int(os.environ["KERAS_REPLICATOR_WORKER_INDEX"])
        open(os.path.join({str(pids)!r}, str(os.getpid())), "w").close()
        if index == 2:
            time.sleep(0.5)
            print("giving up", flush=True)
            sys.exit(7)
        if index == 1:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)   # as a TensorFlow worker does
        time.sleep(120)
    """
    out = io.StringIO()
    started = time.monotonic()
    code = launch(script(tmp_path, body), workers=3, output=out)
    elapsed = time.monotonic() - started
    assert code == 7
    assert "[worker 2] giving up" in out.getvalue()
    assert "[launcher] worker 2 exited with code 7; stopping the others" in out.getvalue()
    assert elapsed < 30, elapsed  # the sleepers were stopped (the SIGTERM-proof one killed after 5 s)
    for pid in map(int, os.listdir(pids)):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_exit_codes_of_killed_workers_and_timeout(tmp_path):
    killed = script(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", "killed.py")
    assert launch(killed, workers=2, output=io.StringIO()) == 128 + 9
    sleeper = script(tmp_path, "import time\ntime.sleep(120)\n", "sleeper.py")
    out = io.StringIO()
    started = time.monotonic()
    assert launch(sleeper, workers=2, timeout=1, output=out) == 124
    assert time.monotonic() - started < 20
    assert "[launcher] timeout after 1 s; stopping every worker" in out.getvalue()


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"workers": 0}, ValueError, "workers must be an integer >= 1, got 0"),
        ({"workers": 2, "devices_per_worker": 0}, ValueError, "devices_per_worker must be an integer >= 1, got 0"),
        ({"workers": 2, "host": "127.0.0.1 "}, ValueError, "host must be an address"),
        ({"workers": 2, "timeout": -1}, ValueError, "timeout must be a positive number of seconds, got -1"),
    ],
)
def test_bad_launch_arguments(tmp_path, kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        launch(script(tmp_path, "print(1)\n"), **kwargs)


def test_missing_script_and_bad_args(tmp_path):
    with pytest.raises(FileNotFoundError, match="Script 'nope.py' does not exist"):
        launch("nope.py", workers=2)
    with pytest.raises(TypeError, match="args must be strings"):
        launch(script(tmp_path, "print(1)\n"), [1], workers=2)


def test_free_ports_and_tf_config():
    ports = free_ports(4)
    assert len(set(ports)) == 4 and all(1 <= p <= 65535 for p in ports)
    assert json.loads(tf_config(["a:1", "b:2"], 1)) == {
        "cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 1}}
    with pytest.raises(ValueError, match=re.escape("index must be an integer in [0, 2), got 2")):
        tf_config(["a:1", "b:2"], 2)
    with pytest.raises(ValueError, match="Worker address 'a' is not of the form host:port"):
        tf_config(["a"], 0)
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        free_ports(0)


def _cli(*args, timeout=120):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run([sys.executable, "-m", "keras_replicator", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_command_line_launch(tmp_path, capsys):
    # python -m keras_replicator launch ... (one real start of the command; the rest in-process)
    result = _cli("launch", "--workers", "2", "--devices-per-worker", "3", script(tmp_path, REPORT), "-x", "1")
    assert result.returncode == 0, result.stderr
    for i in range(2):
        assert lines_of(result.stdout, i)[:2] == [f"index {i} args ['-x', '1']", f"devices 3 worker {i}"]
    failing = script(tmp_path, "import sys\nsys.exit(3)\n", "fail.py")
    assert main(["launch", "--workers", "2", failing]) == 3
    assert "[launcher] worker" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["launch", "--workers", "0", "x.py"], "argument --workers: must be at least 1, got 0"),
        (["launch", "--workers", "two", "x.py"], "argument --workers: 'two' is not an integer"),
        (["launch", "--workers", "2", "--timeout", "0", "x.py"], "argument --timeout: must be positive, got 0"),
        (["launch", "--workers", "2", "missing.py"], "keras-replicator launch: error: Script 'missing.py' does not exist."),
        (["k8s", "--workers", "2", "--image", "i:1", "--name", "My_Job", "t.py"], "name must be a Kubernetes name"),
        (["k8s", "--workers", "2", "t.py"], "the following arguments are required: --image"),
    ],
)
def test_command_line_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


# --- Kubernetes ------------------------------------------------------------------------------


def test_k8s_manifest_is_a_tfjob():
    args = ["--epochs", "3", "--note", 'a: b "c" #d']
    manifest = yaml.safe_load(k8s_manifest("/app/train.py", args, workers=4, image="reg.io/team/train:1.2",
                                           name="resnet-50", namespace="research", gpus_per_worker=8))
    assert manifest["apiVersion"] == "kubeflow.org/v1" and manifest["kind"] == "TFJob"
    assert manifest["metadata"] == {"name": "resnet-50", "namespace": "research"}
    worker = manifest["spec"]["tfReplicaSpecs"]["Worker"]
    assert set(manifest["spec"]["tfReplicaSpecs"]) == {"Worker"}  # no chief/ps: worker 0 is the chief
    assert worker["replicas"] == 4 and worker["restartPolicy"] == "OnFailure"
    (container,) = worker["template"]["spec"]["containers"]
    assert container["name"] == "tensorflow"
    assert container["image"] == "reg.io/team/train:1.2"
    assert container["command"] == ["python", "/app/train.py", *args]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 8}}
    plain = yaml.safe_load(k8s_manifest("t.py", workers=1, image="i"))
    assert "resources" not in plain["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert "namespace" not in plain["metadata"]


def test_k8s_command_prints_the_manifest(capsys):
    assert main(["k8s", "--workers", "2", "--image", "img:3", "--restart-policy", "ExitCode", "t.py", "--fast"]) == 0
    manifest = yaml.safe_load(capsys.readouterr().out)
    worker = manifest["spec"]["tfReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 2 and worker["restartPolicy"] == "ExitCode"
    assert worker["template"]["spec"]["containers"][0]["command"] == ["python", "t.py", "--fast"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"workers": 0}, "workers must be an integer >= 1"),
        ({"image": "my image"}, "image must be a container image reference"),
        ({"name": "-job"}, "name must be a Kubernetes name"),
        ({"name": "x" * 64}, "name must be a Kubernetes name"),
        ({"namespace": "Team"}, "namespace must be a Kubernetes name"),
        ({"gpus_per_worker": -1}, "gpus_per_worker must be an integer >= 0"),
        ({"restart_policy": "Sometimes"}, "restart_policy must be one of"),
    ],
)
def test_bad_k8s_arguments(kwargs, message):
    arguments = {"workers": 2, "image": "img:1", **kwargs}
    with pytest.raises(ValueError, match=re.escape(message)):
        k8s_manifest("t.py", **arguments)
