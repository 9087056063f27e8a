"""Tutorial 1 (ResNet-50 on ImageNet) runs top to bottom in smoke mode, and ships without outputs."""

import json
import os
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.devices(1)  # the notebook's kernel is its own process with 4 devices

NOTEBOOK = os.path.join(ROOT, "tutorials", "01_resnet50_imagenet.ipynb")


def _kernel(tmp_path, env):
    """A kernelspec for this interpreter (the project's venv), found through JUPYTER_PATH."""
    spec_dir = tmp_path / "jupyter" / "kernels" / "keras-replicator-test"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "keras_replicator tests",
        "language": "python",
        "env": env,
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return str(tmp_path / "jupyter"), "keras-replicator-test"


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

    jupyter_path, kernel_name = _kernel(
        tmp_path,
        {
            "SMOKE": "1",
            "TF_CPP_MIN_LOG_LEVEL": "2",
            # Figures as inline PNG outputs, whatever MPLBACKEND the test run has.
            "MPLBACKEND": "module://matplotlib_inline.backend_inline",
        },
    )
    monkeypatch.setenv("JUPYTER_PATH", jupyter_path)
    monkeypatch.delenv("KR_TEST_DEVICES", raising=False)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        nb,
        kernel_name=kernel_name,
        timeout=600,
        resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}},
    )
    client.execute()  # raises CellExecutionError, with the cell and traceback, if a cell fails

    text = "\n".join(
        out.get("text", "")
        for cell in nb.cells if cell.cell_type == "code"
        for out in cell.outputs if out.get("output_type") == "stream"
    )
    assert "ReplicatorStrategy(num_replicas=4" in text
    assert "global batch 8 = 2 x 4 replicas" in text
    for replica in range(4):
        assert f"replica {replica} on CPU:{replica}: images (2, 64, 64, 3) float32, labels (2, 1000)" in text
    assert "epoch   2" in text and "images/s" in text
    assert "updates; the optimizer's learning rate now" in text
    assert "validation: top-1" in text
    assert "every replica holds the same weights" in text
    images = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
              if "image/png" in out.get("data", {})]
    assert len(images) == 1  # the learning-rate schedule
