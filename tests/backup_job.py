"""The training job tests/test_crash_consistent_backups.py runs (not a test module).

Usage: ``python tests/backup_job.py OUT_DIR [--epochs E] [--shard] [--kill-worker W]
[--checkpoint-kill N] [--slow-save S]``.

One process with 2 replicas when no cluster is described, else one worker of a job
started by ``keras-replicator launch``. It trains a small dense model (SGD with
momentum: optimizer state) for 4 epochs (``--epochs E``: E) of 8 steps with
``keras.callbacks.BackupAndRestore(OUT_DIR/backup)``; each worker appends every step it
runs, ``[epoch, batch]``, to ``OUT_DIR/steps.worker{i}.jsonl`` and writes its final
weights to ``OUT_DIR/weights.worker{i}.npz``. A kill during a save comes from
``KERAS_REPLICATOR_KILL_AT_SAVE`` (`keras_replicator.atomic_files.kill_point`), which the
test sets.

* ``--shard``: ``shard_optimizer_state=True`` (the save gathers the state from every replica).
* ``--kill-worker W``: only worker W keeps ``KERAS_REPLICATOR_KILL_AT_SAVE``.
* ``--checkpoint-kill N``: no backup; ``ModelCheckpoint(OUT_DIR/best.weights.h5,
  save_best_only=True)`` and each epoch's weights in ``OUT_DIR/epoch{e}.npz`` (recorded
  before the checkpoint's save); the process SIGKILLs itself in the middle of writing the
  N-th best file (as the optimizer's state is written into it).
* ``--slow-save S``: every backup's save takes S seconds longer (a sleep as the optimizer's
  state is written, after writing ``OUT_DIR/slow_save.{n}`` for the n-th save), for a test of
  the launcher's grace period.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import keras_replicator as kr  # noqa: E402

ARGS = sys.argv[1:]
if "TF_CONFIG" not in os.environ:
    kr.simulate_devices(2)
strategy = kr.ReplicatorStrategy(shard_optimizer_state="--shard" in ARGS,
                                 failure_timeout=float(os.environ.get("KR_TEST_FAILURE_TIMEOUT", "30")))

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tests.helpers import dense_model, regression_data  # noqa: E402

EXAMPLES, BATCH, EPOCHS = 64, 8, 4  # 8 steps per epoch


def _option(name: str, default=None):
    return ARGS[ARGS.index(name) + 1] if name in ARGS else default


def make_model() -> keras.Model:
    with strategy.scope():
        model = dense_model()
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")
    return model


class _Record(keras.callbacks.Callback):
    def __init__(self, out_dir, save_epochs: bool):
        super().__init__()
        self.out_dir, self.save_epochs = out_dir, save_epochs
        self.path = os.path.join(out_dir, f"steps.worker{strategy.worker_index}.jsonl")
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        with open(self.path, "a") as f:
            f.write(json.dumps([self.epoch, batch]) + "\n")

    def on_epoch_end(self, epoch, logs=None):
        if self.save_epochs:
            weights = {f"w{i}": np.asarray(w) for i, w in enumerate(self.model.get_weights())}
            np.savez(os.path.join(self.out_dir, f"epoch{epoch}.npz"), **weights)


def _hook_optimizer_saves(model: keras.Model, kill_at: int | None, sleep: float, out_dir: str) -> None:
    """Runs when the optimizer's state is written into a weights file: a sleep, or a SIGKILL at
    the `kill_at`-th write (the file is then half written)."""
    optimizer = model.optimizer
    original = optimizer.save_own_variables
    calls = [0]

    def save_own_variables(store):
        calls[0] += 1
        if calls[0] == kill_at:
            print(f"SIGKILL in the middle of write {kill_at}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if sleep:
            open(os.path.join(out_dir, f"slow_save.{calls[0]}"), "w").close()
            time.sleep(sleep)
        return original(store)

    optimizer.save_own_variables = save_own_variables


def main(out_dir: str) -> None:
    worker = _option("--kill-worker")
    if worker is not None and int(worker) != strategy.worker_index:
        os.environ.pop("KERAS_REPLICATOR_KILL_AT_SAVE", None)
    checkpoint_kill = _option("--checkpoint-kill")
    x, y = regression_data(EXAMPLES)
    model = make_model()
    if checkpoint_kill is not None:
        callbacks = [_Record(out_dir, True), keras.callbacks.ModelCheckpoint(
            os.path.join(out_dir, "best.weights.h5"), monitor="loss", save_best_only=True, save_weights_only=True)]
    else:
        callbacks = [keras.callbacks.BackupAndRestore(os.path.join(out_dir, "backup")), _Record(out_dir, False)]
    slow = float(_option("--slow-save", 0))
    if checkpoint_kill is not None or slow:
        with strategy.scope():
            model.optimizer.build(model.trainable_variables)
        _hook_optimizer_saves(model, None if checkpoint_kill is None else int(checkpoint_kill), slow, out_dir)
    model.fit(x, y, batch_size=BATCH, epochs=int(_option("--epochs", EPOCHS)), shuffle=False, verbose=0,
              callbacks=callbacks)
    weights = {f"w{i}": np.asarray(w) for i, w in enumerate(model.get_weights())}
    np.savez(os.path.join(out_dir, f"weights.worker{strategy.worker_index}.npz"), **weights)
    print("finished", flush=True)


if __name__ == "__main__":
    main(ARGS[0])
