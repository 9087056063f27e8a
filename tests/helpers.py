"""Shared test helpers (models, data and a subprocess runner)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time

import keras
import numpy as np
import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# tests/launched_job.py's data, known to tests/test_launch_training.py without importing
# the job (which makes a strategy when imported).
LAUNCHED_JOB_EXAMPLES, LAUNCHED_JOB_BATCH = 64, 16


def launch_env(**extra) -> dict[str, str]:
    """This process's environment for a job the launcher starts: none of this process's devices
    or cluster, unbuffered output, TensorFlow's INFO and WARNING logs off; plus ``extra``."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    for name in ("KR_TEST_DEVICES", "TF_CONFIG", "KERAS_REPLICATOR_DEVICES_PER_WORKER"):
        env.pop(name, None)
    return dict(env, **extra)


@contextlib.contextmanager
def json_from_fresh_interpreter(args: list[str], out, timeout: float):
    """Starts ``python *args`` at once (a fresh interpreter that writes JSON to ``out``).

    Yields a function that waits for it (asserting it exited 0) and returns what it wrote,
    read once; the process is killed if the block ends first. The one-device sides of the
    equivalence tests run this way, beside the test's own work.
    """
    process = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=launch_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    results: dict = {}

    def result() -> dict:
        if not results:
            output, _ = process.communicate(timeout=timeout)
            assert process.returncode == 0, output[-3000:]
            with open(out, encoding="utf-8") as f:
                results.update(json.load(f))
        return results

    try:
        yield result
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def regression_data(n=64, d=8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype("float32")
    y = (x @ rng.normal(size=(d, 1)) + 0.1).astype("float32")
    return x, y


def image_data(n=32, size=8, channels=3, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, size, size, channels)).astype("float32")
    y = rng.integers(0, classes, size=(n,)).astype("int32")
    return x, y


def dense_model(d=8, seed=1):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((d,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)]
    )


def conv_model(size=8, channels=3, classes=4, seed=1):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((size, size, channels))
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inputs)
    h = keras.layers.Conv2D(8, 3, strides=2, padding="same", activation="relu")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    outputs = keras.layers.Dense(classes)(h)
    return keras.Model(inputs, outputs)


def run_python(code: str, *, devices: int | None = None, timeout: int = 300, env=None):
    """Runs ``code`` in a fresh interpreter (own device configuration); returns the result."""
    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    full_env.pop("KR_TEST_DEVICES", None)
    prefix = f"import keras_replicator as kr\nkr.simulate_devices({devices})\n" if devices else ""
    return subprocess.run(
        [sys.executable, "-c", prefix + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=full_env,
    )


def python_blocks(markdown_path: str) -> list[str]:
    """The ```python code blocks of a Markdown file, in order."""
    import re

    with open(os.path.join(ROOT, markdown_path)) as f:
        text = f.read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def run_markdown_example(markdown_path: str, index: int = 0, timeout: int = 300):
    """Runs one code block of a docs page in a fresh interpreter; asserts it succeeds."""
    code = python_blocks(markdown_path)[index]
    result = run_python(code, timeout=timeout)
    assert result.returncode == 0, f"{markdown_path} block {index} failed:\n{result.stderr[-3000:]}"
    return result


# Per-replica randomness (tests/test_replica_randomness.py, tests/multi_worker_job.py).
MASK_SHAPE = (8, 256)


def dropout_masks(strategy=None, steps: int = 2, seed: int = 7) -> list[list[np.ndarray]]:
    """Per step, per local replica: the keep-mask of ``Dropout(0.5, seed=seed)`` on ones,
    drawn in a traced step (``strategy.run``, or plainly on one device without a strategy)."""
    import contextlib

    import tensorflow as tf

    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        layer = keras.layers.Dropout(0.5, seed=seed)
    ones = tf.ones(MASK_SHAPE)

    def draw():
        return layer(ones, training=True)

    if strategy is None:
        step = tf.function(draw)
        return [[np.asarray(step()) > 0] for _ in range(steps)]
    step = tf.function(lambda: strategy.run(draw))
    return [[np.asarray(v) > 0 for v in strategy.experimental_local_results(step())] for _ in range(steps)]


def assert_chance_agreement(a: np.ndarray, b: np.ndarray, what: str = "") -> None:
    """Independent keep-masks of rate 0.5 agree on a Binomial(size, 1/2) / size fraction of
    their elements: within 6 standard deviations of 1/2 (identical masks agree on all)."""
    agree = float(np.mean(a == b))
    assert abs(agree - 0.5) < 3.0 / np.sqrt(a.size), f"{what} masks agree on {agree:.3f} of their elements"


def committed_backup_metadata(backup_dir) -> dict:
    """The metadata of the backup a `BackupAndRestore` of keras_replicator's strategies
    committed last in ``backup_dir`` (`keras_replicator.backup_commits`'s layout)."""
    import json

    with open(os.path.join(backup_dir, "committed.json")) as f:
        folder = json.load(f)["backup"]
    with open(os.path.join(backup_dir, folder, "training_metadata.json")) as f:
        return json.load(f)


# --- Ray in tests -------------------------------------------------------------------------

# Set (to a value of the test's own) in the environment of the process that starts Ray: Ray's
# servers inherit it, which tells them from another job's Ray on the same machine.
RAY_OWNER_ENV = "KR_TEST_RAY_OWNER"


def own_ray_servers(owner: str) -> list[int]:
    """The Ray servers (raylet, gcs_server) alive whose environment has ``RAY_OWNER_ENV=owner``.

    Not "every Ray server that appeared meanwhile": another job's Ray, or another pytest process
    of the suite's, may start during the test (a shared machine)."""
    found = []
    for p in psutil.process_iter(["name"]):
        if p.info["name"] not in ("raylet", "gcs_server"):
            continue
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(RAY_OWNER_ENV) == owner:
                found.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def wait_for_no_ray_servers(owner: str, timeout: float = 30) -> list[int]:
    """Waits until none of ``owner``'s Ray servers is left (after `ray.shutdown`, they may take a
    moment to exit on a busy machine); returns those still alive at ``timeout``."""
    deadline = time.monotonic() + timeout
    while (left := own_ray_servers(owner)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left
