"""Ray Train glue for `ReplicatorStrategy`: checkpoints, Ray Data shards, Keras 3 on Ray.

Ray Train's `TensorflowTrainer` starts one process per worker and sets `TF_CONFIG` in each;
`kr.ReplicatorStrategy()` in `train_loop_per_worker` reads it like any other cluster. What
Ray and Keras need between them is here:

* `ReportCheckpoint`: a Keras callback that reports each epoch's metrics to Ray Train with
  the chief's checkpoint (weights, optimizer state, the epoch), and on a restart
  (`FailureConfig(max_failures=...)`) resumes `fit` from `ray.train.get_checkpoint()` at the
  next epoch. Also when Ray Train v2 restarts an elastic run
  (`ScalingConfig(num_workers=(min, max))`) with fewer or more workers: the checkpoint is the
  whole model's, which any number of replicas loads (the global batch is kept).
* `dataset_shard`: this worker's Ray Data shard (`ray.train.get_dataset_shard`) as the input
  of `fit`, not sharded a second time: every example of the Ray dataset is seen once per
  epoch over the job.
* `undo_legacy_keras`: Ray's TensorFlow backend sets `TF_USE_LEGACY_KERAS=1` in every
  worker, which turns `tf.keras` into Keras 2 (`tf_keras`, if installed) or into an
  `ImportError` (if not). `import keras` is not affected; `tf.keras` is, until this is called.
* `init_local`: a local Ray instance on 127.0.0.1 only (tests, a laptop).

Ray is imported when these are used, never by `import keras_replicator`; it comes with the
`ray` extra (`pip install ".[ray]"` from the root of your clone).

Example:
    ```python
    from keras_replicator import ray_train

    def train_loop(config):
        ray_train.undo_legacy_keras()          # first: Ray set TF_USE_LEGACY_KERAS=1
        import keras, keras_replicator as kr
        strategy = kr.ReplicatorStrategy()     # the cluster comes from Ray's TF_CONFIG
        with strategy.scope():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
            model.compile("sgd", "mse")
        train = ray_train.dataset_shard(strategy, "train", feature_columns="x",
                                        label_columns="y", global_batch_size=32)
        model.fit(train, epochs=3, callbacks=[ray_train.ReportCheckpoint()])
    ```
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import tempfile
import warnings
from typing import Any

import keras
import tensorflow as tf

from keras_replicator import saving
from keras_replicator._compat import keras_checkpointing, keras_initial_epoch
from keras_replicator._validation import ArgumentError, check_bool, check_int

__all__ = [
    "INSTALL_HINT",
    "LOOPBACK_ENV",
    "ReportCheckpoint",
    "WEIGHTS_FILE",
    "dataset_shard",
    "init_local",
    "undo_legacy_keras",
]

INSTALL_HINT = 'pip install "ray[train]==2.60.0" (the ray extra: pip install ".[ray]" in your clone)'
"""What installs Ray Train (`ray[train]`, with pandas and pyarrow) for this module."""

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""Set before Ray starts (driver and `runtime_env`): Ray 2.60 then registers 127.0.0.1 only."""

WEIGHTS_FILE = "model.weights.h5"
"""The file of a `ReportCheckpoint` checkpoint holding the weights and the optimizer's state."""
STATE_FILE = "keras_replicator_state.json"


def _require(module: str):
    """Imports `module` or raises an `ImportError` saying which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"keras_replicator.ray_train needs {module!r}, which cannot be imported ({e}). "
            f"Install Ray Train: {INSTALL_HINT}"
        ) from e


def undo_legacy_keras() -> bool:
    """Removes the `TF_USE_LEGACY_KERAS=1` that Ray's TensorFlow backend sets on every worker.

    With it, `tf.keras` is Keras 2 (`tf_keras`) when that package is installed, whose layers a
    Keras 3 model rejects, and raises `ImportError` ("Keras cannot be imported") when it is not;
    `import keras` and `ReplicatorStrategy` are not affected. Call it first in
    `train_loop_per_worker`: `tf.keras` is resolved on first use, and `from tensorflow.keras
    import ...` when TensorFlow is imported. Returns True if the variable was set.

    Example:
        ```python
        def train_loop(config):
            ray_train.undo_legacy_keras()
            import tensorflow as tf
            assert tf.keras.layers.Dense is keras.layers.Dense
        ```
    """
    was_set = os.environ.pop("TF_USE_LEGACY_KERAS", None) is not None
    if was_set and "tf_keras" in sys.modules:
        warnings.warn(
            "TF_USE_LEGACY_KERAS was set and tf_keras (Keras 2) is already imported: tf.keras "
            "may already be Keras 2 in this process. Call undo_legacy_keras() first in "
            "train_loop_per_worker, before any use of tf.keras.",
            RuntimeWarning,
            stacklevel=2,
        )
    return was_set


def init_local(num_cpus: int | None = None, **kwargs: Any):
    """Starts a local Ray instance whose every socket is on 127.0.0.1; returns the `ray` module.

    `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` is set in this process before Ray is imported and in
    the `runtime_env` of every Ray worker, so that Ray 2.60 listens on 127.0.0.1 and registers
    the node there, not on the machine's network address; the node's address is checked. The
    instance is a new one even if `RAY_ADDRESS` or `/tmp/ray/ray_current_cluster` names a
    running cluster, which `ray.init()` would join (another program's, on a shared machine).
    Ray reads the variable when it is imported: call this before `import ray` (a `RuntimeError`
    says so, before anything starts, if Ray was imported without it). Stop it with
    `ray.shutdown()`. `kwargs` go to `ray.init` (not `address` or `runtime_env`).

    Example:
        ```python
        ray = ray_train.init_local(num_cpus=2)
        assert ray.util.get_node_ip_address() == "127.0.0.1"
        ray.shutdown()
        ```
    """
    check_int("num_cpus", num_cpus, minimum=1, optional=True)
    for name in ("address", "runtime_env"):
        if name in kwargs:
            raise ArgumentError(f"init_local starts its own local instance; {name}= is not accepted.")
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None and getattr(constants, "ENABLE_RAY_CLUSTER", False):
        raise RuntimeError(
            "Ray was imported before init_local() without RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, "
            "and Ray reads it when imported: it would listen on every interface and register the "
            "machine's network address. Call init_local() before importing ray, or set "
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 in the environment before Python starts."
        )
    os.environ.update(LOOPBACK_ENV)
    ray = _require("ray")
    _require("ray.train")
    kwargs = {"include_dashboard": False, "log_to_driver": False, **kwargs}
    ray.init(address="local", num_cpus=num_cpus, runtime_env={"env_vars": dict(LOOPBACK_ENV)}, **kwargs)
    address = ray.util.get_node_ip_address()
    if address != "127.0.0.1":
        ray.shutdown()
        raise RuntimeError(f"Ray registered its node on {address}, not 127.0.0.1.")
    return ray


class ReportCheckpoint(keras.callbacks.Callback):
    """Reports each epoch to Ray Train with the chief's checkpoint, and resumes from it.

    At the end of every epoch each worker calls `ray.train.report` (Ray wants every worker
    to, the same number of times) with the epoch's logs and `"epoch"`; every
    `checkpoint_every` epochs the chief adds a checkpoint directory holding the model's
    weights with the optimizer's state (`model.weights.h5`) and the epoch. Every worker
    saves (reading some variables runs a collective), only the chief's files are kept.

    When Ray Train restarts the workers after a failure (`FailureConfig(max_failures=n)`),
    `on_train_begin` loads `ray.train.get_checkpoint()` into the model on every worker and
    `fit` starts at the epoch after the checkpoint's. With `keras.callbacks.BackupAndRestore`
    in the same `fit`, put it before this callback: this one then restores only when Ray's
    checkpoint is newer than what `BackupAndRestore` restored.

    Example:
        ```python
        model.fit(train, epochs=10, callbacks=[ray_train.ReportCheckpoint()])
        # Ray's result.checkpoint then holds model.weights.h5 of the last epoch
        ```

    Args:
        checkpoint_every: epochs between checkpoints (0: metrics only).
        restore: whether to resume from `ray.train.get_checkpoint()` when there is one.

    Attributes:
        restored_epoch: the epoch `fit` resumed at from Ray's checkpoint, or `None`.
    """

    def __init__(self, checkpoint_every: int = 1, restore: bool = True):
        super().__init__()
        self.checkpoint_every = check_int("checkpoint_every", checkpoint_every, minimum=0)
        self.restore = check_bool("restore", restore)
        self.restored_epoch: int | None = None
        self.fit_iterator = None  # the running fit's epoch iterator (weakly): its data position is saved
        self._train = _require("ray.train")
        undo_legacy_keras()

    def on_train_begin(self, logs=None):
        self.fit_iterator = keras_checkpointing.fit_iterator()
        checkpoint = self._train.get_checkpoint() if self.restore else None
        if checkpoint is None:
            return
        with checkpoint.as_directory() as directory:
            with open(os.path.join(directory, STATE_FILE), encoding="utf-8") as f:
                state = json.load(f)
            next_epoch = int(state["epoch"]) + 1
            already = keras_initial_epoch.initial_epoch(self.model)
            if already is not None and already >= next_epoch:
                return  # an earlier callback (BackupAndRestore) restored a state at least as new
            optimizer = getattr(self.model, "optimizer", None)
            if optimizer is not None and not optimizer.built:
                # Without a strategy Keras builds the optimizer at the first step, after this
                # callback; load_weights would then skip the saved optimizer state.
                with self.model.distribute_strategy.scope():
                    optimizer.build(self.model.trainable_variables)
            self.model.load_weights(os.path.join(directory, WEIGHTS_FILE))
        keras_initial_epoch.set_initial_epoch(self.model, next_epoch)
        # The data position of an uninterrupted run (with steps_per_epoch, the epochs before are
        # replayed; reshuffling pipelines at the epoch's order, keras_replicator.resume), after
        # checking the shape, and no mid-epoch skip left pending by an older BackupAndRestore backup.
        keras_checkpointing.resume_fit(self.model.distribute_strategy, next_epoch, 0, state.get(keras_checkpointing.DATA_KEY))
        self.restored_epoch = next_epoch

    def on_epoch_end(self, epoch, logs=None):
        metrics = {k: float(v) for k, v in (logs or {}).items() if _is_number(v)}
        metrics["epoch"] = int(epoch)
        if not (self.checkpoint_every and (epoch + 1) % self.checkpoint_every == 0):
            self._train.report(metrics)
            return
        directory = tempfile.mkdtemp(prefix="keras_replicator_ray_checkpoint_")
        try:
            is_chief = saving.save_model(self.model, os.path.join(directory, WEIGHTS_FILE))
            checkpoint = None
            if is_chief:
                with open(os.path.join(directory, STATE_FILE), "w", encoding="utf-8") as f:
                    json.dump({"epoch": int(epoch), keras_checkpointing.DATA_KEY: keras_checkpointing.data_state(
                        self.model.distribute_strategy, False, self.fit_iterator)}, f)
                checkpoint = self._train.Checkpoint.from_directory(directory)
            self._train.report(metrics, checkpoint=checkpoint)
        finally:
            shutil.rmtree(directory, ignore_errors=True)


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def dataset_shard(
    strategy: tf.distribute.Strategy,
    name: str,
    *,
    feature_columns: str | list[str],
    label_columns: str | list[str],
    global_batch_size: int,
    drop_remainder: bool = False,
    **to_tf_kwargs: Any,
) -> tf.distribute.DistributedDataset:
    """This worker's Ray Data shard as `fit`'s input under `strategy`, not sharded again.

    Ray Train splits each dataset given to the trainer into one shard per worker
    (`ray.train.get_dataset_shard(name)`); this reads it with `to_tf` in batches of
    `global_batch_size / num_workers` and distributes it over this worker's replicas with
    `shard_policy="off"` (the shard is already this worker's part). So each step takes
    `global_batch_size` examples over the job, and over an epoch every example of the Ray
    dataset goes to exactly one replica. Ray splits with `equal=True`: every worker gets as
    many rows (up to `num_workers - 1` rows may be left out), so every worker runs as many steps.

    Example:
        ```python
        train = ray_train.dataset_shard(strategy, "train", feature_columns="x",
                                        label_columns="y", global_batch_size=64)
        model.fit(train, epochs=3)
        ```

    Args:
        strategy: the `ReplicatorStrategy` of this worker (its cluster is Ray's workers).
        name: the dataset's key in the trainer's `datasets=`.
        feature_columns: the model's input column(s), as for `DataIterator.to_tf`.
        label_columns: the target column(s), as for `DataIterator.to_tf`.
        global_batch_size: examples per step over all replicas of all workers.
        drop_remainder: drop a last batch smaller than the others.
        **to_tf_kwargs: more arguments of `to_tf` (e.g. `local_shuffle_buffer_size`).

    Returns:
        A `tf.distribute.DistributedDataset` for `model.fit`.
    """
    if not hasattr(strategy, "distribute_dataset") or not hasattr(strategy, "num_workers"):
        raise ArgumentError(f"strategy must be a kr.ReplicatorStrategy, got {strategy!r}.")
    if not isinstance(name, str) or not name:
        raise ArgumentError(f"name must be the dataset's name in the trainer's datasets=, got {name!r}.")
    global_batch_size = check_int("global_batch_size", global_batch_size, minimum=1)
    check_bool("drop_remainder", drop_remainder)
    workers = int(strategy.num_workers)
    replicas = int(strategy.num_replicas_in_sync)
    if global_batch_size % replicas:
        raise ArgumentError(
            f"global_batch_size={global_batch_size} is not divisible by the {replicas} replicas "
            f"of the job ({workers} worker(s))."
        )
    for key in ("batch_size", "drop_last"):
        if key in to_tf_kwargs:
            raise ArgumentError(f"{key}= is set by dataset_shard; give global_batch_size/drop_remainder.")
    undo_legacy_keras()
    train = _require("ray.train")
    shard = train.get_dataset_shard(name)
    if shard is None:
        raise ArgumentError(f"Ray Train has no dataset {name!r} for this worker: pass datasets={{{name!r}: ...}}.")
    dataset = shard.to_tf(
        feature_columns, label_columns, batch_size=global_batch_size // workers,
        drop_last=drop_remainder, **to_tf_kwargs,
    )
    return strategy.distribute_dataset(
        dataset, global_batch_size=global_batch_size, shard_policy="off", batched=True,
        drop_remainder=drop_remainder,
    )
