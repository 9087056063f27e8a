"""The `train_loop_per_worker` functions tests/test_ray_train.py gives Ray Train's `TensorflowTrainer`.

Imported by reference in Ray's worker processes (they inherit the test's PYTHONPATH). Each loop
writes what its worker saw to ``config["out"]/attempt{a}.worker{rank}.json``, where the attempt
is 0 for the first start and 1 after Ray Train restarted the workers from a checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

_STRATEGY = []


def _strategy():
    """This worker's ReplicatorStrategy, made once per process (both loops of a run share it)."""
    import keras_replicator as kr

    if not _STRATEGY:
        kr.simulate_devices(1)
        _STRATEGY.append(kr.ReplicatorStrategy(failure_timeout=10))
    return _STRATEGY[0]


def _report(config: dict, rank: int, attempt: int, **fields) -> None:
    path = os.path.join(config["out"], f"attempt{attempt}.worker{rank}.json")
    with open(path, "w") as f:
        json.dump(fields, f)


def _wait_until_registered(epoch: int, limit_s: float = 600.0) -> None:
    """Wait until Ray Train's controller has registered the checkpoint this worker reported for `epoch`.

    A report is registered when the controller writes it into its checkpoint manager's snapshot
    (``checkpoint_manager_snapshot.json`` in the run's storage; Ray 2.60, Train v2): that is what a
    restarted group's `ray.train.get_checkpoint` reads. Waiting for it, not for a fixed time, makes
    the epoch a restart resumes at exact on a busy machine. `limit_s` is a limit for a hang.
    """
    import ray.train

    path = ray.train.get_context().get_storage().checkpoint_manager_snapshot_path
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                latest = json.load(f).get("latest_checkpoint_result") or {}
        except (OSError, ValueError):  # not written yet, or being written
            latest = {}
        if latest.get("metrics", {}).get("epoch", -1) >= epoch:
            return
        time.sleep(0.2)
    raise TimeoutError(f"Ray Train did not register the report of epoch {epoch} within {limit_s:.0f} s")


def regression_loop(config: dict) -> None:
    """tests/launched_job.py's job (data, model, optimizer, batch), with `ReportCheckpoint`.

    With ``config["kill_at_epoch"]``, worker 1 of the first attempt SIGKILLs itself at the
    beginning of that epoch (after the chief's checkpoint of the epoch before was reported).
    Each worker's report is written at every epoch's end too (``"finished": False``, no
    weights), so that an attempt Ray stops leaves what it did.
    """
    from keras_replicator import ray_train

    legacy = os.environ.get("TF_USE_LEGACY_KERAS")
    ray_train.undo_legacy_keras()
    import keras
    import ray.train
    import tensorflow as tf

    from tests.helpers import (
        LAUNCHED_JOB_BATCH,
        LAUNCHED_JOB_EXAMPLES,
        dense_model,
        regression_data,
    )

    strategy = _strategy()
    rank = ray.train.get_context().get_world_rank()
    attempt = 0 if ray.train.get_checkpoint() is None else 1
    x, y = regression_data(LAUNCHED_JOB_EXAMPLES)
    with strategy.scope():
        model = dense_model()
        model.compile(keras.optimizers.SGD(0.05), "mse")
    epochs_run: list[int] = []
    kill_at = config.get("kill_at_epoch")
    report = ray_train.ReportCheckpoint()

    def write(**fields) -> None:
        _report(
            config, rank, attempt,
            worker_index=strategy.worker_index, num_workers=strategy.num_workers,
            tf_config=json.loads(os.environ["TF_CONFIG"]), legacy_keras_env=legacy,
            tf_keras_is_keras=tf.keras.layers.Dense is keras.layers.Dense,
            restored_epoch=report.restored_epoch, epochs_run=epochs_run, **fields,
        )

    class Record(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if attempt == 0 and rank == 1 and epoch == kill_at:
                _wait_until_registered(epoch - 1)
                os.kill(os.getpid(), signal.SIGKILL)
            epochs_run.append(epoch)

        def on_epoch_end(self, epoch, logs=None):
            write(finished=False)

    model.fit(x, y, batch_size=LAUNCHED_JOB_BATCH, epochs=config["epochs"], shuffle=False,
              verbose=0, callbacks=[report, Record()])
    write(finished=True, weights=[w.tolist() for w in model.get_weights()])


def regression_and_ray_data_loop(config: dict) -> None:
    """`regression_loop`, then `ray_data_loop` in the same workers (one start of TensorFlow).

    A restart (``config["kill_at_epoch"]``) runs it all from the top again. Then tries `AsyncReplicatorStrategy` on Ray's `TF_CONFIG` and records its error.
    """
    regression_loop(config)
    ray_data_loop(config)
    import ray.train

    import keras_replicator as kr

    try:
        kr.AsyncReplicatorStrategy()
        error = None
    except kr.ClusterConfigError as e:
        error = str(e)
    rank = ray.train.get_context().get_world_rank()
    with open(os.path.join(config["out"], f"async.worker{rank}.json"), "w") as f:
        json.dump({"error": error}, f)


def ray_data_loop(config: dict) -> None:
    """`fit` on this worker's Ray Data shard; records the example ids each step fed to the model."""
    from keras_replicator import ray_train

    ray_train.undo_legacy_keras()
    import keras
    import numpy as np
    import ray.train
    import tensorflow as tf

    strategy = _strategy()
    rank = ray.train.get_context().get_world_rank()
    seen: list[list[int]] = []

    class RecordIds(keras.layers.Layer):
        def call(self, inputs, training=None):
            def record(ids):
                seen[-1].extend(int(i) for i in np.asarray(ids).ravel())
                return ids

            if training:
                inputs = tf.numpy_function(record, [inputs], inputs.dtype, stateful=True)
                inputs.set_shape((None, 1))
            return inputs

    class Epochs(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            seen.append([])

    train = ray_train.dataset_shard(strategy, "train", feature_columns="x", label_columns="y",
                                    global_batch_size=config["global_batch"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,)), RecordIds(), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.01), "mse")
    history = model.fit(train, epochs=config["data_epochs"], verbose=0, callbacks=[Epochs()])
    with open(os.path.join(config["out"], f"ray_data.worker{rank}.json"), "w") as f:
        json.dump({"ids_per_epoch": seen, "loss": history.history["loss"]}, f)


def _touch(path: str) -> None:
    with open(path, "w") as f:
        f.write(repr(time.time()))


def elastic_loop(config: dict) -> None:
    """`regression_loop`'s job on an elastic worker group (``ScalingConfig(num_workers=(1, 2))``).

    Run by `elastic_run`. The first group has 2 workers, one on each Ray node. At the beginning of
    ``config["shrink_at"]``, the worker that is not on the head node writes ``remove_my_node`` and
    waits: the driver removes its node, and Ray goes on with 1 worker from the last checkpoint.
    With ``config["grow_at"]``, that 1-worker group writes ``add_a_node`` at the end of that
    epoch and waits: the driver adds a node back, and Ray resizes the group to 2 workers. Each
    group's workers write ``elastic.of{workers}.from{restored epoch}.worker{rank}.json``.
    """
    from keras_replicator import ray_train

    ray_train.undo_legacy_keras()
    import keras
    import ray
    import ray.train

    from tests.helpers import (
        LAUNCHED_JOB_BATCH,
        LAUNCHED_JOB_EXAMPLES,
        dense_model,
        regression_data,
    )

    strategy = _strategy()
    context = ray.train.get_context()
    rank, workers = context.get_world_rank(), context.get_world_size()
    on_head = ray.get_runtime_context().get_node_id() == config["head_node"]
    out = config["out"]
    x, y = regression_data(LAUNCHED_JOB_EXAMPLES)
    with strategy.scope():
        model = dense_model()
        model.compile(keras.optimizers.SGD(0.05), "mse")
    report = ray_train.ReportCheckpoint()
    epochs_done: list[int] = []
    first_step_at: list[float] = []

    def write() -> None:  # at every epoch's end: a group that Ray stops leaves what it did
        name = f"elastic.of{workers}.from{report.restored_epoch}.worker{rank}.json"
        with open(os.path.join(out, name), "w") as f:
            json.dump({"num_workers": strategy.num_workers, "num_replicas": strategy.num_replicas_in_sync,
                       "tf_config": json.loads(os.environ["TF_CONFIG"]), "on_head": on_head,
                       "restored_epoch": report.restored_epoch, "epochs_done": epochs_done,
                       "first_step_at": first_step_at[0], "weights": [w.tolist() for w in model.get_weights()]}, f)

    class Record(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if (workers == 2 and report.restored_epoch is None and epoch == config["shrink_at"]
                    and not on_head):
                _wait_until_registered(epoch - 1)
                _touch(os.path.join(out, "remove_my_node"))
                time.sleep(600)  # the driver removes this node, and this process with it

        def on_train_batch_end(self, batch, logs=None):
            if not first_step_at:
                first_step_at.append(time.time())

        def on_epoch_end(self, epoch, logs=None):
            epochs_done.append(epoch)
            write()
            if workers == 1 and epoch == config.get("grow_at"):
                _wait_until_registered(epoch)  # ReportCheckpoint, the callback before this one, reported it
                _touch(os.path.join(out, "add_a_node"))
                deadline = time.monotonic() + config["grow_wait"]
                while time.monotonic() < deadline:  # Ray resizes the group: this process ends
                    time.sleep(1)

    model.fit(x, y, batch_size=LAUNCHED_JOB_BATCH, epochs=config["epochs"], shuffle=False,
              verbose=0, callbacks=[report, Record()])


def elastic_run(out: str, epochs: int, shrink_at: int, grow_at: int | None, monitor_s: float) -> None:
    """The driver of `elastic_loop`: a 2-node Ray cluster on 127.0.0.1 whose nodes it removes and adds.

    Run in its own interpreter (Ray's driver state is per process), with
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` in its environment. Each node has one CPU, each
    worker takes one: a node removed is a worker's resources gone. Writes ``result.json``.
    """
    from keras_replicator import ray_train

    os.environ.update(ray_train.LOOPBACK_ENV)
    import ray
    from ray.cluster_utils import Cluster
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    node_args = {"num_cpus": 1, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=node_args)
    try:
        second = cluster.add_node(**node_args)
        ray.init(address=cluster.address, log_to_driver=False,
                 runtime_env={"env_vars": {**ray_train.LOOPBACK_ENV, "PYTHONPATH": os.environ["PYTHONPATH"],
                                           "TF_CPP_MIN_LOG_LEVEL": "3",
                                           "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "30"}})
        addresses = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
        head = ray.get_runtime_context().get_node_id()
        config = {"out": out, "epochs": epochs, "shrink_at": shrink_at, "grow_at": grow_at,
                  "grow_wait": 300, "head_node": head}
        trainer = TensorflowTrainer(
            elastic_loop, train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=(1, 2), resources_per_worker={"CPU": 1},
                                         elastic_resize_monitor_interval_s=monitor_s),
            run_config=RunConfig(storage_path=os.path.join(out, "storage"), name="elastic",
                                 failure_config=FailureConfig(max_failures=1)),
        )
        results = []
        started = time.time()
        fit = threading.Thread(target=lambda: results.append(trainer.fit()), daemon=True)
        fit.start()
        # Nodes are added and removed here: Ray's Node installs signal handlers (main thread only).
        events: dict[str, float] = {}
        wanted = [("remove_my_node", "removed")] + ([("add_a_node", "added")] if grow_at is not None else [])
        for marker, event in wanted:
            while fit.is_alive() and not os.path.exists(os.path.join(out, marker)):
                time.sleep(0.2)
            if not fit.is_alive():
                break
            events[event] = time.time()
            if event == "removed":
                cluster.remove_node(second)
            else:
                cluster.add_node(**node_args)
        fit.join()
        (result,) = results
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"error": None if result.error is None else str(result.error), "addresses": addresses,
                       "started": started, "ended": time.time(), "events": events,
                       "last_epoch": result.metrics.get("epoch")}, f)
    finally:
        ray.shutdown()
        cluster.shutdown()
