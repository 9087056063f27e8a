"""The `train_loop_per_worker` functions tests/test_ray_train.py gives Ray Train's `TensorflowTrainer`.

Imported by reference in Ray's worker processes (they inherit the test's PYTHONPATH). Each loop
writes what its worker saw to ``config["out"]/attempt{a}.worker{rank}.json``, where the attempt
is 0 for the first start and 1 after Ray Train restarted the workers from a checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
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


def regression_loop(config: dict) -> None:
    """tests/launched_job.py's job (data, model, optimizer, batch), with `ReportCheckpoint`.

    With ``config["kill_at_epoch"]``, worker 1 of the first attempt SIGKILLs itself at the
    beginning of that epoch (after the chief's checkpoint of the epoch before was reported).
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

    class Record(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if attempt == 0 and rank == 1 and epoch == kill_at:
                time.sleep(5)  # time for Ray's controller to register the last report
                os.kill(os.getpid(), signal.SIGKILL)
            epochs_run.append(epoch)

    report = ray_train.ReportCheckpoint()
    model.fit(x, y, batch_size=LAUNCHED_JOB_BATCH, epochs=config["epochs"], shuffle=False,
              verbose=0, callbacks=[report, Record()])
    _report(
        config, rank, attempt,
        worker_index=strategy.worker_index, num_workers=strategy.num_workers,
        tf_config=json.loads(os.environ["TF_CONFIG"]), legacy_keras_env=legacy,
        tf_keras_is_keras=tf.keras.layers.Dense is keras.layers.Dense,
        restored_epoch=report.restored_epoch, epochs_run=epochs_run,
        weights=[w.tolist() for w in model.get_weights()],
    )


def regression_and_ray_data_loop(config: dict) -> None:
    """`regression_loop`, then `ray_data_loop` in the same workers (one start of TensorFlow).

    Then tries `AsyncReplicatorStrategy` on Ray's `TF_CONFIG` and records its error.
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
