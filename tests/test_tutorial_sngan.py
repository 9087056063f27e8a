"""Tutorial 2 (SN-GAN) runs top to bottom in smoke mode (tests/test_published_notebooks.py
checks that it ships without outputs)."""

import os

import pytest

from tests import notebooks
from tests.helpers import ROOT

pytestmark = pytest.mark.devices(1)  # the notebook's kernel is its own process with 4 devices

NOTEBOOK = os.path.join(ROOT, "tutorials", "02_sngan_imagenet.ipynb")


def test_notebook_runs_in_smoke_mode(monkeypatch):
    monkeypatch.delenv("KR_TEST_DEVICES", raising=False)
    nb = notebooks.execute(NOTEBOOK, env={"PYTHONPATH": ROOT}, timeout=900)
    text = notebooks.stream_text(nb)
    assert "4 replicas" in text
    assert "mock ImageNet step: 4 x (10, 128, 128, 3)" in text
    assert "imagenet128: generator" in text
    assert "FID (classifier features)" in text and "class accuracy of samples" in text
    assert "before training: FID" in text and "after 60 updates: FID" in text
    assert len(notebooks.images(nb)) == 1  # the samples grid
