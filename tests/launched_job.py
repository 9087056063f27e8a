"""The training script tests/test_launch_training.py starts with ``keras-replicator launch``.

Usage: ``python tests/launched_job.py OUT_DIR EPOCHS [--crash] [--keep-failing]``. It calls
``kr.simulate_devices(1)`` itself (the launcher's ``--devices-per-worker`` wins),
trains with ``BackupAndRestore`` and ``Throughput``, saves with ``kr.save_model`` and
writes what it saw to ``OUT_DIR/worker{i}.restart{r}.json``. With ``--crash``, worker 1
of the first start dies at the beginning of epoch 2, so that ``--max-restarts``
restarts the job, which resumes from the chief's backup. With ``--keep-failing`` too,
worker 1 fails again at every restart, before it joins the cluster: an elastic job
(``--workers 1:2``) leaves it out and goes on with worker 0 alone.
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
from keras_replicator.backup_commits import BackupDirectory  # noqa: E402

if ("--keep-failing" in sys.argv and os.environ.get("KERAS_REPLICATOR_WORKER_INDEX") == "1"
        and os.environ.get("KERAS_REPLICATOR_RESTART_COUNT", "0") != "0"):
    sys.exit(4)  # it cannot be restarted (a broken device, say)
kr.simulate_devices(1)  # as a script written for one machine does
strategy = kr.ReplicatorStrategy(failure_timeout=10)

import keras  # noqa: E402

from tests.helpers import LAUNCHED_JOB_BATCH as BATCH  # noqa: E402
from tests.helpers import LAUNCHED_JOB_EXAMPLES as NUM_EXAMPLES  # noqa: E402
from tests.helpers import dense_model, regression_data  # noqa: E402


def main(out_dir: str, epochs: int, crash: bool) -> None:
    restart = int(os.environ.get("KERAS_REPLICATOR_RESTART_COUNT", "0"))
    x, y = regression_data(NUM_EXAMPLES)
    with strategy.scope():
        model = dense_model()
        model.compile(keras.optimizers.SGD(0.05), "mse")
        replicas_in_scope = kr.num_replicas()
    epochs_run: list[int] = []
    first_step_at: list[float] = []

    class Record(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if crash and restart == 0 and strategy.worker_index == 1 and epoch == 2:
                # Dies once the chief has committed epoch 1's backup (its metadata's "epoch": the
                # next one, 2), so the restart resumes at epoch 2 however slowly the chief writes
                # (was: a 3 s sleep).
                backups = BackupDirectory(os.path.join(out_dir, "backup"))
                deadline = time.monotonic() + 300  # a limit for a hang
                while time.monotonic() < deadline and not any(
                        b.metadata.get("epoch", 0) >= 2 for b in backups.complete()):
                    time.sleep(0.1)
                with open(os.path.join(out_dir, "crashed_at"), "w") as f:
                    f.write(repr(time.time()))
                os._exit(3)
            epochs_run.append(epoch)

        def on_train_batch_end(self, batch, logs=None):
            if not first_step_at:
                first_step_at.append(time.time())

    throughput = kr.callbacks.Throughput()
    history = model.fit(
        x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
        callbacks=[keras.callbacks.BackupAndRestore(os.path.join(out_dir, "backup")), Record(), throughput],
    )
    wrote = kr.save_model(model, os.path.join(out_dir, "final.keras"))
    report = {
        "worker_index": strategy.worker_index,
        "num_workers": strategy.num_workers,
        "first_step_at": first_step_at[0] if first_step_at else None,
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
