"""Every `Example:` in the package's docstrings runs, as Sonnet's doctest conformance test does.

Each docstring's ```python blocks run in order, in one namespace that starts as a copy of
the documented module's globals (as `doctest` does), and a method's or function's example
continues the example of its class, else of its module (a copy of the namespace that one
left), as a reader reads them; plus a few names the examples may take as given: `keras`, `np`, `tf`, `kr`, `strategy` (this process's ReplicatorStrategy),
`dataset` (64 unbatched `(x, y)` pairs, 4 features) and `model` (a compiled one-layer
model built under `strategy`). `kr.simulate_devices` is a no-op here: this process's
devices were fixed when it started (2 simulated CPU devices).

An example that cannot run here is listed in `NOT_RUN` with the reason (a cluster, a
download, minutes of training, a process that blocks); most of those run elsewhere in
the suite, as the reason says. A stale entry fails the test, so the list stays true.
"""

from __future__ import annotations

import ast
import os
import pathlib
import re
import textwrap
import warnings

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.devices(2)

PACKAGE = pathlib.Path(ROOT) / "keras_replicator"
FENCE = re.compile(r"```python\n(.*?)^[ \t]*```", re.S | re.M)

RAY = (
    "starts Ray: tests/test_d4pg_replicated.py runs actors on a local instance "
    "(test_actor_restarts_after_kill_and_training_data_goes_on)"
)
TRAIN = (
    "starts Ray and trains for minutes: tests/test_d4pg_replicated.py runs train "
    "(test_training_writes_outputs_and_resumes, test_pendulum_learns)"
)
IMAGENET = (
    "reads ImageNet, which TFDS cannot download (it is prepared by hand): "
    "tests/test_applications.py runs imagenet.input_fn through distribute_dataset on "
    "tfds.testing.mock_data"
)
ASYNC = (
    "needs a cluster of a chief, workers and parameter servers: tests/test_async.py runs this"
    " job (test_fit_evaluate_predict_and_save)"
)
SNGAN_RUN = (
    "trains the SN-GAN command's run (compiling the GAN step alone takes minutes on the suite's "
    "2 cores): tests/test_sngan_command.py runs it through the command line"
)
RAY_TRAIN = (
    "runs inside a Ray Train worker, or starts Ray: tests/test_ray_train.py runs these on a "
    "local instance on 127.0.0.1 (and the guide's program, docs/ray.md)"
)
NOT_RUN: dict[str, str] = {
    # keras_replicator/applications
    "keras_replicator.applications.d4pg.actors": RAY,
    "keras_replicator.applications.d4pg.actors:make_actors": RAY,
    "keras_replicator.applications.d4pg.actors:start_ray": RAY,
    "keras_replicator.applications.d4pg.training": TRAIN,
    "keras_replicator.applications.d4pg.feeder:Feeder": RAY,
    "keras_replicator.applications.d4pg.training:Evaluation": (
        "a callback of training.run, which needs the actors (Ray) and trains for minutes: "
        "tests/test_d4pg_replicated.py runs run (test_training_writes_outputs_and_resumes)"),
    "keras_replicator.applications.d4pg.training:run": TRAIN,
    "keras_replicator.applications.d4pg.training:train": TRAIN,
    "keras_replicator.applications.d4pg.learner": (
        "compiles the D4PG update for fit: 30 s to over 2 min on the suite's 2 loaded cores; "
        "tests/test_d4pg_replicated.py fits the learner on 1 and 2 replicas "
        "(test_two_replicas_equal_one_device)"),
    "keras_replicator.applications.imagenet": IMAGENET,
    "keras_replicator.applications.imagenet:input_fn": IMAGENET,
    "keras_replicator.applications.resnet.recipe": IMAGENET,
    "keras_replicator.applications.sngan.data:imagenet_dataset": (
        "reads ImageNet, which TFDS cannot download: tests/test_sngan.py runs imagenet_dataset "
        "on tfds.testing.mock_data (test_imagenet_through_mock_data)"),
    "keras_replicator.applications.sngan.data:imagenet_input_fn": (
        "reads ImageNet, which TFDS cannot download: tests/test_sngan.py runs it through "
        "imagenet_dataset on tfds.testing.mock_data (test_imagenet_through_mock_data)"),
    "keras_replicator.applications.sngan.metrics:inception_extractor": (
        "needs an InceptionV3 weights file the user downloads (nothing is downloaded at run "
        "time): tests/test_sngan_metrics.py loads a saved random InceptionV3 "
        "(test_inception_extractor_from_a_weights_file_at_small_size)"),
    "keras_replicator.applications.sngan.builder": SNGAN_RUN,
    "keras_replicator.applications.sngan.builder:Interval": SNGAN_RUN,
    "keras_replicator.applications.sngan.training:SNGAN": (
        "compiles the GAN step (5 discriminator and 1 generator update) for fit: 2-3 "
        "minutes on the suite's 2 loaded cores; tests/test_sngan.py fits SNGAN on digits on 1 "
        "and 2 replicas (test_n_replicas_match_one_device)"),
    "keras_replicator.applications.tfds_input": (
        "reads cifar10, which TFDS would download (nothing is downloaded at run time): "
        "tests/test_applications.py reads imagenet2012 through sharded_dataset on "
        "tfds.testing.mock_data"),
    # the asynchronous (parameter-server) strategy and the errors of a lost task
    "keras_replicator.async_strategy:AsyncDataset": ASYNC,
    "keras_replicator.async_strategy:AsyncReplicatorStrategy": ASYNC,
    "keras_replicator.async_strategy:AsyncReplicatorStrategy.distribute_dataset": ASYNC,
    "keras_replicator.errors:ParameterServerLostError": (
        "needs an asynchronous job that loses a parameter server: tests/test_async.py kills one "
        "and checks this error (test_a_killed_parameter_server_stops_the_job_clearly_and_a_"
        "restart_resumes)"),
    "keras_replicator.errors:WorkerLostError": (
        "needs a multi-worker job that loses a worker: tests/test_multi_worker.py kills one and "
        "checks this error (test_killed_worker_stops_the_job_and_a_restart_resumes_from_the_"
        "chiefs_backup)"),
    # the launcher starts processes and waits for other nodes
    "keras_replicator.launch.api:launch": (
        "starts a job of worker processes running the user's train.py: tests/test_launch.py "
        "launches scripts and modules (test_a_module_runs_as_with_python_dash_m)"),
    "keras_replicator.launch.tcp_rendezvous:rendezvous": (
        "waits for the launcher of another node at 10.0.0.1: tests/test_launch.py runs the "
        "rendezvous of two nodes on 127.0.0.1 (test_nnodes_find_each_other_through_the_master)"),
    # Ray Train: inside its workers
    "keras_replicator.ray_train:init_local": RAY_TRAIN,
    "keras_replicator.ray_train:ReportCheckpoint": RAY_TRAIN,
    "keras_replicator.ray_train:dataset_shard": RAY_TRAIN,
}


def collect() -> dict[str, tuple[str, list[str]]]:
    """`module:qualname` -> (module, its docstring's python blocks), for docstrings with an Example."""
    found: dict[str, tuple[str, list[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")

        def add(key: str, doc: str | None, module: str = module) -> None:
            if doc and "Example" in doc:
                blocks = [textwrap.dedent(b) for b in FENCE.findall(doc)]
                if blocks:
                    found[key] = (module, blocks)

        add(module, ast.get_docstring(tree))

        def visit(node: ast.AST, prefix: str, module: str = module) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    add(f"{module}:{prefix}{child.name}", ast.get_docstring(child))
                    visit(child, f"{prefix}{child.name}.")

        visit(tree, "")
    return found


EXAMPLES = collect()


def test_every_not_run_entry_names_an_existing_example_and_a_reason():
    stale = sorted(set(NOT_RUN) - set(EXAMPLES))
    assert not stale, f"NOT_RUN names examples that no longer exist: {stale}"
    assert all(len(reason) > 20 for reason in NOT_RUN.values())


def test_the_package_has_examples():
    assert len(EXAMPLES) > 100


@pytest.fixture(scope="module")
def given():
    """The names every example may take as given."""
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_replicator as kr

    strategy = kr.ReplicatorStrategy()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    return {"keras": keras, "np": np, "tf": tf, "kr": kr, "strategy": strategy,
            "dataset": tf.data.Dataset.from_tensor_slices((x, y)), "model": model}


def parent(key: str) -> str | None:
    """The example `key`'s continues: its class's, else its module's (None for a module's).

    An example in `NOT_RUN` is skipped over: its children continue the one above it,
    so they must not need its names.
    """
    if ":" not in key:
        return None
    module, qualname = key.split(":")
    scopes = qualname.split(".")[:-1]
    for depth in range(len(scopes), 0, -1):
        candidate = f"{module}:{'.'.join(scopes[:depth])}"
        if candidate in EXAMPLES and candidate not in NOT_RUN:
            return candidate
    return module if module in EXAMPLES and module not in NOT_RUN else None


_LEFT: dict[str, dict] = {}  # the namespace each parent example left


def run_example(key: str, given: dict) -> dict:
    """Runs `key`'s blocks after its parent's; returns the namespace they leave."""
    import importlib

    module_name, blocks = EXAMPLES[key]
    up = parent(key)
    if up is not None:
        if up not in _LEFT:
            _LEFT[up] = run_example(up, given)  # the parent's own test failed, or runs later
        namespace = dict(_LEFT[up])
    else:
        namespace = {**vars(importlib.import_module(module_name)), **given}
    namespace["__name__"] = f"example:{key}"
    for i, block in enumerate(blocks):
        exec(compile(block, f"<{key} example {i}>", "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The folder examples run in: the files they write stay out of the checkout."""
    return tmp_path_factory.mktemp("examples")


@pytest.mark.parametrize("key", sorted(set(EXAMPLES) - set(NOT_RUN)))
def test_docstring_example_runs(key, given, workdir, monkeypatch):
    import keras_replicator as kr

    devices = [f"/device:CPU:{i}" for i in range(2)]
    monkeypatch.setattr(kr, "simulate_devices", lambda n: devices)
    monkeypatch.setattr(kr.cluster, "simulate_devices", lambda n: devices)
    monkeypatch.chdir(workdir)
    environ = dict(os.environ)  # an example may set TF_CONFIG: the next one must not see it
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _LEFT[key] = run_example(key, given)
    finally:
        for name in set(os.environ) - set(environ):
            del os.environ[name]
        for name, value in environ.items():
            if os.environ.get(name) != value:
                os.environ[name] = value
