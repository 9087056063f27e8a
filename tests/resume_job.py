"""The training job tests/test_resume.py runs (not a test module); its model and data are importable.

Usage: ``python tests/resume_job.py OUT_DIR --input shuffled|input_fn [--devices N]
[--sigterm-at WORKER EPOCH BATCH]``.

One process with ``--devices`` replicas (default 2) when no cluster is described, else
one worker of a job started by ``keras-replicator launch``. It trains `IdModel` (a small
MLP, no dropout) with a learning-rate schedule and ``keras.callbacks.BackupAndRestore(
OUT_DIR/backup)``, on `data` whose last column is each example's id: ``shuffled``
feeds ``fit`` a ``Dataset.from_tensor_slices(...).shuffle(512, seed=7).batch(BATCH)``
pipeline, which reshuffles every epoch; ``input_fn`` the per-worker `input_fn` through
``strategy.distribute_dataset``. Every replica appends ``step id id ...`` (the optimizer's step
count before the step, the ids of its slice) to ``OUT_DIR/ids.worker{i}.txt``; each
worker writes its final weights to ``OUT_DIR/weights.worker{i}.npz``. ``--sigterm-at W E
B``: at the first start, worker W sends itself SIGTERM when batch B of epoch E begins.
"""

from __future__ import annotations

import os
import signal
import sys
import time

STARTED = time.monotonic()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

EXAMPLES, BATCH, EPOCHS, FEATURES = 96, 16, 3, 8  # 6 steps per epoch


def data() -> tuple[np.ndarray, np.ndarray]:
    """``x`` with each example's id as its last column (not a feature the model reads), ``y``."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(EXAMPLES, FEATURES)).astype("float32")
    y = (np.tanh(x @ rng.normal(size=(FEATURES, 1))) + 0.1).astype("float32")
    ids = np.arange(EXAMPLES, dtype="float32")[:, None]
    return np.concatenate([x, ids], axis=1), y


def shuffled_dataset() -> tf.data.Dataset:
    x, y = data()
    return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(512, seed=7).batch(BATCH)


class IdModel(keras.Model):
    """An MLP on all columns but the last; its train step writes the ids it trains on."""

    def __init__(self, ids_path: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.ids_path = ids_path
        self.hidden = keras.layers.Dense(16, activation="tanh")
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(x[:, :FEATURES]))

    def train_step(self, batch):
        x, y = batch[:2]
        if self.ids_path is not None:
            tf.print(self.optimizer.iterations, tf.cast(x[:, FEATURES], tf.int64), summarize=-1,
                     output_stream=f"file://{self.ids_path}")
        return super().train_step((x, y))


def build_model(ids_path: str | None = None) -> IdModel:
    keras.utils.set_random_seed(1)
    model = IdModel(ids_path)
    model(np.zeros((1, FEATURES + 1), "float32"))  # built: BackupAndRestore needs it
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=4, decay_rate=0.7)
    model.compile(keras.optimizers.SGD(schedule, momentum=0.9), "mse")
    return model


def input_fn(ctx) -> tf.data.Dataset:
    """Per-worker input: each pipeline shuffles with its own seed and batches per replica."""
    import keras_replicator as kr

    x, y = data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(512, seed=kr.data.pipeline_seed(7, ctx))
    return dataset.batch(ctx.get_per_replica_batch_size(BATCH))


def fit(model, kind: str, callbacks=(), strategy=None, **options) -> None:
    """``shuffled``: the pipeline to `fit` as it is; ``input_fn``: `input_fn` through ``distribute_dataset``.

    ``options``: more of `fit`'s arguments (``validation_data``).
    """
    if kind == "input_fn":
        train = strategy.distribute_dataset(input_fn, global_batch_size=BATCH)
    else:
        train = shuffled_dataset()
    model.fit(train, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=list(callbacks), **options)


class SigtermAt(keras.callbacks.Callback):
    def __init__(self, strategy, at):
        super().__init__()
        self.strategy, self.at, self.epoch = strategy, at, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if not getattr(self, "stepped", False):
            self.stepped = True
            print(f"first step (epoch {self.epoch}, batch {batch}) {time.monotonic() - STARTED:.1f} s after "
                  "the start", flush=True)
        if self.at == (self.strategy.worker_index, self.epoch, batch):
            os.kill(os.getpid(), signal.SIGTERM)
            if self.strategy.num_workers > 1:
                # As in preemption_job.py: wait for the notice, so that the stop step (this
                # one's successor) does not depend on the machine's load.
                from keras_replicator._compat import preemption

                assert preemption._cluster_watch.noticed.wait(60), "no preemption notice in 60 s"


def main(argv: list[str]) -> None:
    import keras_replicator as kr

    out_dir, kind = argv[0], argv[argv.index("--input") + 1]
    devices = int(argv[argv.index("--devices") + 1]) if "--devices" in argv else 2
    at = None
    if "--sigterm-at" in argv and int(os.environ.get("KERAS_REPLICATOR_RESTART_COUNT", "0")) == 0:
        i = argv.index("--sigterm-at")
        at = tuple(int(v) for v in argv[i + 1:i + 4])
    if "TF_CONFIG" not in os.environ:
        kr.simulate_devices(devices)
    strategy = kr.ReplicatorStrategy(
        failure_timeout=30.0,
        shard_optimizer_state=os.environ.get("KR_TEST_SHARD_OPTIMIZER_STATE") == "1",
    )
    with strategy.scope():
        model = build_model(os.path.join(out_dir, f"ids.worker{strategy.worker_index}.txt"))
    backup = keras.callbacks.BackupAndRestore(os.path.join(out_dir, "backup"))
    fit(model, kind, [backup, SigtermAt(strategy, at)], strategy)
    weights = {f"w{i}": np.asarray(w) for i, w in enumerate(model.get_weights())}
    np.savez(os.path.join(out_dir, f"weights.worker{strategy.worker_index}.npz"), **weights)
    sharded = ", optimizer state sharded" if strategy.shard_optimizer_state else ""
    print(f"finished on {strategy.num_replicas_in_sync} replicas{sharded}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
