"""Tutorial 3 (D4PG) runs top to bottom in smoke mode (tests/test_published_notebooks.py checks
that it ships without outputs)."""

import os
import subprocess
import time

import pytest

from tests import notebooks
from tests.helpers import ROOT

pytestmark = pytest.mark.devices(2)  # the notebook's kernel is its own process with 2 devices

NOTEBOOK = os.path.join(ROOT, "tutorials", "03_d4pg_control.ipynb")


def _ray_processes():
    out = subprocess.run(["ps", "-eo", "pid=,comm="], capture_output=True, text=True).stdout
    return {int(line.split()[0]) for line in out.splitlines()
            if line.split()[1] in ("raylet", "gcs_server")}


def test_notebook_runs_in_smoke_mode(monkeypatch):
    before = _ray_processes()
    monkeypatch.delenv("KR_TEST_DEVICES", raising=False)
    nb = notebooks.execute(NOTEBOOK, env={"PYTHONPATH": ROOT}, timeout=600)
    text = notebooks.stream_text(nb)
    assert "ReplicatorStrategy(num_replicas=2" in text
    assert "smoke mode" in text
    diff = float(text.split("2 replicas vs 1 device: ")[1].split()[0])
    assert diff < 1e-5
    assert "every replica holds the same weights" in text
    assert "Ray node address: 127.0.0.1" in text
    assert "20 steps -> 16 five-step transitions" in text
    assert "evaluation returns: [" in text
    assert "within [-2, 2]: True" in text
    assert len(notebooks.images(nb)) == 1
    deadline = time.monotonic() + 20
    while _ray_processes() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _ray_processes() - before
