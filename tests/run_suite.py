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

Each count's modules are cut into parts of about `CHUNK_SECONDS` of measured test time
(`tests/durations.json`, per count and module; `--record` rewrites it from the run), and the
parts of every count run side by side, `KR_TEST_JOBS` at a time (default 2; 1 runs them in
sequence), the longest first: much of a test's time is single-threaded (tracing, imports,
worker processes starting and waiting for each other), so on 2 cores two processes finish
sooner than one. Each part's output is printed whole when it ends.
"""

from __future__ import annotations

import contextlib
import glob
import json
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
DURATIONS = os.path.join(_HERE, "durations.json")
#: The measured test time a part of one count's modules aims at (a process starts in ~15 s).
CHUNK_SECONDS = 480.0
_UNMEASURED_SECONDS = 20.0  # a module durations.json does not know yet


def _split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """The test files (or node ids) given, and the other pytest arguments, in order."""
    files = [a for a in argv if a.split("::")[0].endswith(".py")]
    return files, [a for a in argv if a not in files]


def _marks(path: str) -> set[int]:
    with open(path, encoding="utf-8") as f:
        return {int(n) for n in _MARK.findall(f.read())} or {DEFAULT_DEVICES}


def device_counts(argv: list[str]) -> list[int]:
    """The device counts the selected test modules ask for, most common first."""
    files = [a.split("::")[0] for a in _split_args(argv)[0]] or sorted(glob.glob(os.path.join(_HERE, "test_*.py")))
    counts: dict[int, int] = {}
    for path in files:
        for n in _marks(path):
            counts[n] = counts.get(n, 0) + 1
    return sorted(counts, key=lambda n: (-counts[n], n))


class Part:
    """One pytest process: a device count and the modules (or node ids) it runs."""

    def __init__(self, devices: int, files: list[str], seconds: float):
        self.devices, self.files, self.seconds = devices, files, seconds
        self.index, self.of = 1, 1

    @property
    def name(self) -> str:
        return f"devices{self.devices}" + (f".{self.index}" if self.of > 1 else "")

    @property
    def title(self) -> str:
        part = f", part {self.index} of {self.of}" if self.of > 1 else ""
        return f"pytest with {self.devices} simulated CPU device(s){part}"


def _read_durations(path: str) -> dict[str, dict[str, float]]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def plan(argv: list[str], durations: dict[str, dict[str, float]], chunk: float = CHUNK_SECONDS) -> list[Part]:
    """The parts to run, longest first: each count's modules cut into parts of about ``chunk``
    measured seconds (a module is never cut: its fixtures are shared by its tests)."""
    given = _split_args(argv)[0] or sorted(glob.glob(os.path.join(_HERE, "test_*.py")))
    by_count: dict[int, list[str]] = {}
    for arg in given:
        for n in _marks(arg.split("::")[0]):
            by_count.setdefault(n, []).append(arg)
    parts = []
    for n, files in by_count.items():
        measured = durations.get(str(n), {})

        def seconds(arg: str, measured=measured) -> float:
            return float(measured.get(os.path.basename(arg.split("::")[0]), _UNMEASURED_SECONDS))

        files.sort(key=seconds, reverse=True)
        bins = [Part(n, [], 0.0) for _ in range(max(1, round(sum(map(seconds, files)) / chunk)))]
        for arg in files:  # longest first, each to the lightest part
            lightest = min(bins, key=lambda b: b.seconds)
            lightest.files.append(arg)
            lightest.seconds += seconds(arg)
        for i, b in enumerate(bins, 1):
            b.index, b.of = i, len(bins)
            b.files.sort()
        parts += [b for b in bins if b.files]
    return sorted(parts, key=lambda b: -b.seconds)


def module_seconds(junit_path: str) -> dict[str, float]:
    """Each module's test time (setup, call and teardown) in a JUnit report."""
    try:
        root = ET.parse(junit_path).getroot()
    except (OSError, ET.ParseError):
        return {}
    seconds: dict[str, float] = {}
    for case in root.iter("testcase"):
        names = [c for c in case.get("classname", "").split(".") if c.startswith("test_")]
        if names:
            module = names[0] + ".py"
            seconds[module] = seconds.get(module, 0.0) + float(case.get("time", 0.0))
    return seconds


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


def dead_process_totals(title: str, progress_path: str, code: int) -> tuple[dict[str, int], str]:
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
    head = f"{title} ended without its results ({_exit_status(code)})"
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


def _command(part: Part, tmp: str, options: list[str]) -> tuple[list[str], dict]:
    env = dict(os.environ, KR_TEST_DEVICES=str(part.devices),
               KR_TEST_PROGRESS=os.path.join(tmp, f"{part.name}.progress"))
    junit = os.path.join(tmp, f"{part.name}.xml")
    return [sys.executable, "-m", "pytest", "-q", "-p", "tests.suite_progress", "--durations=15",
            f"--junitxml={junit}", *options, *part.files], env


def _run_side_by_side(parts: list[Part], tmp: str, options: list[str], jobs: int) -> dict[str, int]:
    """Runs the parts, `jobs` at a time, in order; prints each one's output whole when it ends
    (in sequence, with one job, as it comes)."""
    codes: dict[str, int] = {}
    waiting = list(parts)
    running: list[tuple[Part, subprocess.Popen, object]] = []
    while waiting or running:
        while waiting and len(running) < jobs:
            part = waiting.pop(0)
            cmd, env = _command(part, tmp, options)
            if jobs == 1:
                print(f"\n=== {part.title} ===", flush=True)
                codes[part.name] = subprocess.call(cmd, env=env)
                continue
            print(f"--- {part.title} started (about {part.seconds / 60:.0f} min of tests)", flush=True)
            log = tempfile.TemporaryFile(mode="w+", encoding="utf-8")
            running.append((part, subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        time.sleep(0.5)
        for item in list(running):
            part, proc, log = item
            if proc.poll() is None:
                continue
            running.remove(item)
            codes[part.name] = proc.returncode
            log.seek(0)
            print(f"\n=== {part.title} (side by side) ===", flush=True)
            sys.stdout.write(log.read())
            sys.stdout.flush()
            log.close()
    return codes


def record_durations(parts: list[Part], tmp: str, path: str) -> None:
    """Writes each count's module times from this run's reports into ``path`` (kept for the rest)."""
    durations = _read_durations(path)
    for part in parts:
        measured = module_seconds(os.path.join(tmp, f"{part.name}.xml"))
        durations.setdefault(str(part.devices), {}).update({m: round(t, 1) for m, t in measured.items()})
    with open(path, "w", encoding="utf-8") as f:
        json.dump({n: dict(sorted(d.items())) for n, d in sorted(durations.items())}, f, indent=1)
        f.write("\n")


def _busy_option(argv: list[str]) -> tuple[int, bool, list[str]]:
    """`--busy K` (or `--busy=K`) and `--record` taken out of the arguments; the rest go to pytest."""
    rest, busy, record, i = [], 0, False, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--busy" or arg.startswith("--busy="):
            value = arg.partition("=")[2] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in arg else 2
            if not value.isdigit():
                raise SystemExit(f"--busy takes a whole number of busy cores, got {value!r}")
            busy = int(value)
            continue
        if arg == "--record":
            record = True
        else:
            rest.append(arg)
        i += 1
    return busy, record, rest


def _jobs() -> int:
    jobs = os.environ.get("KR_TEST_JOBS", "2")
    if not jobs.isdigit() or int(jobs) < 1:
        raise SystemExit(f"KR_TEST_JOBS must be a whole number of at least 1, got {jobs!r}")
    return int(jobs)


def main(argv: list[str]) -> int:
    started = time.time()
    busy, record, argv = _busy_option(argv)
    jobs = _jobs()
    options = _split_args(argv)[1]
    parts = plan(argv, _read_durations(DURATIONS))
    grand = {"passed": 0, "failed": 0, "skipped": 0}
    worst = 0
    dead = []
    with busy_cores(busy), tempfile.TemporaryDirectory() as tmp:
        if busy:
            print(f"{busy} process(es) keep a core busy each while the tests run (--busy)", flush=True)
        codes = _run_side_by_side(parts, tmp, options, jobs)
        for part in parts:
            if codes[part.name] == 5:  # no test selected in this part
                continue
            totals = _junit_totals(os.path.join(tmp, f"{part.name}.xml"))
            if totals is None:
                totals, message = dead_process_totals(part.title, os.path.join(tmp, f"{part.name}.progress"),
                                                      codes[part.name])
                dead.append(message)
            for key in grand:
                grand[key] += totals[key]
            worst = worst or codes[part.name]
        if record:
            record_durations(parts, tmp, DURATIONS)
    minutes = (time.time() - started) / 60
    counts = sorted({p.devices for p in parts})
    print(f"\nwhole suite: {minutes:.1f} min in {len(parts)} processes, {jobs} at a time, "
          f"over device counts {tuple(counts)}")
    for message in dead:
        print(message)
    print(f"{grand['passed']} passed, {grand['failed']} failed, {grand['skipped']} skipped")
    if grand["passed"] == 0 and not dead:
        print("no test ran", file=sys.stderr)
        return 1
    return 1 if (worst or grand["failed"]) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
