"""The training job tests/test_multi_worker.py runs on 2 local workers (not a test module).

Usage (every worker runs the same command, as ``keras-replicator launch`` does)::

    python tests/multi_worker_job.py check  OUT_DIR [--exactly-once]
    python tests/multi_worker_job.py resume OUT_DIR [--wait-after-epoch E]
    python tests/multi_worker_job.py short  OUT_DIR

Each worker writes what it saw to ``OUT_DIR/worker{i}.json`` / ``.npz``; the test
compares the workers with each other and with a one-device reference computed
in the pytest process. ``check``: fit/evaluate/predict of a model with global
batch norm, the primitives, ModelCheckpoint and BackupAndRestore file writes,
dropout masks,
and (``--exactly-once``) the data helper's exactly-once check. ``resume``: a
job with BackupAndRestore that a test kills (the worker given
``--wait-after-epoch`` waits after that epoch to be killed) and then restarts.
``short``: the short-batch matrix (tests/test_short_batches_multi_worker.py).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_replicator as kr  # noqa: E402
from tests.helpers import dropout_masks, regression_data  # noqa: E402

strategy: kr.ReplicatorStrategy  # created first thing in main (the test module imports this file)

# Shared with the test module: data and model of both sides of the comparison.
NUM_EXAMPLES = 88  # 5 full global batches of 16 and a last one of 8 (2 rows per replica at 4)
BATCH = 16


def regression_model(batch_norm=None, seed: int = 1) -> keras.Model:
    """Dense -> batch norm -> tanh -> Dense; ``batch_norm`` is the batch-norm layer class."""
    batch_norm = batch_norm or kr.layers.GlobalBatchNormalization
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16),
            batch_norm(momentum=0.5),
            keras.layers.Activation("tanh"),
            keras.layers.Dense(1),
        ]
    )


def compile_model(model: keras.Model) -> None:
    model.compile(keras.optimizers.SGD(0.05, momentum=0.5), "mse", metrics=["mae"], steps_per_execution=2)


def _record_saves(model: keras.Model) -> list[str]:
    """Records the paths the checkpoint callbacks hand to ``model.save_weights``."""
    paths: list[str] = []
    original = model.save_weights

    def save_weights(filepath, *args, **kwargs):
        paths.append(str(filepath))
        return original(filepath, *args, **kwargs)

    model.save_weights = save_weights
    return paths


def _primitives() -> dict:
    """Every replica contributes (its global id + 1); returns what each local replica got."""

    def replica_fn():
        value = tf.cast(kr.replica_id(), tf.float32) + 1.0
        return {
            "replica_id": kr.replica_id(),
            "num_replicas": tf.constant(kr.num_replicas()),
            "sum": kr.all_reduce(value, "sum"),
            "mean": kr.all_reduce(value, "mean"),
            "max": kr.all_reduce(value, "max"),
            "gather": kr.all_gather(value[tf.newaxis]),
            "broadcast": kr.broadcast(value, source_replica=kr.num_replicas() - 1),
        }

    results = tf.function(lambda: strategy.run(replica_fn))()
    return {
        name: [np.asarray(v).tolist() for v in strategy.experimental_local_results(value)]
        for name, value in results.items()
    }


def check(out_dir: str, exactly_once: bool) -> None:
    started = time.time()
    x, y = regression_data(NUM_EXAMPLES)
    with strategy.scope():
        model = regression_model()
        compile_model(model)
    saves = _record_saves(model)
    callbacks = [
        keras.callbacks.ModelCheckpoint(
            os.path.join(out_dir, "ckpt", "epoch{epoch}.weights.h5"), save_weights_only=True
        ),
        keras.callbacks.BackupAndRestore(os.path.join(out_dir, "backup"), delete_checkpoint=False),
    ]
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    evaluation = model.evaluate(x, y, batch_size=BATCH, verbose=0)
    predictions = model.predict(x, batch_size=BATCH, verbose=0)
    report = {
        "worker_index": strategy.worker_index,
        "num_workers": strategy.num_workers,
        "is_chief": strategy.is_chief,
        "num_replicas": strategy.num_replicas_in_sync,
        "local_devices": list(strategy.devices),
        "history": history.history,
        "evaluation": evaluation,
        "saved_to": saves,
        "primitives": _primitives(),
        "optimizer_state_bytes": kr.optimizers.state_bytes_per_device(model.optimizer),
    }
    print(f"fit, evaluate, predict and primitives: {time.time() - started:.1f} s", flush=True)
    if exactly_once:
        from tests.test_data_exactly_once import check_exactly_once

        # Each call asserts, on this worker, that the counts summed over all replicas of
        # all workers are one per example and epoch; the counts are kept for the test.
        report["exactly_once"] = {}
        for via in ("numpy", "distribute_dataset", "loop"):
            t0 = time.time()
            report["exactly_once"][via] = [c.tolist() for c in check_exactly_once(strategy, via=via)]
            print(f"exactly once via {via}: {time.time() - t0:.1f} s", flush=True)
    report["unshared_backup"] = _restore_from_unshared_backup(model, out_dir, x, y)
    # Dropout masks of 2 traced steps, per local replica: independent across workers too.
    masks = {f"mask{s}_{r}": m for s, step in enumerate(dropout_masks(strategy)) for r, m in enumerate(step)}
    _write(out_dir, report, model, predictions=predictions, **masks)


def _restore_from_unshared_backup(model: keras.Model, out_dir: str, x, y) -> str:
    """BackupAndRestore where only the chief finds a backup: fit must refuse to start."""
    if strategy.is_chief:
        shutil.copytree(os.path.join(out_dir, "backup"), os.path.join(out_dir, "unshared0"))
    backup = keras.callbacks.BackupAndRestore(os.path.join(out_dir, f"unshared{strategy.worker_index}"))
    before = [np.asarray(v.numpy()) for v in model.trainable_weights]
    try:
        model.fit(x, y, batch_size=BATCH, epochs=4, verbose=0, callbacks=[backup])
    except RuntimeError as e:
        return str(e)
    finally:
        model._initial_epoch = None  # Keras keeps a restored epoch on the model
        for v, value in zip(model.trainable_weights, before):
            v.assign(value)
    return "trained"


class _Progress(keras.callbacks.Callback):
    def __init__(self, wait_after_epoch: int | None):
        super().__init__()
        self.wait_after_epoch = wait_after_epoch
        self.epochs: list[int] = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs.append(epoch)

    def on_epoch_end(self, epoch, logs=None):
        print(f"epoch {epoch} done", flush=True)
        if epoch == self.wait_after_epoch:
            print(f"waiting to be killed at {time.time():.3f}", flush=True)
            time.sleep(600)


def resume(out_dir: str, wait_after_epoch: int | None) -> None:
    x, y = regression_data(NUM_EXAMPLES)
    with strategy.scope():
        model = regression_model()
        compile_model(model)
    progress = _Progress(wait_after_epoch)
    backup = keras.callbacks.BackupAndRestore(os.path.join(out_dir, "backup"))
    try:
        model.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0, callbacks=[backup, progress])
    except Exception as e:
        print(f"fit failed at {time.time():.3f} with {type(e).__name__}", flush=True)
        raise
    _write(out_dir, {"epochs_run": progress.epochs, "worker_index": strategy.worker_index}, model)


def _write(out_dir: str, report: dict, model: keras.Model, **arrays) -> None:
    name = os.path.join(out_dir, f"worker{strategy.worker_index}")
    weights = {f"w{i}": np.asarray(v.numpy()) for i, v in enumerate(model.weights)}
    np.savez(name + ".npz", **weights, **arrays)
    with open(name + ".json", "w") as f:
        json.dump(report, f)
    print("wrote", name, f"(this worker used {time.process_time():.0f} s of CPU)", flush=True)


def short_batches(out: str) -> None:
    """The short-batch matrix (tests/short_batches_cases.py) on this cluster; arrays per worker."""
    import warnings

    from tests import short_batches_cases as cases

    arrays = {}
    for family in cases.MULTI_WORKER_FAMILIES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the one-device model: its initial weights only
            initial = cases.build(family).get_weights()
        with strategy.scope():
            model = cases.build(family)
        for rows, batch_size in cases.ROWS:
            got = cases.run_case(model, family, rows, batch_size, initial)
            for field, value in got.items():
                for i, v in enumerate(value if field == "weights" else [value]):
                    arrays[f"{family}/{rows}/{field}/{i}"] = np.asarray(v)
    np.savez(os.path.join(out, f"short{strategy.worker_index}.npz"), **arrays)
    print("wrote short batches", strategy.worker_index, flush=True)


if __name__ == "__main__":
    # Before any tensor: the strategy joins the cluster that TF_CONFIG describes.
    strategy = kr.ReplicatorStrategy(
        failure_timeout=float(os.environ.get("KR_TEST_FAILURE_TIMEOUT", "60")), startup_timeout=120,
        shard_optimizer_state=os.environ.get("KR_TEST_SHARD_OPTIMIZER_STATE") == "1",
    )
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "check":
        check(out, exactly_once="--exactly-once" in sys.argv)
    elif mode == "short":
        short_batches(out)
    elif mode == "resume":
        wait = int(sys.argv[sys.argv.index("--wait-after-epoch") + 1]) if "--wait-after-epoch" in sys.argv else None
        resume(out, wait if wait is not None and strategy.worker_index == 1 else None)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
