"""The README's and the guides' examples run as written, in a fresh interpreter."""

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, python_blocks, run_markdown_example, run_python

pytestmark = pytest.mark.devices(1)  # each example sets up its own devices in a subprocess


def test_readme_gpu_quickstart_runs_without_simulated_devices():
    blocks = python_blocks("README.md")
    assert "kr.ReplicatorStrategy()" in blocks[0] and "model.fit" in blocks[0]
    assert "simulate_devices" not in blocks[0]  # all local GPUs; here, the one CPU device
    result = run_markdown_example("README.md", 0)
    assert "loss" in result.stdout


def test_readme_usage_example():
    blocks = python_blocks("README.md")
    assert "kr.simulate_devices(4)" in blocks[1] and "model.fit" in blocks[1]
    result = run_markdown_example("README.md", 1)
    assert "loss" in result.stdout


def test_primitives_guide_example():
    result = run_markdown_example("docs/primitives.md", 0)
    assert "3.0" in result.stdout and "7.0" in result.stdout


def test_readme_custom_loop_example():
    blocks = python_blocks("README.md")
    assert "strategy.run(replica_step" in blocks[2]
    result = run_markdown_example("README.md", 2)
    assert "last loss" in result.stdout


def test_index_ten_lines_run_as_shown():
    result = run_markdown_example("docs/index.md", 0, timeout=600)
    assert "loss" in result.stdout


def test_fault_tolerance_script_runs_alone_and_cleans_its_backup(tmp_path):
    block = python_blocks("docs/fault_tolerance.md")[0]
    assert "BackupAndRestore" in block
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("KR_TEST_DEVICES", None)
    result = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[0] == "loss"
    assert not (tmp_path / "train_backup").exists()  # a finished fit deletes its backup


def test_multi_worker_guide_fragments_run_alone():
    result = run_markdown_example("docs/fault_tolerance.md", 1)
    assert result.stdout.split()[-2:] == ["1", "True"]  # no cluster here: one machine
    run_markdown_example("docs/multi_worker.md", 1)


def test_keras_distribution_guide_runs_as_written():
    # Both blocks in one interpreter: the second (RematScope) then runs under the first's
    # DataParallel, which the guide says works too.
    blocks = python_blocks("docs/keras_distribution.md")
    result = run_python(blocks[0] + "\n" + blocks[1], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "remat loss" in result.stdout


def test_contributing_and_optimizer_pieces_snippets():
    run_markdown_example("docs/contributing.md", 0)
    result = run_markdown_example("docs/optimizers.md", 2)
    assert "[0.6 0.8]" in result.stdout and "False" in result.stdout


def test_memory_guide_example_shares_the_state_over_four_devices():
    result = run_markdown_example("docs/memory.md", 0)
    sizes = [int(line.split()[-1]) for line in result.stdout.splitlines() if "device:CPU:" in line]
    # AdamW's moments of 32 x 64 + 64 + 64 x 64 + 64 + 64 + 1 floats, a quarter each within one
    # variable, plus the iteration count and learning rate (12 bytes) on every device.
    total = 2 * 4 * (32 * 64 + 64 + 64 * 64 + 64 + 64 + 1)
    assert len(sizes) == 4 and sum(sizes) == total + 4 * 12
    assert max(sizes) - 12 <= total / 4 + 2 * 4 * 64 * 64


# Which test runs each ```python block of the README and the guides (as it is shown, in a
# fresh interpreter, checking what it prints); blocks not listed here are run above.
RUN_ELSEWHERE = {
    ("docs/async.md", 0): "tests/test_async.py",
    ("docs/batch_norm.md", 0): "tests/test_layers_one_device.py",
    ("docs/batch_norm.md", 1): "tests/test_layers_one_device.py",
    ("docs/callbacks.md", 0): "tests/test_callbacks.py",
    ("docs/callbacks.md", 1): "tests/test_callbacks.py",
    ("docs/callbacks.md", 2): "tests/test_callbacks.py",
    ("docs/input.md", 0): "tests/test_data_docs.py",
    ("docs/input.md", 1): "tests/test_data_docs.py",
    ("docs/kerashub.md", 0): "tests/test_kerashub.py",
    ("docs/kerashub.md", 1): "tests/test_kerashub.py",
    ("docs/kubernetes.md", 0): "tests/test_kubernetes.py",
    ("docs/model_parallel.md", 0): "tests/test_model_parallel_devices.py",
    ("docs/layouts.md", 0): "tests/test_model_parallel_layouts.py",
    ("docs/layouts.md", 1): "tests/test_model_parallel_fsdp.py",
    ("docs/multi_worker.md", 0): "tests/test_multi_worker.py",
    ("docs/optimizers.md", 0): "tests/test_optimizers.py",
    ("docs/optimizers.md", 1): "tests/test_optimizers.py",
    ("docs/ray.md", 0): "tests/test_ray_train.py",
    ("docs/ray.md", 1): "tests/test_ray_train.py",
}
RUN_HERE = {
    ("README.md", 0), ("README.md", 1), ("README.md", 2), ("docs/index.md", 0),
    ("docs/primitives.md", 0), ("docs/contributing.md", 0), ("docs/optimizers.md", 2),
    ("docs/fault_tolerance.md", 0), ("docs/fault_tolerance.md", 1), ("docs/multi_worker.md", 1),
    ("docs/sngan.md", 0), ("docs/memory.md", 0), ("docs/keras_distribution.md", 0),
    ("docs/keras_distribution.md", 1), ("docs/migrating.md", 0),
}


def test_migration_guide_example_takes_mirrored_strategys_arguments_by_position():
    block = python_blocks("docs/migrating.md")[0]
    assert 'kr.ReplicatorStrategy(["/cpu:0", "/cpu:1"], tf.distribute.ReductionToOneDevice())' in block
    result = run_markdown_example("docs/migrating.md", 0)
    assert "replicas: 2" in result.stdout
    assert "ReductionToOneDevice() is not a collective all-reduce" in result.stderr  # said, not silent


def test_sngan_guide_example():
    blocks = python_blocks("docs/sngan.md")
    assert "sngan.SNGAN(" in blocks[0] and "gan.compile(" in blocks[0]
    run_markdown_example("docs/sngan.md", 0)


def test_every_snippet_in_the_readme_and_the_guides_is_run_by_a_test():
    import glob

    pages = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
    missing = []
    for page in pages:
        for index in range(len(python_blocks(page))):
            key = (page, index)
            if key in RUN_HERE:
                continue
            runner = RUN_ELSEWHERE.get(key)
            if runner is None:
                missing.append(f"{page} block {index}")
                continue
            with open(os.path.join(ROOT, runner), encoding="utf-8") as f:
                assert page in f.read(), f"{runner} does not run {page}"
    assert not missing, "snippets no test runs: " + ", ".join(missing)


def test_demo_runs_and_reports_accuracy():
    env = dict(os.environ, DEMO_EPOCHS="3", TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("KR_TEST_DEVICES", None)
    result = subprocess.run([sys.executable, "examples/demo.py"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "examples/s" in result.stdout
    assert "test accuracy" in result.stdout and "replicas identical" in result.stdout
    # TensorFlow's no-GPU start-up lines (the cuInit error where a CUDA driver library exists).
    assert "absl::InitializeLog" not in result.stderr and "cuInit" not in result.stderr, result.stderr[:2000]
    assert "cuda drivers" not in result.stderr, result.stderr[:2000]
