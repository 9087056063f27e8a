"""A pytest plugin (not a test module) that tests/run_suite.py loads into each pytest process.

It writes, to the file named by ``KR_TEST_PROGRESS``, one line per event as it happens
(flushed at once): ``collected N``, ``start NODEID``, ``failed NODEID`` or ``skipped NODEID``
(a phase's outcome), ``done NODEID``. A process killed mid-run (a signal, the memory killer, pytest-timeout's
``os._exit``) writes no JUnit report; this file still says how far it got, so that the
suite's summary can name the test it died in and count the tests that did not run.
"""

from __future__ import annotations

import os

_PATH = os.environ.get("KR_TEST_PROGRESS")


def _write(line: str) -> None:
    if _PATH:
        with open(_PATH, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def pytest_collection_finish(session) -> None:
    _write(f"collected {len(session.items)}")


def pytest_runtest_logstart(nodeid, location) -> None:
    _write(f"start {nodeid}")


def pytest_runtest_logreport(report) -> None:
    # A phase (setup, call, teardown) that failed or skipped is written as it happens; a test is
    # done after its teardown, the last phase. run_suite counts a done test with no such line
    # as passed.
    if report.failed or report.skipped:
        _write(f"{report.outcome} {report.nodeid}")
    if report.when == "teardown":
        _write(f"done {report.nodeid}")
