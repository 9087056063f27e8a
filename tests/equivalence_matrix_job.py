"""The cells of tests/test_equivalence_matrix.py: one training per input x optimizer (not a test module).

Usage::

    python tests/equivalence_matrix_job.py one OUT.json      # one device, no strategy (the reference)
    python tests/equivalence_matrix_job.py workers OUT_DIR   # each of 2 launched workers x 2 devices (AdamW, schedule)

Each cell trains the same 2-layer MLP for 3 epochs of 8 batches of 16 and records
`optimizer.iterations` and the final weights. The test module imports `train_cells`
for the paths it runs in its own process (4 replicas).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

# Inputs: known cardinality (arrays, a batched dataset, repeat() with steps_per_epoch,
# arrays whose last batch is short) and unknown (a generator, a filtered dataset).
INPUTS = ("arrays", "dataset", "generator", "filtered", "repeat", "short_last")
OPTIMIZERS = ("sgd", "adamw", "schedule")
# The 2-worker job's: "schedule" is SGD itself, its learning rate read from `iterations`
# (halving every 4 steps, still 1.5e-3 at the end: a wrong step moves the weights far beyond
# the test's 1e-6), so a plain SGD cell there would run the same code again for each input.
WORKER_OPTIMIZERS = ("adamw", "schedule")
BATCH, STEPS, EPOCHS, FEATURES = 16, 8, 3, 6


def _data(n: int):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 1)) + 0.1).astype("float32")
    return x, y


def fit_arguments(kind: str) -> dict:
    """`fit`'s data arguments for the input `kind`."""
    n = BATCH * STEPS - (BATCH // 2 if kind == "short_last" else 0)  # 7 batches of 16 and one of 8
    x, y = _data(n)
    if kind in ("arrays", "short_last"):
        return dict(x=x, y=y, batch_size=BATCH, shuffle=False)
    if kind == "dataset":
        return dict(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH))
    if kind == "repeat":
        return dict(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat(), steps_per_epoch=STEPS)
    if kind == "filtered":  # keeps every row, but tf.data no longer knows how many
        return dict(x=tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True).batch(BATCH))
    if kind == "generator":
        def batches():
            for i in range(0, n, BATCH):
                yield x[i:i + BATCH], y[i:i + BATCH]

        spec = (tf.TensorSpec([None, FEATURES]), tf.TensorSpec([None, 1]))
        return dict(x=tf.data.Dataset.from_generator(batches, output_signature=spec))
    raise ValueError(kind)


def make_optimizer(kind: str) -> keras.optimizers.Optimizer:
    if kind == "sgd":
        return keras.optimizers.SGD(0.05)
    if kind == "adamw":  # reads iterations: bias correction
        return keras.optimizers.AdamW(0.01, weight_decay=0.01)
    # reads iterations: the learning rate halves every 4 steps
    return keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.1, 4, 0.5, staircase=True))


def train_cells(strategy=None, steps_per_execution: int = 1, inputs=INPUTS, optimizers=OPTIMIZERS) -> dict:
    """{"input/optimizer": {"iterations": int, "weights": [array lists]}} for every cell.

    One model per optimizer, its weights and optimizer variables set back to their
    first values before each input (a new model per cell would trace its step again).
    """
    cells = {}
    for optimizer in optimizers:
        keras.utils.set_random_seed(1)
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(8, activation="tanh"),
                                      keras.layers.Dense(1)])
            model.compile(make_optimizer(optimizer), "mse", steps_per_execution=steps_per_execution)
            model.optimizer.build(model.trainable_variables)
        first = [v.numpy() for v in model.variables + model.optimizer.variables]
        for kind in inputs:
            for variable, value in zip(model.variables + model.optimizer.variables, first):
                variable.assign(value)
            model.fit(**fit_arguments(kind), epochs=EPOCHS, verbose=0)
            cells[f"{kind}/{optimizer}"] = {"iterations": int(model.optimizer.iterations.numpy()),
                                            "weights": [w.tolist() for w in model.get_weights()]}
    return cells


CUSTOM_LOOPS = ("generator/adamw/next", "dataset/adamw/next", "generator/adamw/for")


def train_custom_loop(strategy=None, cell: str = "generator/adamw/next") -> dict:
    """A cell ("input/optimizer/loop") in a custom loop: with "next", `strategy.run(step,
    args=next(iterator))` inside a `tf.function`, each epoch ended by the `OutOfRangeError`
    of its last call; with "for", `for batch in dataset: strategy.run(step, args=batch)`
    inside a `tf.function` (no call fails). Also records how far apart the replicas'
    copies of the weights are ("replica_gap", 0 on one device)."""
    kind, optimizer_kind, loop = cell.split("/")
    strategy = strategy or tf.distribute.get_strategy()
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(1)])
        optimizer = make_optimizer(optimizer_kind)
        optimizer.build(model.trainable_variables)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum((model(x) - y) ** 2) / BATCH
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    @tf.function
    def train(iterator):
        return strategy.run(step, args=next(iterator))

    @tf.function
    def train_epoch(dataset):
        for batch in dataset:
            strategy.run(step, args=batch)

    data = strategy.experimental_distribute_dataset(fit_arguments(kind)["x"])
    for _ in range(EPOCHS):
        if loop == "for":
            train_epoch(data)
            continue
        iterator = iter(data)
        while True:
            try:
                train(iterator)
            except tf.errors.OutOfRangeError:
                break
    gap = 0.0
    for v in model.weights + optimizer.variables:
        copies = [c.numpy() for c in strategy.experimental_local_results(v)]
        gap = max([gap] + [float(np.max(np.abs(c - copies[0]))) for c in copies[1:]])
    return {"iterations": int(optimizer.iterations.numpy()), "weights": [w.tolist() for w in model.get_weights()],
            "replica_gap": gap}


def main(argv: list[str]) -> None:
    mode, out = argv
    if mode == "one":
        results = {"spe1": train_cells(), "spe3": train_cells(steps_per_execution=3),
                   "loop": {cell: train_custom_loop(cell=cell) for cell in CUSTOM_LOOPS}}
        with open(out, "w") as f:
            json.dump(results, f)
        return
    import keras_replicator as kr

    strategy = kr.ReplicatorStrategy()  # the launcher's cluster: 2 workers x 2 devices
    results = train_cells(strategy, optimizers=WORKER_OPTIMIZERS)
    with open(os.path.join(out, f"worker{strategy.worker_index}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1:])
