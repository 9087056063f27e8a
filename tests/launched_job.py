"""The training script tests/test_launch_training.py starts with ``keras-replicator launch``.

Usage: ``python tests/launched_job.py OUT_DIR EPOCHS [--crash]``. It calls
``kr.simulate_devices(1)`` itself (the launcher's ``--devices-per-worker`` wins),
trains with ``BackupAndRestore`` and ``Throughput``, saves with ``kr.save_model`` and
writes what it saw to ``OUT_DIR/worker{i}.restart{r}.json``. With ``--crash``, worker 1
of the first start dies at the beginning of epoch 2, so that ``--max-restarts``
restarts the job, which resumes from the chief's backup.
"""

from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import keras_replicator as kr  # noqa: E402

kr.simulate_devices(1)  # as a script written for one machine does
strategy = kr.ReplicatorStrategy(failure_timeout=10)

import keras  # noqa: E402

from tests.helpers import dense_model, regression_data  # noqa: E402

NUM_EXAMPLES, BATCH = 64, 16


def main(out_dir: str, epochs: int, crash: bool) -> None:
    restart = int(os.environ.get("KERAS_REPLICATOR_RESTART_COUNT", "0"))
    x, y = regression_data(NUM_EXAMPLES)
    with strategy.scope():
        model = dense_model()
        model.compile(keras.optimizers.SGD(0.05), "mse")
        replicas_in_scope = kr.num_replicas()
    epochs_run: list[int] = []

    class Record(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if crash and restart == 0 and strategy.worker_index == 1 and epoch == 2:
                time.sleep(3)  # the chief has finished writing epoch 1's backup
                os._exit(3)
            epochs_run.append(epoch)

    throughput = kr.callbacks.Throughput()
    history = model.fit(
        x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
        callbacks=[keras.callbacks.BackupAndRestore(os.path.join(out_dir, "backup")), Record(), throughput],
    )
    wrote = kr.save_model(model, os.path.join(out_dir, "final.keras"))
    report = {
        "worker_index": strategy.worker_index,
        "restart": restart,
        "replicas_in_scope": replicas_in_scope,
        "replicas_outside": kr.num_replicas(),
        "epochs_run": epochs_run,
        "examples_per_second": history.history.get("examples_per_second"),
        "wrote": wrote,
        "weights": [w.tolist() for w in model.get_weights()],
    }
    with open(os.path.join(out_dir, f"worker{strategy.worker_index}.restart{restart}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), "--crash" in sys.argv[3:])
