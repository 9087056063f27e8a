"""Runs the whole suite: one pytest process per simulated device count.

Usage: `python -m tests.run_suite [pytest args...]` (`make test` does this). The
device counts are read from the test modules' marks (`pytestmark =
pytest.mark.devices(n)`; a module without one runs with `conftest.DEFAULT_DEVICES`),
so no process runs for a count that no module asks for. Test files given as
arguments restrict the scan to them. Each process lists its 15 slowest tests (where
the suite's time goes); then one closing line with the totals; exits non-zero if
any run failed.

The most common count (the default's, most of the suite, with the timing-sensitive
tests) runs alone; the other counts' processes then run side by side, two at a time
(`KR_TEST_JOBS`, default 2; 1 runs everything in sequence). Much of their time is
single-threaded (tracing, imports, subprocesses starting), so on 2 cores this cut
about 3 minutes; each one's output is printed whole when it ends.
"""

from __future__ import annotations

import glob
import os
import re
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


def _counts(junit_path: str) -> dict[str, int]:
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if not os.path.exists(junit_path):
        return totals
    root = ET.parse(junit_path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    for suite in suites:
        for key in totals:
            totals[key] += int(suite.get(key, 0))
    return totals


def _command(n: int, junit: str, argv: list[str]) -> tuple[list[str], dict]:
    env = dict(os.environ, KR_TEST_DEVICES=str(n))
    return [sys.executable, "-m", "pytest", "-q", "--durations=15", f"--junitxml={junit}",
            *argv], env


def _run_side_by_side(counts: list[int], tmp: str, argv: list[str], jobs: int) -> dict[int, int]:
    """Runs one pytest process per count, `jobs` at a time; prints each one's output whole."""
    codes: dict[int, int] = {}
    waiting = list(counts)
    running: list[tuple[int, subprocess.Popen, object]] = []
    while waiting or running:
        while waiting and len(running) < jobs:
            n = waiting.pop(0)
            cmd, env = _command(n, os.path.join(tmp, f"devices{n}.xml"), argv)
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


def main(argv: list[str]) -> int:
    started = time.time()
    grand = {"passed": 0, "failed": 0, "skipped": 0}
    worst = 0
    counts = device_counts(argv)
    jobs = os.environ.get("KR_TEST_JOBS", "2")
    if not jobs.isdigit() or int(jobs) < 1:
        raise SystemExit(f"KR_TEST_JOBS must be a whole number of at least 1, got {jobs!r}")
    jobs = int(jobs)
    with tempfile.TemporaryDirectory() as tmp:
        alone = counts[:1] if jobs > 1 else counts
        codes = {}
        for n in alone:
            print(f"\n=== pytest with {n} simulated CPU device(s) ===", flush=True)
            cmd, env = _command(n, os.path.join(tmp, f"devices{n}.xml"), argv)
            codes[n] = subprocess.call(cmd, env=env)
        codes.update(_run_side_by_side(counts[len(alone):], tmp, argv, jobs))
        for n in counts:
            c = _counts(os.path.join(tmp, f"devices{n}.xml"))
            failed = c["failures"] + c["errors"]
            grand["passed"] += c["tests"] - failed - c["skipped"]
            grand["failed"] += failed
            grand["skipped"] += c["skipped"]
            if codes[n] == 5:  # no test selected for this device count
                continue
            worst = worst or codes[n]
    minutes = (time.time() - started) / 60
    print(f"\nwhole suite: {minutes:.1f} min over device counts {tuple(counts)}")
    print(f"{grand['passed']} passed, {grand['failed']} failed, {grand['skipped']} skipped")
    if grand["passed"] == 0:
        print("no test ran", file=sys.stderr)
        return 1
    return 1 if (worst or grand["failed"]) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
