"""The cost of the padding path (issue 50) on full batches: the steady step with and without it.

    python -m benchmarks.short_batches [--rounds 6] [--steps 24] [--devices 4] [--output FILE]

Keras's batches are split with each replica's count of real rows (and an empty
slice padded: `keras_replicator._compat.short_batches`) whenever their size may
not divide among the replicas, which is every `fit` on NumPy arrays. On full
batches (64 rows on 4 replicas, every replica 16) that path only carries the
counts and multiplies the loss by 1. Two identical small CNNs (the demo's) are
fit in turns, one epoch each per round, one with the path (``enabled``) and one
without (the batches re-cut and split as before: ``short_batches.enabled =
False`` while its dataset is made); each epoch's median step time after a
warm-up is taken, and each round gives the paired ratio (steps per second with
the path over without). Prints and (``--output``) writes the ratios, their
median and spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _model(keras):
    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(64, 3, strides=2, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10),
    ])
    model.compile(keras.optimizers.Adam(1e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--output")
    args = parser.parse_args()

    import keras
    import numpy as np

    import keras_replicator as kr
    from keras_replicator._compat import short_batches

    kr.simulate_devices(args.devices)
    strategy = kr.ReplicatorStrategy()
    batch = 16 * strategy.num_replicas_in_sync
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * args.steps, 8, 8, 1)).astype("float32")
    y = rng.integers(0, 10, size=batch * args.steps)
    with strategy.scope():
        models = {True: _model(keras), False: _model(keras)}

    class Steps(keras.callbacks.Callback):
        def on_train_batch_begin(self, step, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, step, logs=None):
            self.times.append(time.perf_counter() - self.start)

    def step_time(padded: bool) -> float:
        timer = Steps()
        timer.times = []
        short_batches.enabled = padded
        try:
            models[padded].fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
        finally:
            short_batches.enabled = True
        return statistics.median(timer.times[args.warmup:])

    step_time(True), step_time(False)  # traced
    ratios, times = [], []
    for i in range(args.rounds):
        order = (True, False) if i % 2 == 0 else (False, True)
        measured = {padded: step_time(padded) for padded in order}
        times.append({"with": measured[True], "without": measured[False]})
        ratios.append(measured[False] / measured[True])
        print(f"round {i + 1}: step {measured[True] * 1e3:.2f} ms with the padding path, "
              f"{measured[False] * 1e3:.2f} ms without: ratio {ratios[-1]:.3f}", flush=True)
    result = {
        "devices": args.devices, "global_batch": batch, "steps_per_epoch": args.steps,
        "ratios": ratios, "median_ratio": statistics.median(ratios),
        "min_ratio": min(ratios), "max_ratio": max(ratios), "step_seconds": times,
    }
    print(f"steps/s with / without the padding path: median {result['median_ratio']:.3f} "
          f"(range {result['min_ratio']:.3f}-{result['max_ratio']:.3f}, {args.rounds} paired rounds)")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
