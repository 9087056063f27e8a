"""The best ratio to one device that K replicas sharing one CPU's cores can reach, with no replication cost at all.

K replicas of a global batch B each run the whole model on B / K examples: every
weight-sized part of a step (the weight gradients, the optimizer update of each
copy) is done K times, and small batches use the cores less well. On simulated CPU
devices the replicas share the same cores, so even with no all-reduce, no
scheduling overhead and the replicas run one after the other, a replicated step
costs at least K times one device's step at batch B / K. This script measures that
bound on one device, with a plain `tf.function` training step (SGD with momentum,
constant inputs; no strategy, no `fit`):

    python -m benchmarks.replica_work [--models cnn resnet50 lm] [--repeats 10]

(``lm``: the peers' transformer LM with its AdamW, ``benchmarks.peers_worker``, on its token data)

and prints, for each model and K in 2, 4, the time of a step at B / K, K times
it over the time of a step at B, and its inverse: the highest "replicated /
one device" throughput ratio K replicas can reach on this machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from benchmarks.models import IMAGE_SIZE, build_model

# TensorFlow's C++ info and warnings off, as in the benchmark workers (benchmarks/worker.py).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

GLOBAL_BATCH = {"cnn": 128, "resnet50": 64, "lm": 32}  # as in `make bench` and the peers' LM


def step_seconds(model_name: str, batch: int, repeats: int) -> float:
    """Median seconds of one training step of `model_name` at `batch` on one device."""
    import keras
    import numpy as np
    import tensorflow as tf

    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if model_name == "lm":
        from benchmarks.peers_worker import SIZES, compiled, data

        model = compiled(keras, "lm", SIZES["full"]["lm"])
        optimizer = model.optimizer  # AdamW, as the peers run it
        x, y = (tf.constant(a) for a in data("lm", dict(SIZES["full"]["lm"], batch=batch, steps=1)))
    else:
        model = build_model(model_name)
        optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
        rng = np.random.default_rng(0)
        x = tf.constant(rng.normal(size=(batch, IMAGE_SIZE, IMAGE_SIZE, 3)).astype("float32"))
        y = tf.constant(rng.integers(0, 10, batch).astype("int32"))
    optimizer.build(model.trainable_variables)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    step(), step()  # trace, warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step().numpy()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["cnn", "resnet50"], choices=sorted(GLOBAL_BATCH))
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    print("| model | global batch | one device, ms | K | step at B/K, ms | K x it / one device | best ours / one device |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in args.models:
        batch = GLOBAL_BATCH[name]
        whole = step_seconds(name, batch, args.repeats)
        for k in (2, 4):
            part = step_seconds(name, batch // k, args.repeats)
            cost = k * part / whole
            print(f"| {name} | {batch} | {1000 * whole:.0f} | {k} | {1000 * part:.0f} | {cost:.2f}x | {1 / cost:.2f}x |",
                  flush=True)


if __name__ == "__main__":
    main()
