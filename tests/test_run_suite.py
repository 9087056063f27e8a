"""tests/run_suite.py's summary and `--busy`, on fake test files that start no TensorFlow.

The fake files run in real pytest processes that run_suite starts; one of them kills itself
with SIGKILL mid-run, as the memory killer would, another before its tests are collected.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from tests import run_suite
from tests.helpers import ROOT

# The device marks, read as tests/conftest.py reads them (without importing TensorFlow).
CONFTEST = """
import os
NUM_DEVICES = int(os.environ["KR_TEST_DEVICES"])
def pytest_configure(config):
    config.addinivalue_line("markers", "devices(n): simulated devices")
def pytest_collection_modifyitems(config, items):
    marker = lambda item: item.get_closest_marker("devices")
    items[:] = [i for i in items if (marker(i).args[0] if marker(i) else 4) == NUM_DEVICES]
"""

DIES_MID_RUN = """
import os, signal
import pytest
pytestmark = pytest.mark.devices(2)
def test_passes(): pass
def test_skips(): pytest.skip("skipped")
def test_fails(): assert False
def test_is_killed(): os.kill(os.getpid(), signal.SIGKILL)
def test_never_runs(): pass
"""

DIES_BEFORE_COLLECTION = """
import os, signal
import pytest
pytestmark = pytest.mark.devices(3)
os.kill(os.getpid(), signal.SIGKILL)
def test_never_collected(): pass
"""

ENDS_NORMALLY = """
def test_passes(): pass
def test_fails(): assert False
"""


def _write(folder, **files: str) -> None:
    for name, body in files.items():
        (folder / name).write_text(textwrap.dedent(body))


def _run_suite(folder, *args: str, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("KR_TEST_DEVICES", None)
    return subprocess.Popen([sys.executable, "-m", "tests.run_suite", *args], cwd=folder, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)


def test_a_process_killed_mid_run_is_named_and_its_tests_counted_as_failed(tmp_path):
    _write(tmp_path, **{"conftest.py": CONFTEST, "test_dies.py": DIES_MID_RUN, "test_ends.py": ENDS_NORMALLY})
    p = _run_suite(tmp_path, "test_dies.py", "test_ends.py")
    output = p.communicate(timeout=240)[0]
    assert p.returncode == 1, output
    lines = output.splitlines()
    assert ("pytest with 2 simulated CPU device(s) ended without its results (killed by SIGKILL) during "
            "test_dies.py::test_is_killed: 2 of its 5 tests did not run or finish, counted as failed") in lines, output
    # The process that ended normally is counted from its JUnit report: 1 passed, 1 failed. The
    # killed one: 1 passed, 1 skipped, 1 failed and 2 that did not finish.
    assert lines[-1] == "2 passed, 4 failed, 1 skipped", output
    assert not any("ended without its results" in line and "4 simulated" in line for line in lines)


def test_a_process_killed_before_collection_counts_as_a_failure_and_a_green_run_says_so(tmp_path):
    _write(tmp_path, **{"conftest.py": CONFTEST, "test_dies_early.py": DIES_BEFORE_COLLECTION,
                        "test_ok.py": "def test_a(): pass\ndef test_b(): pass\n"})
    p = _run_suite(tmp_path, "test_dies_early.py")
    output = p.communicate(timeout=120)[0]
    assert p.returncode == 1, output
    assert output.splitlines()[-2:] == [
        "pytest with 3 simulated CPU device(s) ended without its results (killed by SIGKILL) before its "
        "tests were collected: counted as 1 failed", "0 passed, 1 failed, 0 skipped"], output
    p = _run_suite(tmp_path, "test_ok.py")
    output = p.communicate(timeout=120)[0]
    assert p.returncode == 0, output
    assert output.splitlines()[-1] == "2 passed, 0 failed, 0 skipped"
    assert "ended without its results" not in output


def _cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def test_busy_cores_spin_while_the_tests_run_and_end_with_the_runner_even_if_it_is_killed(tmp_path):
    started = tmp_path / "started"
    _write(tmp_path, **{"conftest.py": CONFTEST,
                        "test_waits.py": f"import time, pathlib\ndef test_waits():\n"
                                         f"    pathlib.Path({str(started)!r}).touch()\n    time.sleep(120)\n"})
    runner = _run_suite(tmp_path, "--busy", "2", "test_waits.py", start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert started.exists(), runner.stdout.read() if runner.poll() is not None else "no test started"
        children = psutil.Process(runner.pid).children()
        busy = [c for c in children if "-c" in c.cmdline()]
        assert len(busy) == 2 and len(children) == 3, [c.cmdline() for c in children]
        # Each one runs: its CPU time grows (waited for, not slept on: on a loaded machine a
        # spinner gets a small share of a core; 60 s is a limit for a hang).
        before = [_cpu_seconds(b) for b in busy]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
                _cpu_seconds(b) - t > 0.05 for b, t in zip(busy, before)):
            time.sleep(0.2)
        assert all(_cpu_seconds(b) - t > 0.05 for b, t in zip(busy, before)), before
        os.kill(runner.pid, signal.SIGKILL)  # no chance to stop them: they notice it themselves
        runner.wait()
        gone, alive = psutil.wait_procs(busy, timeout=30)
        assert not alive, alive
    finally:
        if runner.poll() is None:
            runner.kill()
        os.killpg(runner.pid, signal.SIGKILL)  # the pytest process it left waiting
        runner.wait()
        runner.stdout.close()


def test_busy_cores_end_with_the_block_and_bad_counts_are_refused():
    with run_suite.busy_cores(1) as processes:
        assert processes[0].poll() is None
    assert processes[0].returncode == -signal.SIGKILL
    assert run_suite._busy_option(["--busy", "2", "-k", "x"]) == (2, False, ["-k", "x"])
    assert run_suite._busy_option(["tests/a.py", "--busy=1", "--record"]) == (1, True, ["tests/a.py"])
    for bad in (["--busy"], ["--busy", "two"], ["--busy=-1"]):
        with pytest.raises(SystemExit, match=re.escape("--busy takes a whole number of busy cores")):
            run_suite._busy_option(bad)


def test_each_count_is_cut_into_parts_by_measured_time_and_a_run_records_it(tmp_path):
    files = {f"test_{name}.py": f"import pytest\npytestmark = pytest.mark.devices({n})\ndef test_a(): pass\n"
             for name, n in [("a", 4), ("b", 4), ("c", 4), ("d", 4), ("e", 2)]}
    _write(tmp_path, **files)
    paths = sorted(str(tmp_path / name) for name in files)
    measured = {"4": {"test_a.py": 600, "test_b.py": 400, "test_c.py": 250, "test_d.py": 100}}
    parts = run_suite.plan(paths, measured, chunk=500)
    # 1350 s of 4-device modules in parts of about 500 s: 3 parts, each module whole, longest first;
    # the 2-device module, unmeasured, is one part of its own.
    assert [(p.devices, sorted(os.path.basename(f) for f in p.files), p.seconds) for p in parts] == [
        (4, ["test_a.py"], 600), (4, ["test_b.py"], 400), (4, ["test_c.py", "test_d.py"], 350),
        (2, ["test_e.py"], run_suite._UNMEASURED_SECONDS)]
    assert [p.title for p in parts][::3] == ["pytest with 4 simulated CPU device(s), part 1 of 3",
                                              "pytest with 2 simulated CPU device(s)"]
    # Options stay, node ids keep their module's count.
    assert run_suite._split_args(["-m", "core", paths[0] + "::test_a"]) == ([paths[0] + "::test_a"], ["-m", "core"])
    # A run with --record writes what each module took, per count, keeping what it did not run.
    durations = tmp_path / "durations.json"
    durations.write_text('{"4": {"test_old.py": 7.0}}')
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("KR_TEST_DEVICES", None)
    _write(tmp_path, **{"conftest.py": CONFTEST})
    code = (
        "import sys; from tests import run_suite; run_suite.DURATIONS = sys.argv[1];"
        "sys.exit(run_suite.main(sys.argv[2:]))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(durations), "--record", *paths], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[-1] == "5 passed, 0 failed, 0 skipped"
    recorded = __import__("json").loads(durations.read_text())
    assert set(recorded["4"]) == {"test_old.py", "test_a.py", "test_b.py", "test_c.py", "test_d.py"}
    assert set(recorded["2"]) == {"test_e.py"} and recorded["4"]["test_old.py"] == 7.0
