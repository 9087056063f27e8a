"""The training job tests/test_preemption.py runs (not a test module).

Usage: ``python tests/preemption_job.py OUT_DIR [--sigterm-at WORKER EPOCH BATCH] [--silent]``.

One process with 2 replicas when no cluster is described, else one worker of a
job started by ``keras-replicator launch``. It trains a small dense model with
``keras.callbacks.BackupAndRestore(OUT_DIR/backup)`` and nothing else of
keras_replicator's beyond the strategy; each worker appends every step it runs,
``[epoch, batch]``, to ``OUT_DIR/steps.worker{i}.jsonl`` and writes its final
weights to ``OUT_DIR/weights.worker{i}.npz``. ``--sigterm-at W E B``: at the first
start, worker W sends itself SIGTERM when batch B of epoch E begins. ``--silent``:
writes ``OUT_DIR/pid.worker{i}`` and trains slowly for long, for a test to SIGSTOP a worker.
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

if "TF_CONFIG" not in os.environ:
    kr.simulate_devices(2)
strategy = kr.ReplicatorStrategy(failure_timeout=float(os.environ.get("KR_TEST_FAILURE_TIMEOUT", "30")))

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tests.helpers import dense_model, regression_data  # noqa: E402

EXAMPLES, BATCH, EPOCHS = 64, 8, 3  # 8 steps per epoch


def compile_model(model: keras.Model) -> None:
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")


class _Record(keras.callbacks.Callback):
    def __init__(self, out_dir, sigterm_at, silent):
        super().__init__()
        self.path = os.path.join(out_dir, f"steps.worker{strategy.worker_index}.jsonl")
        self.sigterm_at, self.silent = sigterm_at, silent
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.sigterm_at == (strategy.worker_index, self.epoch, batch):
            print(f"sending SIGTERM at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            if strategy.num_workers > 1:
                # TensorFlow's SIGTERM notifier polls its flag once a second, and this job's steps
                # take milliseconds: under load the notice could arrive after the last step (fit
                # would then just finish). Waiting until this worker has seen it makes the stop
                # step independent of load: the step after this one (the agreement's n + 1).
                from keras_replicator._compat import preemption

                assert preemption._cluster_watch.noticed.wait(60), "no preemption notice in 60 s"
        if self.silent:
            time.sleep(0.05)

    def on_train_batch_end(self, batch, logs=None):
        with open(self.path, "a") as f:
            f.write(json.dumps([self.epoch, batch]) + "\n")


def main(out_dir: str, sigterm_at, silent: bool) -> None:
    restart = int(os.environ.get("KERAS_REPLICATOR_RESTART_COUNT", "0"))
    if silent:
        with open(os.path.join(out_dir, f"pid.worker{strategy.worker_index}"), "w") as f:
            f.write(str(os.getpid()))
    x, y = regression_data(EXAMPLES)
    with strategy.scope():
        model = dense_model()
        compile_model(model)
    record = _Record(out_dir, sigterm_at if restart == 0 else None, silent)
    model.fit(
        x, y, batch_size=BATCH, epochs=1000 if silent else EPOCHS, shuffle=False, verbose=0,
        callbacks=[keras.callbacks.BackupAndRestore(os.path.join(out_dir, "backup")), record],
    )
    weights = {f"w{i}": np.asarray(w) for i, w in enumerate(model.get_weights())}
    np.savez(os.path.join(out_dir, f"weights.worker{strategy.worker_index}.npz"), **weights)
    print(f"finished; SIGTERM handler after fit: {signal.getsignal(signal.SIGTERM)!r}", flush=True)


if __name__ == "__main__":
    argv = sys.argv[1:]
    at = None
    if "--sigterm-at" in argv:
        i = argv.index("--sigterm-at")
        at = tuple(int(v) for v in argv[i + 1:i + 4])
    main(argv[0], at, "--silent" in argv)
