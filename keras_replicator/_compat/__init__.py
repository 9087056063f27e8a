"""Every use of private TensorFlow and Keras APIs in keras_replicator, one module per thing.

Nothing outside this package imports `tensorflow.python`, `keras.src` or reads a
private attribute of a TensorFlow or Keras object. A TensorFlow or Keras upgrade
is checked here: `tests/test_structure.py` fails, naming the module, when an
installed version is outside the range a module was checked on.

| module | what it touches | how | checked on |
|---|---|---|---|
| `collective_launcher` | `CollectiveReplicaLauncher` in `CollectiveAllReduce` | subclass swapped in per ops object | TF 2.16-2.21 |
| `coordination` | the runtime context, the coordination service, peer health | private `Context` methods | TF 2.16-2.21 |
| `engines` | `MirroredExtended`, `CollectiveAllReduceExtended` | subclasses overriding private methods | TF 2.16-2.21 |
| `distributed_values` | `PerReplica`, `Mirrored`, destination devices | constructors | TF 2.16-2.21 |
| `all_reduce_gradient` | `ReplicaContext.all_reduce` | scoped patch (strategy scope) | TF 2.16-2.21 |
| `multi_device_iterator` | per-replica input iterators (`_create_device_dataset`, `OwnedMultiDeviceIterator`, distributed datasets' `__iter__`) | permanent patch, ours only: no autotuning thread to join (issue 21) | TF 2.21 |
| `tf_data` | tf.data's Python dataset objects, `_AutoShardDataset` | reads attributes | TF 2.16-2.21 |
| `keras_trainer` | Keras's TensorFlow trainer and epoch iterator | permanent patch, ours only | Keras 3.15 |
| `keras_checkpointing` | `ModelCheckpoint`, `BackupAndRestore` | permanent patch, multi-worker only | Keras 3.15 |
| `keras_batch_norm` | `BatchNormalization.add_weight` | scoped patch (strategy scope) | Keras 3.15 |
| `parameter_server` | Keras's trainer loop through a `ClusterCoordinator`, Keras variables' updates, sharded reads | implementations the trainer wrapper calls; scoped and permanent patches | TF 2.21, Keras 3.15 |
| `tf_logging` | where TensorFlow's distribution modules log from (their path) | a filter on TensorFlow's public logger: their INFO lines hidden until the user raises the verbosity | TF 2.16-2.21 |
| `keras_optimizer` | `TFOptimizer._all_reduce_sum_gradients`, `LossScaleOptimizer.__init__` | per-instance override; permanent check | Keras 3.15 |

Scoped patches are applied while any keras_replicator strategy's `scope()` is
entered (`strategy.run` enters it too) and undone when the outermost exits, as
Sonnet's `replicator.py` scopes its patches. The permanent ones patch entry
points that Keras calls outside any strategy scope (`fit`, callbacks); they act
only for keras_replicator's strategies and leave others to Keras's behaviour.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from collections.abc import Iterator

# The versions each module was checked on, inclusive: (package, lowest, highest).
CHECKED: dict[str, tuple[str, str, str]] = {
    "collective_launcher": ("tensorflow", "2.16", "2.21"),
    "coordination": ("tensorflow", "2.16", "2.21"),
    "engines": ("tensorflow", "2.16", "2.21"),
    "distributed_values": ("tensorflow", "2.16", "2.21"),
    "all_reduce_gradient": ("tensorflow", "2.16", "2.21"),
    "multi_device_iterator": ("tensorflow", "2.21", "2.21"),
    "tf_data": ("tensorflow", "2.16", "2.21"),
    "keras_trainer": ("keras", "3.15", "3.15"),
    "keras_checkpointing": ("keras", "3.15", "3.15"),
    "keras_batch_norm": ("keras", "3.15", "3.15"),
    "keras_optimizer": ("keras", "3.15", "3.15"),
    "parameter_server": ("keras", "3.15", "3.15"),
    "tf_logging": ("tensorflow", "2.16", "2.21"),
}


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _installed(package: str) -> str:
    for name in (package, f"{package}-cpu"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    module = importlib.import_module(package)
    return module.__version__


def unchecked_versions() -> list[str]:
    """One line per module whose checked range excludes the installed version."""
    problems = []
    for module, (package, low, high) in CHECKED.items():
        version = _installed(package)
        if not _minor(low) <= _minor(version) <= _minor(high):
            problems.append(
                f"keras_replicator._compat.{module} was checked on {package} {low}-{high}, "
                f"but {package} {version} is installed: re-check what it patches (its docstring "
                "says what and why), run the suite, then widen its range in _compat.CHECKED."
            )
    return problems


def install() -> None:
    """Installs the permanent patches (idempotent); see the table above."""
    from keras_replicator._compat import keras_checkpointing, keras_trainer, multi_device_iterator

    keras_trainer.install()
    keras_checkpointing.install()
    # Per-replica input iterators without tf.data autotuning threads, whose join stalled
    # every new epoch by up to 20 s (issue 21).
    multi_device_iterator.install()


@contextlib.contextmanager
def strategy_scope_patches() -> Iterator[None]:
    """The scoped patches, applied for the outermost of nested strategy scopes."""
    from keras_replicator._compat import all_reduce_gradient, keras_batch_norm, patching

    with patching.applied([all_reduce_gradient.PATCH, keras_batch_norm.PATCH]):
        yield
