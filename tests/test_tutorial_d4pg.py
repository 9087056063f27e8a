"""Tutorial 3 (D4PG) runs top to bottom in smoke mode, and ships without outputs."""

import os
import subprocess
import time

import pytest

from tests.helpers import ROOT
from tests.test_tutorial import _kernel

pytestmark = pytest.mark.devices(2)  # the notebook's kernel is its own process with 2 devices

NOTEBOOK = os.path.join(ROOT, "tutorials", "03_d4pg_control.ipynb")


def _ray_processes():
    out = subprocess.run(["ps", "-eo", "pid=,comm="], capture_output=True, text=True).stdout
    return {int(line.split()[0]) for line in out.splitlines()
            if line.split()[1] in ("raylet", "gcs_server")}


def test_notebook_is_committed_without_outputs():
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:80]


def test_notebook_runs_in_smoke_mode(tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    before = _ray_processes()
    jupyter_path, kernel_name = _kernel(
        tmp_path,
        {
            "SMOKE": "1",
            "TF_CPP_MIN_LOG_LEVEL": "2",
            "PYTHONPATH": ROOT,
            "MPLBACKEND": "module://matplotlib_inline.backend_inline",
        },
    )
    monkeypatch.setenv("JUPYTER_PATH", jupyter_path)
    monkeypatch.delenv("KR_TEST_DEVICES", raising=False)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, kernel_name=kernel_name, timeout=600,
                            resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}})
    client.execute()

    text = "\n".join(
        out.get("text", "")
        for cell in nb.cells if cell.cell_type == "code"
        for out in cell.outputs if out.get("output_type") == "stream"
    )
    assert "ReplicatorStrategy(num_replicas=2" in text
    assert "smoke mode" in text
    diff = float(text.split("2 replicas vs 1 device: ")[1].split()[0])
    assert diff < 1e-5
    assert "every replica holds the same weights" in text
    assert "Ray node address: 127.0.0.1" in text
    assert "20 steps -> 16 five-step transitions" in text
    assert "evaluation returns: [" in text
    assert "within [-2, 2]: True" in text
    images = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
              if "image/png" in out.get("data", {})]
    assert len(images) == 1
    deadline = time.monotonic() + 20
    while _ray_processes() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _ray_processes() - before
