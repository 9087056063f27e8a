"""Tutorial 3 (D4PG) runs top to bottom in smoke mode (tests/test_published_notebooks.py checks
that it ships without outputs)."""

import os
import time

import pytest

from tests import notebooks
from tests.helpers import RAY_OWNER_ENV, ROOT, wait_for_no_ray_servers

pytestmark = pytest.mark.devices(2)  # the notebook's kernel is its own process with 2 devices

NOTEBOOK = os.path.join(ROOT, "tutorials", "03_d4pg_control.ipynb")


def test_notebook_runs_in_smoke_mode(monkeypatch):
    owner = f"{os.getpid()}-{time.monotonic_ns()}"  # the kernel's Ray servers inherit it
    monkeypatch.setenv(RAY_OWNER_ENV, owner)
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
    assert "held-out evaluation of policy.keras (3 episodes): mean" in text
    assert "within [-2, 2]: True" in text
    assert len(notebooks.images(nb)) == 1
    # The kernel stopped its Ray: none of its servers is left (another job's may run meanwhile).
    assert not wait_for_no_ray_servers(owner)
