"""Tutorial 2 (SN-GAN) runs top to bottom in smoke mode, and ships without outputs."""

import os

import pytest

from tests.helpers import ROOT
from tests.test_tutorial import _kernel

pytestmark = pytest.mark.devices(1)  # the notebook's kernel is its own process with 4 devices

NOTEBOOK = os.path.join(ROOT, "tutorials", "02_sngan_imagenet.ipynb")


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

    jupyter_path, kernel_name = _kernel(tmp_path, {
        "SMOKE": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
        "PYTHONPATH": ROOT,
    })
    monkeypatch.setenv("JUPYTER_PATH", jupyter_path)
    monkeypatch.delenv("KR_TEST_DEVICES", raising=False)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, kernel_name=kernel_name, timeout=900,
                            resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}})
    client.execute()
    text = "\n".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                     for out in cell.outputs if out.get("output_type") == "stream")
    assert "4 replicas" in text
    assert "mock ImageNet step: 4 x (10, 128, 128, 3)" in text
    assert "imagenet128: generator" in text
    assert "FID (classifier features)" in text and "class accuracy of samples" in text
    images = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
              if "image/png" in out.get("data", {})]
    assert len(images) == 1  # the samples grid
