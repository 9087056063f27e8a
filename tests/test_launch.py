"""The ``keras-replicator launch`` command (and ``k8s``'s start), with small scripts that need no TensorFlow.

The manifests of ``keras-replicator k8s`` are tested in test_kubernetes.py.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import yaml

from keras_replicator import cluster
from keras_replicator.__main__ import main
from keras_replicator.launch import (
    LaunchConfig,
    RestartPolicy,
    _detect_gpus,
    cluster_addresses,
    format_address,
    free_ports,
    gpu_assignment,
    k8s_manifest,
    launch,
    parse_hosts,
    rendezvous,
    split_address,
    tf_config,
)
from keras_replicator.launch.supervisor import Action, Console, Supervisor, WorkerSpec
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
        time.sleep(600)
    """
    out = io.StringIO()
    started = time.monotonic()
    code = launch(script(tmp_path, body), workers=3, output=out)
    elapsed = time.monotonic() - started
    assert code == 7
    assert "[worker 2] giving up" in out.getvalue()
    assert "[launcher] worker 2 exited with code 7; stopping the others" in out.getvalue()
    # The sleepers were stopped (the SIGTERM-proof one killed after 5 s): unstopped they would sleep
    # 600 s, so the bound holds by construction whatever the load (about 6 s on a quiet machine).
    assert elapsed < 300, elapsed
    for pid in map(int, os.listdir(pids)):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_exit_codes_of_killed_workers_and_timeout(tmp_path):
    killed = script(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", "killed.py")
    assert launch(killed, workers=2, output=io.StringIO()) == 128 + 9
    sleeper = script(tmp_path, "import time\ntime.sleep(600)\n", "sleeper.py")
    out = io.StringIO()
    started = time.monotonic()
    assert launch(sleeper, workers=2, timeout=1, output=out) == 124
    assert time.monotonic() - started < 300  # not the sleepers' 600 s
    assert "[launcher] timeout after 1 s; stopping every worker" in out.getvalue()


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"workers": 0}, ValueError, "workers must be a positive integer, got 0"),
        ({}, ValueError, "Give workers=N (one machine) or hosts='h1:2,h2:2' (several)"),
        ({"workers": 2, "devices_per_worker": 0}, ValueError, "devices_per_worker must be a positive integer or None, got 0"),
        ({"workers": 2, "host": "127.0.0.1 "}, ValueError, "host must be an address"),
        ({"workers": 2, "timeout": -1}, ValueError, "timeout must be a positive number or None, got -1"),
        ({"workers": 2, "max_restarts": -1}, ValueError, "max_restarts must be a non-negative integer, got -1"),
        ({"workers": 2, "tee": "some"}, ValueError, "tee must be one of 'all', 'chief', 'none'; got 'some'"),
        ({"workers": 2, "grace": -1}, ValueError, "grace must be a non-negative number, got -1"),
        ({"workers": 2, "log_dir": ""}, ValueError, "log_dir must be a directory path, got ''"),
        ({"workers": 2, "node_rank": 1}, ValueError, "node_rank=1 needs hosts="),
        ({"workers": 2, "hosts": "a:1"}, ValueError, "Give either workers= (one machine) or hosts="),
        ({"hosts": "a:1,b:1"}, ValueError, "hosts names 2 nodes: give node_rank (--node-rank)"),
        ({"hosts": "a:1,b:1", "node_rank": 2}, ValueError, "node_rank must be an integer in [0, 1], got 2"),
        ({"hosts": "a:1,b"}, ValueError, "hosts must be comma-separated host:count entries such as 'h1:2,h2:2', got 'a:1,b' ('b' is not host:count)"),
        ({"hosts": "a:0"}, ValueError, "the worker count of host 'a' must be a positive integer, got 0"),
        ({"hosts": "a:2", "port": 65535}, ValueError, "Ports 65535..65536 of host 'a' exceed 65535"),
        ({"hosts": "a:2", "port": 0}, ValueError, "port must be an integer in [1, 65535], got 0"),
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


def test_a_module_runs_as_with_python_dash_m(tmp_path):
    package = tmp_path / "lib" / "trainers"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "job.py").write_text(textwrap.dedent(REPORT))
    (package / "__main__.py").write_text("print('package main')\n")
    env = {"PYTHONPATH": str(tmp_path / "lib")}
    out = io.StringIO()
    assert launch("trainers.job", ["--lr", "0.1"], module=True, workers=2, env=env, output=out) == 0
    assert lines_of(out.getvalue(), 1)[0] == "index 1 args ['--lr', '0.1']"
    out = io.StringIO()
    assert launch("trainers", module=True, workers=1, env=env, output=out) == 0  # its __main__
    assert lines_of(out.getvalue(), 0) == ["package main"]
    # A module the workers would not find, or not a module name: refused before any start.
    for name, error, message in [
        ("trainers.nope", ModuleNotFoundError, "No module named 'trainers.nope'"),
        ("nope_at_all", ModuleNotFoundError, "No module named 'nope_at_all'"),
        ("trainers/job.py", ValueError, "module must be a dotted module name"),
    ]:
        with pytest.raises(error, match=re.escape(message)):
            launch(name, module=True, workers=2, env=env, output=io.StringIO())
    manifest = yaml.safe_load(k8s_manifest("trainers.job", ["-x"], module=True, workers=1, image="i"))
    job = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["template"]["spec"]["containers"][0]["command"] == ["python", "-m", "trainers.job", "-x"]


def test_free_ports_and_tf_config():
    ports = free_ports(4)
    assert len(set(ports)) == 4 and all(1 <= p <= 65535 for p in ports)
    assert json.loads(tf_config(["a:1", "b:2"], 1)) == {
        "cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 1}}
    with pytest.raises(ValueError, match=re.escape("index must be an integer in [0, 2), got 2")):
        tf_config(["a:1", "b:2"], 2)
    with pytest.raises(ValueError, match="A worker's address must be host:port, got 'a'"):
        tf_config(["a"], 0)
    with pytest.raises(ValueError, match="n must be a positive integer"):
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
        (["launch", "--workers", "2", "-m", "no_such_module.train"], "error: No module named 'no_such_module.train'"),
        (["k8s", "--workers", "2", "--image", "i:1", "--name", "My_Job", "t.py"], "name must be a Kubernetes name"),
        (["k8s", "--workers", "2", "t.py"], "the following arguments are required: --image"),
    ],
)
def test_command_line_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


# --- Signals: forwarded to every worker, and the launcher exits after them ------------------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_to_the_launcher_is_forwarded_and_no_worker_outlives_it(tmp_path, signum):
    """Workers that print nothing: one records the signal and exits, one ignores it (as a
    multi-worker TensorFlow process ignores SIGTERM) and is killed after the grace period."""
    pids = tmp_path / "pids"
    pids.mkdir()
    body = f"""
        import os, signal, time
        index = int(os.environ["KERAS_REPLICATOR_WORKER_INDEX"])
        here = {str(pids)!r}
        def record(signum, frame):
            open(os.path.join(here, f"got{{index}}-{{signum}}"), "w").close()
            os._exit(0)
        if index == 0:
            signal.signal({int(signum)}, record)
        if index == 1:
            signal.signal({int(signum)}, signal.SIG_IGN)
        open(os.path.join(here, str(os.getpid())), "w").close()
        time.sleep(600)
    """
    command = [sys.executable, "-m", "keras_replicator", "launch", "--workers", "3", "--grace", "2",
               script(tmp_path, body)]
    launcher = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
    worker_pids: list[int] = []
    try:
        deadline = time.monotonic() + 300  # a limit for a hang
        while len(worker_pids) < 3 and time.monotonic() < deadline:
            worker_pids = [int(name) for name in os.listdir(pids) if name.isdigit()]
            time.sleep(0.05)
        assert len(worker_pids) == 3, launcher.stdout and launcher.poll()
        started = time.monotonic()
        launcher.send_signal(signum)
        output = launcher.communicate(timeout=400)[0]  # a limit for a hang
        elapsed = time.monotonic() - started
        # The launcher waited for its workers: none is left when it has exited.
        assert [pid for pid in worker_pids if _alive(pid)] == []
        assert launcher.returncode == 128 + signum, output
        name = signal.Signals(signum).name
        assert f"[launcher] got {name}: forwarding it to every worker (SIGKILL after 2 s" in output
        assert "[launcher] every worker has exited" in output
        assert (pids / f"got0-{int(signum)}").exists()  # the same signal reached the worker
        # The one ignoring it was killed after the 2 s grace period, not after its 600 s sleep.
        assert 2 <= elapsed < 300, elapsed
    finally:
        for pid in worker_pids:  # only if the test failed: leave nothing behind
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def test_a_second_signal_kills_at_once(tmp_path):
    body = """
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(900)
    """
    command = [sys.executable, "-m", "keras_replicator", "launch", "--workers", "2", "--grace", "600",
               script(tmp_path, body)]
    launcher = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
    try:
        ready = 0
        while ready < 2:
            line = launcher.stdout.readline()
            assert line, "the launcher ended early"
            ready += line.endswith("ready\n")
        started = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        launcher.send_signal(signal.SIGTERM)
        output = launcher.communicate(timeout=400)[0]  # a limit for a hang
        assert launcher.returncode == 128 + signal.SIGTERM, output
        assert time.monotonic() - started < 300  # not the 600 s grace period
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


# --- Restarts, logs, several hosts, GPUs -----------------------------------------------------


FAIL_ONCE = """
    import os, sys, time
    index = int(os.environ["KERAS_REPLICATOR_WORKER_INDEX"])
    restart = int(os.environ["KERAS_REPLICATOR_RESTART_COUNT"])
    print("worker", index, "restart", restart, "config", os.environ["TF_CONFIG"])
    printed = os.environ.get("PRINTED")  # a folder: worker 0 says there that it has printed
    if printed and index == 0:
        open(os.path.join(printed, str(restart)), "w").close()
    if index == 1 and restart < {failures}:
        deadline = time.monotonic() + 300  # with PRINTED, fails once worker 0 has printed
        while printed and not os.path.exists(os.path.join(printed, str(restart))) and time.monotonic() < deadline:
            time.sleep(0.05)
        print("failing on purpose")
        sys.exit(3)
"""


def test_max_restarts_restarts_every_worker_until_success(tmp_path):
    (printed := tmp_path / "printed").mkdir()
    out = io.StringIO()
    # Worker 1 fails once worker 0 has printed its line (the launcher then stops worker 0, whatever
    # it has done): each start's line is there however slowly the workers start.
    code = launch(script(tmp_path, FAIL_ONCE.format(failures=2)), workers=2, max_restarts=2, output=out,
                  grace=1, env={"PRINTED": str(printed)})
    text = out.getvalue()
    assert code == 0, text
    assert "[launcher] restarting every worker (restart 1 of 2)" in text
    assert "[launcher] restarting every worker (restart 2 of 2)" in text
    for i in range(2):
        assert [line.split(" config")[0] for line in lines_of(text, i) if line.startswith("worker")] == [
            f"worker {i} restart {r}" for r in range(3)]
    # Out of restarts: the failure's exit code.
    out = io.StringIO()
    assert launch(script(tmp_path, FAIL_ONCE.format(failures=5)), workers=2, max_restarts=1, output=out,
                  grace=1) == 3
    assert out.getvalue().count("[launcher] worker 1 exited with code 3") == 2


def test_log_dir_and_chief_only_output(tmp_path):
    body = f"""
        import os, sys, time
        index = int(os.environ["KERAS_REPLICATOR_WORKER_INDEX"])
        for k in range(30):
            print(f"line {{k}} of worker {{index}}", flush=True)
        open(os.path.join({str(tmp_path)!r}, f"printed_{{index}}"), "w").close()
        if index == 2:  # fail only once the others have printed (the launcher then stops them)
            deadline = time.monotonic() + 300  # a limit for a hang
            while time.monotonic() < deadline and not all(
                    os.path.exists(os.path.join({str(tmp_path)!r}, f"printed_{{i}}")) for i in (0, 1)):
                time.sleep(0.05)
            sys.exit(5)
    """
    out = io.StringIO()
    code = launch(script(tmp_path, body), workers=3, log_dir=str(tmp_path / "logs"), tee="chief",
                  output=out, grace=1)
    assert code == 5
    for i in range(3):  # each worker's whole output, unprefixed, in its own file
        log = (tmp_path / "logs" / f"worker_{i}.log").read_text().splitlines()
        assert log == [f"line {k} of worker {i}" for k in range(30)]
    text = out.getvalue()
    assert lines_of(text, 0) == [f"line {k} of worker 0" for k in range(30)]
    assert "line 0 of worker 1" not in text  # not the chief: in its log file only
    # The failing worker's last 20 lines are printed even though it is not the chief.
    assert "[launcher] the last lines of worker 2:" in text
    assert lines_of(text, 2) == [f"line {k} of worker 2" for k in range(10, 30)]
    quiet = io.StringIO()
    assert launch(script(tmp_path, REPORT), workers=2, tee="none", output=quiet) == 0
    assert quiet.getvalue() == ""


def test_log_dir_keeps_every_restart(tmp_path):
    logs = tmp_path / "logs"
    assert main(["launch", "--workers", "2", "--max-restarts", "1", "--log-dir", str(logs), "--tee", "none",
                 "--grace", "1", script(tmp_path, FAIL_ONCE.format(failures=1))]) == 0
    log = (logs / "worker_1.log").read_text()
    assert "worker 1 restart 0" in log and "failing on purpose" in log
    assert "[launcher] restart 1 of 1" in log and "worker 1 restart 1" in log


def test_hosts_and_node_ranks_give_every_node_the_same_cluster(tmp_path):
    assert parse_hosts("10.0.0.1:2, node-b:1,[fe80::1]:3") == [("10.0.0.1", 2), ("node-b", 1), ("fe80::1", 3)]
    assert cluster_addresses(parse_hosts("h1:2,h2:1,[::1]:1"), 2222) == [
        "h1:2222", "h1:2223", "h2:2222", "[::1]:2222"]
    # Two "machines" on 127.0.0.1: the second's workers continue the port range.
    (port,) = free_ports(1)
    outputs = [io.StringIO(), io.StringIO()]
    codes = [None, None]

    def node(rank):
        codes[rank] = launch(script(tmp_path, REPORT), hosts="127.0.0.1:2,127.0.0.1:1", node_rank=rank,
                             port=port, output=outputs[rank])

    threads = [threading.Thread(target=node, args=(rank,)) for rank in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert codes == [0, 0]
    expected = [f"127.0.0.1:{port + i}" for i in range(3)]
    for rank, indices in ((0, [0, 1]), (1, [2])):
        text = outputs[rank].getvalue()
        assert sorted({int(m) for m in re.findall(r"^\[worker (\d)\]", text, re.MULTILINE)}) == indices
        for i in indices:
            config = json.loads(lines_of(text, i)[2].removeprefix("config "))
            assert config == {"cluster": {"worker": expected}, "task": {"type": "worker", "index": i}}


def test_nnodes_find_each_other_through_the_master(tmp_path):
    """torchrun's style: N nodes, node 0's rendezvous server; each node picks its own free ports."""
    (master_port,) = free_ports(1)
    counts = {0: 2, 1: 1, 2: 1}  # workers per node (a node may have its own count)
    outputs = {rank: io.StringIO() for rank in counts}
    codes = {}

    def node(rank):
        codes[rank] = launch(script(tmp_path, REPORT), workers=counts[rank], nnodes=3, node_rank=rank,
                             master=f"127.0.0.1:{master_port}", rendezvous_timeout=60, output=outputs[rank])

    threads = [threading.Thread(target=node, args=(rank,)) for rank in (2, 1, 0)]  # node 0 last
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert codes == {0: 0, 1: 0, 2: 0}
    configs = {}
    for rank, indices in ((0, [0, 1]), (1, [2]), (2, [3])):
        text = outputs[rank].getvalue()
        assert sorted({int(m) for m in re.findall(r"^\[worker (\d)\]", text, re.MULTILINE)}) == indices
        for i in indices:
            configs[i] = json.loads(lines_of(text, i)[2].removeprefix("config "))
    clusters = {json.dumps(c["cluster"]) for c in configs.values()}
    assert len(clusters) == 1
    workers = json.loads(clusters.pop())["worker"]
    assert len(set(workers)) == 4 and all(re.fullmatch(r"127\.0\.0\.1:\d+", a) for a in workers)
    assert [configs[i]["task"] for i in range(4)] == [{"type": "worker", "index": i} for i in range(4)]


def test_rendezvous_errors(tmp_path):
    (port,) = free_ports(1)
    master = f"127.0.0.1:{port}"
    with pytest.raises(TimeoutError, match=re.escape(f"Rendezvous at {master}: node rank(s) [1] did not arrive within 1 s")):
        rendezvous(master, 2, 0, ["127.0.0.1:1"], timeout=1)
    with pytest.raises(TimeoutError, match=f"Rendezvous: node 1 could not reach node 0 at {master} within 1 s"):
        rendezvous(master, 2, 1, ["127.0.0.1:1"], timeout=1)
    assert rendezvous(master, 1, 0, ["a:1"]) == [["a:1"]]
    # A node started with another --nnodes is refused by node 0, which names the problem.
    errors = []

    def mismatched_node():
        try:
            rendezvous(master, 3, 1, ["127.0.0.1:2"], timeout=10)
        except TimeoutError as e:
            errors.append(str(e))

    other = threading.Thread(target=mismatched_node)
    other.start()
    with pytest.raises(ValueError, match="a node says it is rank 1 of 3, but this job has 2 nodes"):
        rendezvous(master, 2, 0, ["127.0.0.1:1"], timeout=10)
    other.join(timeout=30)
    assert errors == [f"Rendezvous at {master}: node 0 ended the rendezvous without answering node 1 (a "
                      "different --nnodes, or a --node-rank given twice?); see node 0's error."]
    for kwargs, message in [
        ({"nnodes": 2, "workers": 1}, "nnodes= needs workers= (per node) and master='host:port'"),
        ({"nnodes": 2, "workers": 1, "master": "h"}, "master must be host:port, got 'h'"),
        ({"nnodes": 2, "workers": 1, "master": "h:1"}, "nnodes=2: give node_rank (--node-rank), 0 .. 1"),
        ({"nnodes": 2, "workers": 1, "master": "h:1", "node_rank": 2}, "node_rank must be an integer in [0, 1], got 2"),
        ({"nnodes": 2, "hosts": "a:1", "master": "h:1"}, "nnodes= (with master=) replaces hosts="),
        ({"workers": 1, "master": "h:1"}, "master= goes with nnodes="),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            launch(script(tmp_path, "print(1)\n"), **kwargs)
    # From the command line, a rendezvous that does not complete is exit code 1 and a message.
    result = _cli("launch", "--nnodes", "2", "--node-rank", "1", "--master", master, "--workers", "1",
                  "--rendezvous-timeout", "1", script(tmp_path, "print(1)\n"))
    assert result.returncode == 1
    assert f"keras-replicator launch: Rendezvous: node 1 could not reach node 0 at {master}" in result.stderr


def test_each_local_worker_gets_its_gpus(tmp_path, monkeypatch):
    body = "import os\nprint('gpus', os.environ.get('CUDA_VISIBLE_DEVICES'))\n"
    out = io.StringIO()
    assert launch(script(tmp_path, body), workers=2, gpus=["0", "1", "2", "3", "4"], output=out) == 0
    assert lines_of(out.getvalue(), 0) == ["gpus 0,1"] and lines_of(out.getvalue(), 1) == ["gpus 2,3"]
    # Fewer GPUs than workers: shared, and said so.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    out = io.StringIO()
    assert launch(script(tmp_path, body), workers=2, output=out) == 0
    assert "[launcher] 2 local workers but 1 GPU(s): they share them" in out.getvalue()
    assert lines_of(out.getvalue(), 1) == ["gpus 7"]
    # Detection: the launcher's CUDA_VISIBLE_DEVICES first; no nvidia-smi on this machine.
    assert _detect_gpus({"CUDA_VISIBLE_DEVICES": "3,5"}) == ["3", "5"]
    assert _detect_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert gpu_assignment([], 2) is None and gpu_assignment(["0", "1"], 2) == ["0", "1"]
    # From the command line; '' for none.
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    result = _cli("launch", "--workers", "2", "--gpus", "4,5", script(tmp_path, body))
    assert lines_of(result.stdout, 0) == ["gpus 4"] and lines_of(result.stdout, 1) == ["gpus 5"]


# --- An elastic job (--workers MIN:MAX): a worker that keeps failing is left out -------------


BROKEN_GPU = """
    import glob, json, os, sys, time
    config = json.loads(os.environ["TF_CONFIG"])
    gpu, restart = os.environ["CUDA_VISIBLE_DEVICES"], os.environ["KERAS_REPLICATOR_RESTART_COUNT"]
    workers = len(config["cluster"]["worker"])
    print("worker", os.environ["KERAS_REPLICATOR_WORKER_INDEX"], "restart", restart, "gpu", gpu, "of",
          workers, "index", config["task"]["index"])
    printed = os.environ.get("PRINTED")  # a folder: each worker says there that it has printed
    if printed:
        open(os.path.join(printed, f"{restart}-{gpu}"), "w").close()
    if gpu in os.environ.get("BROKEN", "").split(","):
        # Its GPU is broken: it fails at every start; with PRINTED, once every worker of this start
        # has printed (the launcher stops the others when it fails, whatever they have done).
        deadline = time.monotonic() + 300
        while printed and len(glob.glob(os.path.join(printed, f"{restart}-*"))) < workers \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        sys.exit(int(os.environ.get("CODE", "5")))
    time.sleep(1)
"""


def test_an_elastic_job_goes_on_without_a_worker_that_keeps_failing(tmp_path):
    logs, printed = tmp_path / "logs", tmp_path / "printed"
    printed.mkdir()
    out = io.StringIO()
    # Worker 1 fails once the others of its start have printed their first line (PRINTED), so
    # that every start's line is in its slot's log however slowly the workers start.
    code = launch(script(tmp_path, BROKEN_GPU), workers="2:3", max_restarts=3, gpus=["0", "1", "2"],
                  env={"BROKEN": "1", "PRINTED": str(printed)}, log_dir=str(logs), output=out, grace=1)
    text = out.getvalue()
    assert code == 0, text
    # Start 0 and restart 1: 3 workers, worker 1 (GPU 1) fails first both times; then it is left out.
    assert text.count("[launcher] worker 1 exited with code 5; stopping the others") == 1
    assert ("[launcher] worker 1 exited with code 5, the first to fail on 2 starts in a row: stopping the "
            "others and leaving it out; the job goes on with 2 worker(s) (at least 2)") in text
    assert "[launcher] restarting every worker (restart 2 of 3)" in text
    assert "restart 3 of 3" not in text
    # Restart 2: the others, renumbered, each with its own GPU, in a cluster of 2.
    last = [line for i in range(3) for line in lines_of(text, i) if "restart 2" in line]
    assert sorted(last) == ["worker 0 restart 2 gpu 0 of 2 index 0", "worker 1 restart 2 gpu 2 of 2 index 1"]
    # Each slot keeps its log: GPU 2's worker wrote worker_2.log at every start, as worker 1 at the last.
    log = (logs / "worker_2.log").read_text()
    assert "worker 2 restart 0 gpu 2 of 3" in log and "worker 1 restart 2 gpu 2 of 2" in log


def test_an_elastic_job_never_goes_below_min_nor_blames_a_preemption(tmp_path):
    # At MIN already, it restarts with every worker until max_restarts, as a plain job does.
    out = io.StringIO()
    assert launch(script(tmp_path, BROKEN_GPU), workers="2:2", max_restarts=2, gpus=["0", "1"],
                  env={"BROKEN": "1"}, output=out, grace=1) == 5
    assert out.getvalue().count("[launcher] worker 1 exited with code 5; stopping the others") == 3
    assert "leaving it out" not in out.getvalue()
    # A worker that exits with 143 (preempted: it saved) is not to blame, however often.
    out = io.StringIO()
    assert launch(script(tmp_path, BROKEN_GPU), workers="1:2", max_restarts=2, gpus=["0", "1"],
                  env={"BROKEN": "1", "CODE": "143"}, output=out, grace=1) == 143
    assert "leaving it out" not in out.getvalue()
    # A failure after a preemption starts a new row: 143, 5, 143, 5 never makes two in a row.
    supervisor = Supervisor(WorkerSpec(["true"], {}), [("worker", 0), ("worker", 1)],
                            RestartPolicy(max_restarts=9, min_workers=1), Console(io.StringIO()))
    assert [supervisor._blame(("worker", 1), c) for c in (5, 143, 5, 5, 1)] == [1, 0, 1, 2, 3]
    assert supervisor._blame(("worker", 0), 1) == 1 and supervisor._blame(("worker", 1), 1) == 1


# --- Parameter-server jobs: chief + workers + ps, a failed worker restarted alone --------------


PS_TASK = """
    import glob, json, os, sys, time
    config = json.loads(os.environ["TF_CONFIG"])
    job, index = config["task"]["type"], config["task"]["index"]
    restart = int(os.environ["KERAS_REPLICATOR_RESTART_COUNT"])
    here = {here!r}
    print("task", job, index, "restart", restart, "cluster", json.dumps(config["cluster"]))
    open(os.path.join(here, f"{{job}}{{index}}-{{restart}}-{{os.getpid()}}"), "w").close()
    if job == "worker" and index == 1 and restart == 0:
        sys.exit(4)  # dies once
    if job == "chief":
        # Waits until every task named has started (its file exists), and with CHIEF_WAITS_FOR_EXIT
        # until the launcher has reaped it: the launcher reports a task's exit in the poll that reaps
        # it, before it looks at the chief again. The chief's end stops the others.
        deadline = time.monotonic() + 300  # a limit for a hang
        patterns = os.environ.get("CHIEF_WAITS_FOR", "worker1-1-*,worker0-0-*,ps0-0-*").split(",")
        while not all(glob.glob(os.path.join(here, p)) for p in patterns) and time.monotonic() < deadline:
            time.sleep(0.05)
        if os.environ.get("CHIEF_WAITS_FOR_EXIT"):
            for name in (n for p in patterns for n in glob.glob(os.path.join(here, p))):
                stat = f"/proc/{{name.rsplit('-', 1)[1]}}/stat"
                while os.path.exists(stat) and time.monotonic() < deadline:
                    time.sleep(0.05)
        print("chief done")
        sys.exit(0)
    time.sleep(600)  # workers and ps tasks serve until they are stopped
"""


EVERY_WORKER_FAILS = """
    import json, os, sys, time
    if json.loads(os.environ["TF_CONFIG"])["task"]["type"] != "worker":
        time.sleep(600)
    here, mine = {here!r}, int(os.environ["KERAS_REPLICATOR_WORKER_INDEX"])
    if mine == 1:
        deadline = time.monotonic() + 300  # a limit for a hang
        while not os.path.exists(os.path.join(here, "worker0")) and time.monotonic() < deadline:
            time.sleep(0.05)
        stat = "/proc/" + open(os.path.join(here, "worker0")).read() + "/stat"
        while os.path.exists(stat) and open(stat).read().rsplit(")", 1)[1].split()[0] != "Z" \
                and time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        with open(os.path.join(here, "pid"), "w") as f:
            f.write(str(os.getpid()))
        os.replace(os.path.join(here, "pid"), os.path.join(here, "worker0"))
    sys.exit(5)
"""


def test_parameter_server_job_restarts_a_failed_worker_alone(tmp_path):
    here = tmp_path / "tasks"
    here.mkdir()
    out = io.StringIO()
    code = launch(script(tmp_path, PS_TASK.format(here=str(here))), workers=2, ps=1, max_restarts=2,
                  grace=1, output=out, log_dir=str(tmp_path / "logs"))
    text = out.getvalue()
    assert code == 0, text
    started = sorted(name.rsplit("-", 1)[0] for name in os.listdir(here))
    # The chief, worker 0 and the ps started once; worker 1 twice (restarted alone).
    assert started == ["chief0-0", "ps0-0", "worker0-0", "worker1-0", "worker1-1"]
    assert "[launcher] worker 1 exited with code 4; restarting it (restart 1 of 2)" in text
    assert "[chief 0] chief done" in text
    assert "[launcher] the chief finished; stopping the workers and ps tasks" in text
    clusters = {json.dumps(json.loads(m), sort_keys=True) for m in re.findall(r"cluster (\{.*\})", text)}
    assert len(clusters) == 1  # the restarted worker kept its address
    cluster = json.loads(clusters.pop())
    assert {job: len(tasks) for job, tasks in cluster.items()} == {"chief": 1, "worker": 2, "ps": 1}
    addresses = [a for tasks in cluster.values() for a in tasks]
    assert len(set(addresses)) == 4 and all(a.startswith("127.0.0.1:") for a in addresses)
    assert sorted(os.listdir(tmp_path / "logs")) == ["chief_0.log", "ps_0.log", "worker_0.log", "worker_1.log"]
    for pid in (int(name.rsplit("-", 1)[1]) for name in os.listdir(here)):
        assert not _alive(pid)
    # Without restarts left, the job goes on without the worker: the chief finishes it.
    (here2 := tmp_path / "again").mkdir()
    out = io.StringIO()
    # The chief ends once the launcher has reaped worker 1 (it reports the exit in that same poll),
    # not a fixed time after the exit, which a starved launcher might not have seen yet.
    assert launch(script(tmp_path, PS_TASK.format(here=str(here2)), "ps2.py"), workers=2, ps=1, grace=1,
                  output=out, env={"CHIEF_WAITS_FOR": "worker1-0-*", "CHIEF_WAITS_FOR_EXIT": "1"}) == 0
    text = out.getvalue()
    assert ("[launcher] worker 1 exited with code 4; the job goes on without it (the chief runs its "
            "steps on the other workers)") in text
    assert text.index("the job goes on without it") < text.index("[chief 0] chief done")
    assert "[launcher] the chief finished; stopping the workers and ps tasks" in text
    # Unless it was the last worker: nothing would run the chief's steps.
    # Worker 1 fails once worker 0 has exited (whichever starts first), so the launcher sees
    # worker 0's failure first.
    (here4 := tmp_path / "every").mkdir()
    out = io.StringIO()
    assert launch(script(tmp_path, EVERY_WORKER_FAILS.format(here=str(here4)), "ps4.py"), workers=2, ps=1,
                  grace=1, output=out) == 5
    assert "[launcher] worker 0 exited with code 5; the job goes on without it" in out.getvalue()
    assert ("[launcher] worker 1 exited with code 5; stopping the others (no worker is left)"
            in out.getvalue())
    # A failed ps task ends the job: no restart, whatever max_restarts says.
    failing_ps = "import json, os, sys, time\nif json.loads(os.environ['TF_CONFIG'])['task']['type'] == 'ps':\n" \
                 "    sys.exit(6)\ntime.sleep(600)\n"
    out = io.StringIO()
    assert launch(script(tmp_path, failing_ps, "ps3.py"), workers=1, ps=1, max_restarts=2, grace=1, output=out) == 6
    assert ("[launcher] ps 0 exited with code 6; stopping the others (a parameter-server job cannot go "
            "on without a parameter server: its variables are lost)") in out.getvalue()
    assert "restart" not in out.getvalue()
    with pytest.raises(ValueError, match="ps= runs a parameter-server job on one machine"):
        launch(script(tmp_path, "print(1)\n"), hosts="a:1", ps=1)


def test_tf_config_of_a_parameter_server_cluster():
    cluster = {"chief": ["h:1"], "worker": ["h:2", "h:3"], "ps": ["h:4"]}
    assert json.loads(tf_config(cluster, 1, "worker")) == {"cluster": cluster, "task": {"type": "worker", "index": 1}}
    with pytest.raises(ValueError, match=re.escape("task_type 'evaluator' is not a job of the cluster")):
        tf_config(cluster, 0, "evaluator")
    with pytest.raises(ValueError, match=re.escape("index must be an integer in [0, 1), got 1")):
        tf_config(cluster, 1, "ps")
    with pytest.raises(ValueError, match="The ps task's address must be host:port, got 'h'"):
        tf_config({"worker": ["h:1"], "ps": ["h"]}, 0)


# --- Startup: the command line imports no TensorFlow ------------------------------------------


_NO_TF = """
import runpy, sys
sys.argv = ["keras-replicator", *sys.argv[1:]]
try:
    runpy.run_module("keras_replicator", run_name="__main__")
except SystemExit as e:
    code = e.code
print("tensorflow imported:", "tensorflow" in sys.modules, "keras imported:", "keras" in sys.modules,
      "exit", code)
"""


@pytest.mark.parametrize("command", [["--help"], ["launch", "--help"], ["launch", "--workers", "2", "REPORT"],
                                     ["k8s", "--workers", "2", "--image", "i:1", "t.py"]])
def test_the_command_line_imports_no_tensorflow(tmp_path, command):
    command = [script(tmp_path, REPORT) if a == "REPORT" else a for a in command]
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    result = subprocess.run([sys.executable, "-c", _NO_TF, *command], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.stdout.rstrip().endswith("tensorflow imported: False keras imported: False exit 0"), (
        result.stdout[-2000:] + result.stderr[-2000:])
    assert result.stderr == ""  # no TensorFlow log lines
    # ... and the package still imports it when used.
    if command == ["--help"]:
        # A program's `import keras_replicator` imports it all (registering the package's Keras
        # objects for load_model); only the command line defers it. The time limit is for a hang
        # only: importing TensorFlow took over 120 s at a load average of 20.
        check = subprocess.run(
            [sys.executable, "-c", "import sys, keras_replicator as kr; "
             "print('tensorflow' in sys.modules, sorted(kr.__all__) == sorted(set(dir(kr)) & set(kr.__all__)))"],
            cwd=ROOT, capture_output=True, text=True, timeout=400)
        assert check.stdout.split() == ["True", "True"], check.stderr[-2000:]


# --- The config object and the restart policy -----------------------------------------------


def test_launch_config_is_checked_once_and_drives_launch(tmp_path):
    path = script(tmp_path, REPORT)
    config = LaunchConfig(path, ["--lr", "0.1"], workers=2, hosts=None, gpus=[3], env={"A": "1"})
    assert (config.mode, config.args, config.node_rank, config.gpus, config.env) == (
        "workers", ("--lr", "0.1"), 0, ("3",), {"A": "1"})
    assert config.command == [sys.executable, path, "--lr", "0.1"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.workers = 3
    assert LaunchConfig(path, hosts="h1:2,h2:1", node_rank=1).hosts == (("h1", 2), ("h2", 1))
    assert LaunchConfig(path, nnodes=2, workers=1, master="h:1", node_rank=1).mode == "nnodes"
    with pytest.raises(ValueError, match="master= goes with nnodes="):
        LaunchConfig(path, workers=1, master="h:1")
    with pytest.raises(TypeError, match="args must be strings"):
        LaunchConfig(path, "--lr 0.1", workers=1)  # a string, not a list of them
    # launch(config) runs it as launch(...) would; other arguments beside a config are refused.
    out = io.StringIO()
    assert launch(LaunchConfig(path, ["--lr", "0.1"], workers=2, gpus=[]), output=out) == 0
    assert lines_of(out.getvalue(), 1)[0] == "index 1 args ['--lr', '0.1']"
    with pytest.raises(ValueError, match=re.escape("launch(config) takes no other argument but output=, "
                                                   "got ['max_restarts', 'workers']")):
        launch(config, workers=3, max_restarts=1)
    # The command line builds the same config.
    from keras_replicator.__main__ import build_parser, config_from_args

    args = build_parser().parse_args(["launch", "--workers", "2", "--gpus", "", "--max-restarts", "1",
                                      path, "--lr", "0.1"])
    assert config_from_args(args) == LaunchConfig(path, ["--lr", "0.1"], workers=2, gpus=[], max_restarts=1)


def test_restart_policy():
    sync = RestartPolicy(max_restarts=1)
    assert sync.after_failure(("worker", 1), task_restarts=0, job_restarts=0) is Action.RESTART_JOB
    assert sync.after_failure(("worker", 1), task_restarts=0, job_restarts=1) is Action.END
    ps = RestartPolicy(max_restarts=1, parameter_servers=True)
    assert ps.after_failure(("worker", 1), task_restarts=0, job_restarts=0) is Action.RESTART_TASK
    assert ps.after_failure(("worker", 1), task_restarts=1, job_restarts=0) is Action.GO_ON
    assert RestartPolicy(parameter_servers=True).after_failure(("worker", 0), 0, 0) is Action.GO_ON
    for task in (("chief", 0), ("ps", 0)):
        assert ps.after_failure(task, task_restarts=0, job_restarts=0) is Action.END
    with pytest.raises(ValueError, match="max_restarts"):
        RestartPolicy(max_restarts=-1)
    # Elastic: a worker that failed first on worker_failures starts in a row is left out, down to MIN.
    elastic = RestartPolicy(max_restarts=3, min_workers=2, worker_failures=2)
    assert elastic.after_failure(("worker", 1), 0, 0, failures_in_a_row=1, workers=3) is Action.RESTART_JOB
    assert elastic.after_failure(("worker", 1), 0, 1, failures_in_a_row=2, workers=3) is Action.SHRINK
    assert elastic.after_failure(("worker", 1), 0, 1, failures_in_a_row=2, workers=2) is Action.RESTART_JOB
    assert elastic.after_failure(("worker", 1), 0, 3, failures_in_a_row=2, workers=3) is Action.END
    assert sync.after_failure(("worker", 1), 0, 0, failures_in_a_row=5, workers=3) is Action.RESTART_JOB
    for kwargs in ({"min_workers": 0}, {"worker_failures": 0}, {"min_workers": 1, "parameter_servers": True}):
        with pytest.raises(ValueError):
            RestartPolicy(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"workers": "4:1"}, "workers MIN:MAX needs MIN <= MAX, got '4:1'"),
        ({"workers": "0:2"}, "workers MIN:MAX needs MIN >= 1, got '0:2'"),
        ({"workers": "1:"}, "workers must be N or MIN:MAX with positive integers such as '2:4', got '1:'"),
        ({"workers": "1:2:3"}, "workers must be N or MIN:MAX"),
        ({"workers": "-1:2"}, "workers must be N or MIN:MAX"),
        ({"workers": 2, "min_workers": 3}, "workers='MIN:MAX' needs MIN <= MAX, got 3:2"),
        ({"workers": 2, "min_workers": 0}, "min_workers must be a positive integer, got 0"),
        ({"workers": "1:2", "min_workers": 1}, "workers='1:2' already gives min_workers"),
        ({"workers": "1:2", "ps": 1}, "workers='MIN:MAX' (--workers MIN:MAX) is for a synchronous job on one"),
        ({"workers": "1:2", "nnodes": 2, "master": "h:1", "node_rank": 0}, "not with hosts=, nnodes="),
        ({"workers": 2, "worker_failures": 2}, "worker_failures (--worker-failures) applies to an elastic job"),
        ({"workers": "1:2", "worker_failures": 0}, "worker_failures must be a positive integer, got 0"),
    ],
)
def test_bad_elastic_arguments(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LaunchConfig(script(tmp_path, "print(1)\n"), **kwargs)


def test_elastic_arguments_from_the_command_line(tmp_path, capsys):
    from keras_replicator.__main__ import build_parser, config_from_args

    path = script(tmp_path, "print(1)\n")
    config = config_from_args(build_parser().parse_args(["launch", "--workers", "2:4", path]))
    assert (config.min_workers, config.workers, config.worker_failures) == (2, 4, 2)
    assert config == LaunchConfig(path, workers="2:4") == LaunchConfig(path, workers=4, min_workers=2)
    config = config_from_args(build_parser().parse_args(["launch", "--workers", "3", path]))
    assert (config.min_workers, config.workers, config.worker_failures) == (None, 3, None)
    for args, message in [(["--workers", "3:2"], "argument --workers: workers MIN:MAX needs MIN <= MAX, got '3:2'"),
                          (["--workers", "a:2"], "argument --workers: workers must be N or MIN:MAX"),
                          (["--workers", "2", "--worker-failures", "3"], "worker_failures (--worker-failures) "
                           "applies to an elastic job"),
                          (["--hosts", "a:1,b:1", "--node-rank", "0", "--workers", "1:2"], "Give either workers=")]:
        with pytest.raises(SystemExit) as exit_info:
            main(["launch", *args, path])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    # k8s takes a number of pods only.
    with pytest.raises(SystemExit):
        main(["k8s", "--workers", "1:2", "--image", "i:1", "t.py"])
    assert "argument --workers: '1:2' is not an integer" in capsys.readouterr().err


def test_one_address_parser():
    assert split_address("10.0.0.1:2222") == ("10.0.0.1", 2222)
    assert split_address("[::1]:2222") == ("::1", 2222) and format_address("::1", 2222) == "[::1]:2222"
    assert split_address(format_address("node-1.example", 80)) == ("node-1.example", 80)
    for bad, message in (("h", "master must be host:port, got 'h'"), ("h:0", "master: port 0 of 'h:0' is not in"),
                         ("h/x:1", "master must be host:port"), (None, "master must be host:port, got None")):
        with pytest.raises(ValueError, match=re.escape(message)):
            split_address(bad, "master")


def test_grace_help_says_what_the_watch_does(tmp_path):
    # The default grace follows the longest save recorded, not the last one (issue 49).
    from keras_replicator.__main__ import build_parser
    from keras_replicator.launch.grace import SaveRecordWatch

    launch = build_parser()._subparsers._group_actions[0].choices["launch"]
    text = " ".join(launch.format_help().split())
    assert "2 x the longest backup save the chief recorded + 5" in text, text
    path = tmp_path / "save.json"
    watch = SaveRecordWatch(str(path), grace=None, say=lambda line: None)
    for seconds, mtime in ((7.4, 1), (3.0, 2)):
        path.write_text(json.dumps({"seconds": seconds, "bytes": 1}))
        os.utime(path, ns=(mtime * 10**9, mtime * 10**9))
        watch.poll()
    assert watch.grace == 20.0  # 2 x 7.4 + 5, rounded up: the longest, not the last (3.0 s: 11)
