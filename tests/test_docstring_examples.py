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

NOT_RUN: dict[str, str] = {}


def collect() -> dict[str, tuple[str, list[str]]]:
    """`module:qualname` -> (module, its docstring's python blocks), for docstrings with an Example."""
    found: dict[str, tuple[str, list[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")

        def add(key: str, doc: str | None) -> None:
            if doc and "Example" in doc:
                blocks = [textwrap.dedent(b) for b in FENCE.findall(doc)]
                if blocks:
                    found[key] = (module, blocks)

        add(module, ast.get_docstring(tree))

        def visit(node, prefix: str) -> None:
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
    """The example `key`'s continues: its class's, else its module's (None for a module's)."""
    if ":" not in key:
        return None
    module, qualname = key.split(":")
    scopes = qualname.split(".")[:-1]
    for depth in range(len(scopes), 0, -1):
        candidate = f"{module}:{'.'.join(scopes[:depth])}"
        if candidate in EXAMPLES:
            return candidate
    return module if module in EXAMPLES else None


_LEFT: dict[str, dict] = {}  # the namespace each parent example left


def run_example(key: str, given: dict) -> dict:
    """Runs `key`'s blocks after its parent's; returns the namespace they leave."""
    import importlib

    module_name, blocks = EXAMPLES[key]
    up = parent(key)
    if up is not None:
        if up not in _LEFT:
            _LEFT[up] = run_example(up, given)
        namespace = dict(_LEFT[up])
    else:
        namespace = {**vars(importlib.import_module(module_name)), **given}
    namespace["__name__"] = f"example:{key}"
    for i, block in enumerate(blocks):
        exec(compile(block, f"<{key} example {i}>", "exec"), namespace)
    return namespace


@pytest.mark.parametrize("key", sorted(set(EXAMPLES) - set(NOT_RUN)))
def test_docstring_example_runs(key, given, monkeypatch, tmp_path_factory):
    import keras_replicator as kr

    devices = [f"/device:CPU:{i}" for i in range(2)]
    monkeypatch.setattr(kr, "simulate_devices", lambda n: devices)
    monkeypatch.setattr(kr.cluster, "simulate_devices", lambda n: devices)
    # Examples that write files write them in one folder of their own.
    monkeypatch.chdir(tmp_path_factory.mktemp("examples", numbered=False)
                      if not _LEFT else os.getcwd())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_example(key, given)
