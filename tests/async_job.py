"""The training job tests/test_async.py runs on a chief, workers and parameter servers (not a test module).

Every task runs the same command, with its own ``TF_CONFIG``::

    python tests/async_job.py fit    OUT_DIR   # fit/evaluate/predict/save, partitioned embedding
    python tests/async_job.py faults OUT_DIR   # long epochs: a test kills tasks meanwhile
    python tests/async_job.py backup OUT_DIR   # short epochs, a backup after each (kills in saves)

On workers and parameter servers, creating the strategy serves until the chief
ends (exit 0). The chief writes ``OUT_DIR/chief.json`` (and ``.npz``); the test
compares it with a reference computed in the pytest process.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_replicator as kr  # noqa: E402

VOCAB, EMBED = 50, 16
NUM_EXAMPLES = 512
BATCH_SIZE = 16  # per worker: each step's batch


def data(n: int = NUM_EXAMPLES, seed: int = 0):
    """Token pairs whose target is a fixed linear function of a hidden embedding."""
    rng = np.random.RandomState(seed)
    tokens = rng.randint(0, VOCAB, size=(n, 2)).astype("int32")
    hidden = np.random.RandomState(99).randn(VOCAB).astype("float32")
    y = (hidden[tokens[:, 0]] - 0.5 * hidden[tokens[:, 1]])[:, None].astype("float32")
    return tokens, y


@keras.saving.register_keras_serializable(package="keras_replicator_tests")
class CountingModel(keras.Sequential):
    """Counts the training steps each worker ran, in a variable on a parameter server."""

    def count_steps(self, num_workers: int) -> None:
        self.steps_by_worker = keras.Variable(np.zeros(num_workers, "float32"), trainable=False)

    def load_own_variables(self, store):
        """Loading a saved model: the counter is created first, with the saved shape."""
        if len(store.keys()) and not hasattr(self, "steps_by_worker"):
            self.count_steps(store["0"].shape[0])
        super().load_own_variables(store)

    def train_step(self, data):
        logs = super().train_step(data)
        if hasattr(self, "steps_by_worker"):
            worker = tf.distribute.coordinator.experimental_get_current_worker_index()
            self.steps_by_worker.assign_add(tf.one_hot(worker, self.steps_by_worker.shape[0]))
        return logs


class DropoutRecorder(keras.Model):
    """Keeps every keep-mask of `Dropout(0.5)` each worker drew, in that worker's own variables."""

    def __init__(self, num_workers: int, max_steps: int, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(1)
        self.dropout = keras.layers.Dropout(0.5, seed=7)
        self.masks = [keras.Variable(np.zeros((max_steps, 128), "float32"), trainable=False)
                      for _ in range(num_workers)]
        self.counts = [keras.Variable(0, dtype="int32", trainable=False) for _ in range(num_workers)]

    def call(self, x):
        return self.dense(tf.cast(x, "float32"))

    def train_step(self, data):
        mask = self.dropout(tf.ones([128]), training=True)

        def record(w):  # only worker w writes its variables; atomic adds, no lost update
            def write():
                i = self.counts[w].assign_add(1) - 1
                row = tf.one_hot(i, self.masks[w].shape[0])[:, None] * mask[None, :]
                self.masks[w].assign_add(row)
                return tf.constant(0)

            return write

        worker = tf.distribute.coordinator.experimental_get_current_worker_index()
        tf.switch_case(tf.cast(worker, tf.int32), [record(w) for w in range(len(self.masks))])
        return {"kept": tf.reduce_mean(mask)}


def dropout_masks_by_worker(strategy) -> list[list]:
    """Each worker's dropout outputs on ones (0 or 2) over 20 steps of fit (2 per execution)."""
    with strategy.scope():
        model = DropoutRecorder(strategy.num_workers, 20)
        model.build((None, 2))
        model.compile(steps_per_execution=2)
    model.fit(strategy.distribute_dataset(dataset_fn, per_replica_batch_size=16), epochs=1,
              steps_per_epoch=20, verbose=0)
    return [m.numpy()[: int(c.numpy())].tolist() for m, c in zip(model.masks, model.counts)]


def build_model() -> keras.Model:
    keras.utils.set_random_seed(1)
    return CountingModel(
        [
            keras.Input((2,), dtype="int32"),
            keras.layers.Embedding(VOCAB, EMBED),
            keras.layers.Flatten(),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )


def dataset_fn(input_context):
    x, y = data()
    return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(NUM_EXAMPLES)


class Progress(keras.callbacks.Callback):
    """Prints each epoch's end (the tests wait for it) and records what callbacks saw."""

    def __init__(self, sleep_per_batch: float = 0.0, hold_at_epoch: int | None = None, release: str = ""):
        super().__init__()
        self.sleep_per_batch = sleep_per_batch
        self.hold_at_epoch, self.release = hold_at_epoch, release
        self.batches: list[int] = []
        self.epochs: list[int] = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs.append(epoch)

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append(batch)
        time.sleep(self.sleep_per_batch)

    def on_epoch_end(self, epoch, logs=None):
        print(f"epoch {epoch} done loss={logs['loss']:.5f}", flush=True)
        if epoch == self.hold_at_epoch:
            # The test (or a worker's `die_at_hold`) kills and restarts a task meanwhile, then
            # creates the release file.
            open(self.release + ".holding", "w").close()
            deadline = time.time() + 600  # a limit for a hang: the test releases it
            while not os.path.exists(self.release) and time.time() < deadline:
                time.sleep(0.1)


class UntilWorkerSteps(keras.callbacks.Callback):
    """Trains at least ``min_epochs``, then until worker ``worker`` has run a step after the hold.

    TensorFlow's ClusterCoordinator gives each closure to whichever worker asks first, so how soon
    a restarted worker runs a step depends on how long it takes to come back (reconnecting, then
    its first function) against how fast the others take the queue's closures; under load the
    other workers took every closure of 11 epochs. The product guarantees that the restarted
    worker rejoins and then takes closures, not when: so the chief trains until it has run one
    (after the hold, hence in its new process), with ``MAX_EPOCHS`` as a limit for a hang.
    """

    MAX_EPOCHS = 300  # at least 0.1 s a batch, 20 batches an epoch: 600 s

    def __init__(self, model, counts: list, worker: int, min_epochs: int, hold_at_epoch: int):
        super().__init__()
        self.counter, self.counts, self.worker = model.steps_by_worker, counts, worker
        self.min_epochs, self.hold_at_epoch = min_epochs, hold_at_epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 < self.min_epochs or epoch <= self.hold_at_epoch:
            return
        # counts[hold] was read as the chief held, the killed worker gone, its restart not released.
        if self.counter.numpy()[self.worker] > self.counts[self.hold_at_epoch][self.worker]:
            self.model.stop_training = True


def optimizer() -> keras.optimizers.Optimizer:
    """fit_mode's optimizer (the test's synchronous reference uses it too).

    SGD(0.3) learns this on one device but diverged once in 4 runs with 2 async workers
    (staleness); Adam's normalised steps do not."""
    return keras.optimizers.Adam(0.02)


def faults_optimizer() -> keras.optimizers.Optimizer:
    """faults_mode's optimizer (the tests' synchronous reference uses it too)."""
    return keras.optimizers.SGD(0.1)


def fit_mode(strategy, out: str) -> dict:
    x, y = data()
    with strategy.scope():
        model = build_model()
        model.compile(optimizer(), "mse", metrics=["mae"], steps_per_execution=2)
    report = {"devices": [w.value.device for w in model.weights]}
    before = model.evaluate(x, y, batch_size=64, verbose=0)
    train = strategy.distribute_dataset(dataset_fn, per_replica_batch_size=BATCH_SIZE)
    progress = Progress()
    history = model.fit(
        train, epochs=4, steps_per_epoch=15, verbose=0, validation_data=(x[:128], y[:128]),
        callbacks=[progress, keras.callbacks.BackupAndRestore(os.path.join(out, "backup"), delete_checkpoint=False)],
    )
    report.update(
        before=before,
        history=history.history,
        batches=progress.batches,
        iterations=int(model.optimizer.iterations.numpy()),
        evaluation=model.evaluate(x, y, batch_size=64, verbose=0),
    )
    predictions = model.predict(x, batch_size=64, verbose=0)
    # Bad inputs, on the live strategy.
    errors = {}
    for name, call in {
        "no_steps": lambda: model.fit(train, epochs=1, verbose=0),
        "arrays": lambda: model.fit(x, y, epochs=1, steps_per_epoch=2, verbose=0),
        "batched": lambda: strategy.distribute_dataset(lambda ctx: dataset_fn(ctx).batch(4), per_replica_batch_size=4),
        "unbatched": lambda: strategy.distribute_dataset(dataset_fn),
        "predict_workers_data": lambda: model.predict(train, verbose=0),
    }.items():
        try:
            call()
            errors[name] = "no error"
        except Exception as e:  # noqa: BLE001 (reported to the test)
            errors[name] = f"{type(e).__name__}: {e}"
    report["errors"] = errors
    report["dropout_masks"] = dropout_masks_by_worker(strategy)
    # Whole tensors out of the sharded embedding, and back into a model outside the cluster.
    path = os.path.join(out, "model.keras")
    model.save(path)
    weights = [np.asarray(w) for w in model.get_weights()]
    restored = keras.models.load_model(path)
    report["restored_matches"] = all(
        np.array_equal(a, np.asarray(b)) for a, b in zip(weights, restored.get_weights())
    )
    report["restored_predictions_match"] = bool(
        np.allclose(restored.predict(x, batch_size=64, verbose=0), predictions, atol=1e-6)
    )
    # And back into the sharded variables: a fresh model on the cluster loads the file.
    with strategy.scope():
        reloaded = build_model()
    reloaded.load_weights(path)
    report["reloaded_matches"] = all(
        np.array_equal(a, np.asarray(b)) for a, b in zip(weights, reloaded.get_weights())
    )
    np.savez(os.path.join(out, "chief.npz"), *weights, predictions=predictions)
    # One more epoch without validation (which would reset the metrics): its metric state,
    # on the parameter servers, is what the history reports.
    more = model.fit(train, epochs=1, steps_per_epoch=5, verbose=0)
    report["more_loss"] = more.history["loss"]
    report["metric_state"] = {v.path: float(v.numpy()) for v in model.metrics_variables}
    return report


def partition_mode(strategy, out: str) -> dict:
    """A large embedding split over both parameter servers: saved and loaded whole."""
    x, y = data()
    with strategy.scope():
        model = build_model()
        model.compile(keras.optimizers.SGD(0.3), "mse")
    embedding = model.layers[0].embeddings
    report = {"shards": [[v.device, list(v.shape)] for v in embedding.value.variables]}
    train = strategy.distribute_dataset(dataset_fn, per_replica_batch_size=16)
    try:
        model.fit(train, epochs=1, steps_per_epoch=2, verbose=0)
        report["trainable_fit"] = "no error"
    except NotImplementedError as e:
        report["trainable_fit"] = str(e)
    model.layers[0].trainable = False  # a frozen (e.g. pretrained) embedding trains the rest
    model.compile(keras.optimizers.SGD(0.3), "mse")
    report["history"] = model.fit(train, epochs=2, steps_per_epoch=10, verbose=0).history
    predictions = model.predict(x, batch_size=64, verbose=0)
    path = os.path.join(out, "model.keras")
    model.save(path)
    restored = keras.models.load_model(path)
    report["restored_embedding_shape"] = list(restored.layers[0].embeddings.shape)
    report["restored_matches"] = all(
        np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(model.get_weights(), restored.get_weights())
    )
    report["restored_predictions_match"] = bool(
        np.allclose(restored.predict(x, batch_size=64, verbose=0), predictions, atol=1e-6)
    )
    with strategy.scope():
        reloaded = build_model()
    reloaded.load_weights(path)
    report["reloaded_sharded"] = len(reloaded.layers[0].embeddings.value.variables)
    report["reloaded_matches"] = all(
        np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(model.get_weights(), reloaded.get_weights())
    )
    return report


def faults_mode(strategy, out: str) -> dict:
    x, y = data()
    with strategy.scope():
        model = build_model()
        model.count_steps(strategy.num_workers)
        model.compile(faults_optimizer(), "mse", steps_per_execution=2)
    train = strategy.distribute_dataset(dataset_fn, per_replica_batch_size=16)
    hold = os.environ.get("KR_TEST_HOLD_AT_EPOCH")
    progress = Progress(
        sleep_per_batch=float(os.environ.get("KR_TEST_SLEEP_PER_BATCH", "0.05")),
        hold_at_epoch=int(hold) if hold else None,
        release=os.path.join(out, "release"),
    )
    counts: list = []
    record = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: counts.append(model.steps_by_worker.numpy().tolist())
    )
    epochs = int(os.environ.get("KR_TEST_EPOCHS", "6"))
    callbacks = [record, keras.callbacks.BackupAndRestore(os.path.join(out, "backup"))]
    returning = os.environ.get("KR_TEST_UNTIL_WORKER_STEPS")
    if returning:
        callbacks.append(UntilWorkerSteps(model, counts, int(returning), epochs, int(hold)))
        epochs = UntilWorkerSteps.MAX_EPOCHS
    report: dict = {"epochs_run": progress.epochs, "steps_by_worker": counts}
    try:
        history = model.fit(
            train, epochs=epochs, steps_per_epoch=40, verbose=0,
            # Progress last: when it prints "epoch E done", the backup of epoch E is written.
            callbacks=[*callbacks, progress],
        )
    except kr.errors.ParameterServerLostError as e:
        report.update(error=str(e), lost=e.lost_parameter_servers, failed_at=time.time())
        return report
    report.update(
        history=history.history,
        iterations=int(model.optimizer.iterations.numpy()),
        evaluation=model.evaluate(x, y, batch_size=128, verbose=0),
    )
    model.save(os.path.join(out, "model.keras"))
    return report


class RecordWeights(keras.callbacks.Callback):
    """Writes the model's weights and update count to ``OUT_DIR/{name}{epoch}.npz``: at each
    epoch's end (``name="epoch"``; placed before `BackupAndRestore`, so what its backup holds),
    or at the start of training (``name="restored"``, after it: what it restored, as epoch -1)."""

    def __init__(self, out: str, name: str):
        super().__init__()
        self.out, self.name = out, name

    def _write(self, epoch: int) -> None:
        arrays = {f"w{i}": np.asarray(w) for i, w in enumerate(self.model.get_weights())}
        arrays["iterations"] = np.asarray(int(self.model.optimizer.iterations.numpy()))
        np.savez(os.path.join(self.out, f"{self.name}{epoch}.npz"), **arrays)

    def on_train_begin(self, logs=None):
        if self.name == "restored":
            self._write(-1)

    def on_epoch_end(self, epoch, logs=None):
        if self.name == "epoch":
            self._write(epoch)


def backup_mode(strategy, out: str) -> dict:
    """``KR_TEST_EPOCHS`` epochs (4 by default) of 4 steps, backed up after each; a kill during a
    save comes from ``KERAS_REPLICATOR_KILL_AT_SAVE`` (tests/test_async_crash_consistent_backups.py),
    or from ``KR_TEST_TEAR_SAVE=n``: the chief SIGKILLs itself as the n-th save writes the optimizer's state."""
    with strategy.scope():
        model = build_model()
        model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse")  # momentum: optimizer state
        model.optimizer.build(model.trainable_variables)
    tear = os.environ.get("KR_TEST_TEAR_SAVE")
    if tear:  # SIGKILL in the middle of the n-th weights file, without keras_replicator's hook
        original, calls = model.optimizer.save_own_variables, [0]

        def save_own_variables(store):
            calls[0] += 1
            if calls[0] == int(tear):
                os.kill(os.getpid(), signal.SIGKILL)
            return original(store)

        model.optimizer.save_own_variables = save_own_variables
    train = strategy.distribute_dataset(dataset_fn, per_replica_batch_size=16)
    progress = Progress()
    callbacks = [RecordWeights(out, "epoch"), keras.callbacks.BackupAndRestore(os.path.join(out, "backup")),
                 RecordWeights(out, "restored"), progress]
    epochs = int(os.environ.get("KR_TEST_EPOCHS", "4"))
    history = model.fit(train, epochs=epochs, steps_per_epoch=4, verbose=0, callbacks=callbacks)
    return {"epochs_run": progress.epochs, "history": history.history,
            "iterations": int(model.optimizer.iterations.numpy())}


def die_at_hold(out: str) -> None:
    """On the task named by ``KR_TEST_DIE_TASK`` (``"worker 1"``, ``"ps 0"``, ``"chief 0"``; first
    start only): SIGKILLs itself when the chief holds, after creating the release file (the
    chief goes on while it dies)."""
    task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})
    first_start = os.environ.get("KERAS_REPLICATOR_RESTART_COUNT", "0") == "0"
    if os.environ.get("KR_TEST_DIE_TASK") != f"{task.get('type')} {task.get('index')}" or not first_start:
        return

    def wait_and_die() -> None:
        release = os.path.join(out, "release")
        while not os.path.exists(release + ".holding"):
            time.sleep(0.05)
        print("dying now", flush=True)
        open(release, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait_and_die, daemon=True).start()


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    die_at_hold(out)
    partitioner = None
    if mode == "partition":  # the 3200-byte embedding in 2 shards; the 2048-byte kernel whole
        partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(min_shard_bytes=2100, max_shards=2)
    strategy = kr.AsyncReplicatorStrategy(
        variable_partitioner=partitioner,
        failure_timeout=float(os.environ.get("KR_TEST_FAILURE_TIMEOUT", "5")),
        shutdown_grace=2.0,
        startup_timeout=120,
    )
    started = time.time()
    modes = {"fit": fit_mode, "faults": faults_mode, "partition": partition_mode, "backup": backup_mode}
    report = modes[mode](strategy, out)
    report["seconds"] = time.time() - started
    report["num_workers"], report["num_ps"] = strategy.num_workers, strategy.num_ps
    with open(os.path.join(out, "chief.json"), "w") as f:
        json.dump(report, f)
    print("chief wrote its report", flush=True)
    sys.exit(3 if "error" in report else 0)


if __name__ == "__main__":
    main()
