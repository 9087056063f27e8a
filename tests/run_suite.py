"""Runs the whole suite: one pytest process per simulated device count.

Usage: `python -m tests.run_suite [--busy K] [pytest args...]` (`make test` does this). The
device counts are read from the test modules' marks (`pytestmark =
pytest.mark.devices(n)`; a module without one runs with `conftest.DEFAULT_DEVICES`),
so no process runs for a count that no module asks for. Test files given as
arguments restrict the scan to them. Each process lists its 15 slowest tests (where
the suite's time goes); then one closing line with the totals; exits non-zero if
any run failed.

A process that ends without its results (killed by a signal or the memory killer, or ended by
pytest-timeout after its stack dump) writes no JUnit report; the plugin tests/suite_progress.py
records as it goes which tests it started and finished, so the summary names that process (its
device count, exit status or signal, the last test it started) and counts every test of it that
did not finish as failed: the closing line never reads a dead process as green.

`--busy K` starts K processes that each keep one core busy while the tests run (a shared
machine's load, to check that a test does not depend on a quiet one); they end with the run,
however it ends (each stops when its parent is gone).

The most common count (the default's, most of the suite, with the timing-sensitive
tests) runs alone; the other counts' processes then run side by side, two at a time
(`KR_TEST_JOBS`, default 2; 1 runs everything in sequence). Much of their time is
single-threaded (tracing, imports, subprocesses starting), so on 2 cores this cut
about 3 minutes; each one's output is printed whole when it ends.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

_HERE = os.path.dirname(os.path.abspath(__file__))
_MARK = re.compile(r"pytest\.mark\.devices\((\d+)\)")
DEFAULT_DEVICES = 4  # conftest.DEFAULT_DEVICES (not imported: that would start TensorFlow)


def device_counts(argv: list[str]) -> list[int]:
    """The device counts the selected test modules ask for, most common first."""
    files = [a.split("::")[0] for a in argv if a.split("::")[0].endswith(".py")]
    files = files or sorted(glob.glob(os.path.join(_HERE, "test_*.py")))
    counts: dict[int, int] = {}
    for path in files:
        with open(path, encoding="utf-8") as f:
            marks = {int(n) for n in _MARK.findall(f.read())} or {DEFAULT_DEVICES}
        for n in marks:
            counts[n] = counts.get(n, 0) + 1
    return sorted(counts, key=lambda n: (-counts[n], n))


# Spins until its parent (this runner) is gone, checking every few milliseconds: so it ends with
# the run even if the runner is killed before it can stop it.
_SPIN = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    for _ in range(100000):\n        pass\n"


@contextlib.contextmanager
def busy_cores(count: int):
    """`count` processes that each keep one core busy until the block ends (or this process dies)."""
    processes = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(count)]
    try:
        yield processes
    finally:
        for p in processes:
            p.kill()
            p.wait()


def _junit_totals(junit_path: str) -> dict[str, int] | None:
    """passed, failed (failures and errors) and skipped from a JUnit report; None if it has none."""
    try:
        root = ET.parse(junit_path).getroot()
    except (OSError, ET.ParseError):
        return None
    c = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in [root] if root.tag == "testsuite" else list(root):
        for key in c:
            c[key] += int(suite.get(key, 0))
    failed = c["failures"] + c["errors"]
    return {"passed": c["tests"] - failed - c["skipped"], "failed": failed, "skipped": c["skipped"]}


def _exit_status(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def dead_process_totals(n: int, progress_path: str, code: int) -> tuple[dict[str, int], str]:
    """Totals of a pytest process that ended without its results, from its progress file, and a
    message saying so. Every test it did not finish (the one it died in and those after it)
    counts as failed; so does a process that died before collecting its tests."""
    collected, started, done, failed, skipped = None, [], set(), set(), set()
    if os.path.exists(progress_path):
        with open(progress_path, encoding="utf-8") as f:
            for line in f:
                kind, _, rest = line.rstrip("\n").partition(" ")
                if kind == "collected":
                    collected = int(rest)
                elif kind == "start":
                    started.append(rest)
                else:
                    {"done": done, "failed": failed, "skipped": skipped}.get(kind, set()).add(rest)
    head = f"pytest with {n} simulated CPU device(s) ended without its results ({_exit_status(code)})"
    if collected is None:
        return {"passed": 0, "failed": 1, "skipped": 0}, (
            f"{head} before its tests were collected: counted as 1 failed")
    passed = len(done - failed - skipped)
    done_failed = len(done & failed)
    done_skipped = len(done & skipped - failed)
    unfinished = collected - len(done)
    if not started:
        where = "before its first test started"
    elif started[-1] in done:
        where = f"after its test {started[-1]} had finished"
    else:
        where = f"during {started[-1]}"
    message = f"{head} {where}: {unfinished} of its {collected} tests did not run or finish, counted as failed"
    return {"passed": passed, "failed": done_failed + unfinished, "skipped": done_skipped}, message


def _command(n: int, tmp: str, argv: list[str]) -> tuple[list[str], dict]:
    env = dict(os.environ, KR_TEST_DEVICES=str(n), KR_TEST_PROGRESS=os.path.join(tmp, f"devices{n}.progress"))
    junit = os.path.join(tmp, f"devices{n}.xml")
    return [sys.executable, "-m", "pytest", "-q", "-p", "tests.suite_progress", "--durations=15",
            f"--junitxml={junit}", *argv], env


def _run_side_by_side(counts: list[int], tmp: str, argv: list[str], jobs: int) -> dict[int, int]:
    """Runs one pytest process per count, `jobs` at a time; prints each one's output whole."""
    codes: dict[int, int] = {}
    waiting = list(counts)
    running: list[tuple[int, subprocess.Popen, object]] = []
    while waiting or running:
        while waiting and len(running) < jobs:
            n = waiting.pop(0)
            cmd, env = _command(n, tmp, argv)
            log = open(os.path.join(tmp, f"devices{n}.log"), "w+")
            running.append((n, subprocess.Popen(cmd, env=env, stdout=log,
                                                stderr=subprocess.STDOUT), log))
        time.sleep(0.5)
        for item in list(running):
            n, proc, log = item
            if proc.poll() is None:
                continue
            running.remove(item)
            codes[n] = proc.returncode
            log.seek(0)
            print(f"\n=== pytest with {n} simulated CPU device(s) (side by side) ===", flush=True)
            sys.stdout.write(log.read())
            sys.stdout.flush()
            log.close()
    return codes


def _busy_option(argv: list[str]) -> tuple[int, list[str]]:
    """`--busy K` (or `--busy=K`) taken out of the arguments; the rest go to pytest."""
    rest, busy, i = [], 0, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--busy" or arg.startswith("--busy="):
            value = arg.partition("=")[2] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in arg else 2
            if not value.isdigit():
                raise SystemExit(f"--busy takes a whole number of busy cores, got {value!r}")
            busy = int(value)
            continue
        rest.append(arg)
        i += 1
    return busy, rest


def main(argv: list[str]) -> int:
    started = time.time()
    busy, argv = _busy_option(argv)
    grand = {"passed": 0, "failed": 0, "skipped": 0}
    worst = 0
    counts = device_counts(argv)
    jobs = os.environ.get("KR_TEST_JOBS", "2")
    if not jobs.isdigit() or int(jobs) < 1:
        raise SystemExit(f"KR_TEST_JOBS must be a whole number of at least 1, got {jobs!r}")
    jobs = int(jobs)
    dead = []
    with busy_cores(busy), tempfile.TemporaryDirectory() as tmp:
        if busy:
            print(f"{busy} process(es) keep a core busy each while the tests run (--busy)", flush=True)
        alone = counts[:1] if jobs > 1 else counts
        codes = {}
        for n in alone:
            print(f"\n=== pytest with {n} simulated CPU device(s) ===", flush=True)
            cmd, env = _command(n, tmp, argv)
            codes[n] = subprocess.call(cmd, env=env)
        codes.update(_run_side_by_side(counts[len(alone):], tmp, argv, jobs))
        for n in counts:
            if codes[n] == 5:  # no test selected for this device count
                continue
            totals = _junit_totals(os.path.join(tmp, f"devices{n}.xml"))
            if totals is None:
                totals, message = dead_process_totals(n, os.path.join(tmp, f"devices{n}.progress"), codes[n])
                dead.append(message)
            for key in grand:
                grand[key] += totals[key]
            worst = worst or codes[n]
    minutes = (time.time() - started) / 60
    print(f"\nwhole suite: {minutes:.1f} min over device counts {tuple(counts)}")
    for message in dead:
        print(message)
    print(f"{grand['passed']} passed, {grand['failed']} failed, {grand['skipped']} skipped")
    if grand["passed"] == 0 and not dead:
        print("no test ran", file=sys.stderr)
        return 1
    return 1 if (worst or grand["failed"]) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
