"""Tutorial 1 (ResNet-50 on ImageNet) runs top to bottom in smoke mode (tests/test_published_notebooks.py
checks that it ships without outputs)."""

import os

import pytest

from tests import notebooks
from tests.helpers import ROOT

pytestmark = pytest.mark.devices(1)  # the notebook's kernel is its own process with 4 devices

NOTEBOOK = os.path.join(ROOT, "tutorials", "01_resnet50_imagenet.ipynb")


def test_notebook_runs_in_smoke_mode(monkeypatch):
    monkeypatch.delenv("KR_TEST_DEVICES", raising=False)
    nb = notebooks.execute(NOTEBOOK, timeout=600)
    text = notebooks.stream_text(nb)
    assert "ReplicatorStrategy(num_replicas=4" in text
    assert "global batch 8 = 2 x 4 replicas" in text
    for replica in range(4):
        assert f"replica {replica} on CPU:{replica}: images (2, 64, 64, 3) float32, labels (2, 1000)" in text
    assert "epoch   2" in text and "images/s" in text
    assert "updates; the optimizer's learning rate now" in text
    assert "validation: top-1" in text
    assert "every replica holds the same weights" in text
    for replica in range(4):  # the digits run, in smoke mode: 2 per replica, 16x16
        assert f"replica {replica} on CPU:{replica}: images (2, 16, 16, 1) float32, labels (2, 10)" in text
    assert len(notebooks.images(nb)) == 2  # the learning-rate schedule, the accuracy curve
