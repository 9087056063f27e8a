"""The README's and the guides' examples run as written, in a fresh interpreter."""

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, python_blocks, run_markdown_example

pytestmark = pytest.mark.devices(1)  # each example sets up its own devices in a subprocess


def test_readme_usage_example():
    blocks = python_blocks("README.md")
    assert "kr.ReplicatorStrategy()" in blocks[0] and "model.fit" in blocks[0]
    result = run_markdown_example("README.md", 0)
    assert "loss" in result.stdout


def test_primitives_guide_example():
    result = run_markdown_example("docs/primitives.md", 0)
    assert "3.0" in result.stdout and "7.0" in result.stdout


def test_index_example_is_the_readme_pattern():
    # The index page's snippet uses placeholders (x, y); check it at least compiles.
    compile(python_blocks("docs/index.md")[0], "index.md", "exec")


def test_demo_runs_and_reports_accuracy():
    env = dict(os.environ, DEMO_EPOCHS="3", TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("KR_TEST_DEVICES", None)
    result = subprocess.run([sys.executable, "examples/demo.py"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "examples/s" in result.stdout
    assert "test accuracy" in result.stdout and "replicas identical" in result.stdout
