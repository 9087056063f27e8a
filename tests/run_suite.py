"""Runs the whole suite: one pytest process per simulated device count.

Usage: `python -m tests.run_suite [pytest args...]` (`make test` does this). The
device counts are read from the test modules' marks (`pytestmark =
pytest.mark.devices(n)`; a module without one runs with `conftest.DEFAULT_DEVICES`),
so no process runs for a count that no module asks for. Test files given as
arguments restrict the scan to them. Each process lists its 15 slowest tests (where
the suite's time goes); then one closing line with the totals; exits non-zero if
any run failed.
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


def main(argv: list[str]) -> int:
    started = time.time()
    grand = {"passed": 0, "failed": 0, "skipped": 0}
    worst = 0
    counts = device_counts(argv)
    with tempfile.TemporaryDirectory() as tmp:
        for n in counts:
            junit = os.path.join(tmp, f"devices{n}.xml")
            env = dict(os.environ, KR_TEST_DEVICES=str(n))
            print(f"\n=== pytest with {n} simulated CPU device(s) ===", flush=True)
            code = subprocess.call(
                [sys.executable, "-m", "pytest", "-q", "--durations=15", f"--junitxml={junit}", *argv],
                env=env
            )
            c = _counts(junit)
            failed = c["failures"] + c["errors"]
            grand["passed"] += c["tests"] - failed - c["skipped"]
            grand["failed"] += failed
            grand["skipped"] += c["skipped"]
            if code == 5:  # no test selected for this device count
                continue
            worst = worst or code
    minutes = (time.time() - started) / 60
    print(f"\nwhole suite: {minutes:.1f} min over device counts {tuple(counts)}")
    print(f"{grand['passed']} passed, {grand['failed']} failed, {grand['skipped']} skipped")
    if grand["passed"] == 0:
        print("no test ran", file=sys.stderr)
        return 1
    return 1 if (worst or grand["failed"]) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
