"""Input-pipeline throughput: keras_replicator's sharded pipeline next to unsharded ones.

Measures examples per second, on 4 simulated CPU replicas, of:

* ``tf.data`` alone (batched, not distributed): the ceiling;
* TensorFlow's ``experimental_distribute_dataset`` (stock splitting);
* ``ReplicatorStrategy.distribute_dataset`` (exactly once, no empty replica);
* one input pipeline of two (what one worker of two reads), sharded by data and by
  file, next to the unsharded single pipeline over the same TFRecord files.

Each distributed variant is consumed by a ``strategy.run`` step that touches every
replica's slice, so the copy to each replica's device is included.

Usage::

    python -m benchmarks.input_pipeline [--quick] [--output results.json]

``run(quick)`` runs the measurement in a fresh interpreter (it needs its own 4 CPU
devices) and returns the results as a dict.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

GLOBAL_BATCH = 256
REPLICAS = 4
IMAGE = (32, 32, 3)


def _source(num_examples: int):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(num_examples, *IMAGE), dtype=np.uint8)
    labels = rng.integers(0, 10, size=(num_examples,), dtype=np.int32)
    return tf.data.Dataset.from_tensor_slices((images, labels)).map(_preprocess, num_parallel_calls=tf.data.AUTOTUNE)


def _preprocess(image, label):
    import tensorflow as tf

    return tf.image.flip_left_right(tf.cast(image, tf.float32) / 255.0), label


def _write_records(folder: str, num_examples: int, num_files: int = 8) -> list[str]:
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(1)
    files = [os.path.join(folder, f"part-{i:02d}.tfrecord") for i in range(num_files)]
    writers = [tf.io.TFRecordWriter(f) for f in files]
    for i in range(num_examples):
        image = rng.integers(0, 256, size=IMAGE, dtype=np.uint8)
        writers[i % num_files].write(tf.io.serialize_tensor(tf.constant(image)).numpy())
    for w in writers:
        w.close()
    return files


def _records(files):
    import tensorflow as tf

    def parse(record):
        image = tf.ensure_shape(tf.io.parse_tensor(record, tf.uint8), IMAGE)
        return _preprocess(image, tf.constant(0, tf.int32))

    ds = tf.data.Dataset.from_tensor_slices(files).interleave(
        tf.data.TFRecordDataset, cycle_length=4, num_parallel_calls=tf.data.AUTOTUNE
    )
    return ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE)


def _host_runner(dataset):
    """One epoch of consuming ``dataset`` (of batches) inside TensorFlow; returns examples/s."""
    import tensorflow as tf

    def add_rows(total, batch):
        return total + tf.shape(batch[0], out_type=tf.int64)[0]

    dataset.take(2).reduce(tf.constant(0, tf.int64), add_rows)  # warm-up

    def epoch() -> float:
        start = time.perf_counter()
        count = int(dataset.reduce(tf.constant(0, tf.int64), add_rows))
        return count / (time.perf_counter() - start)

    return epoch


def _distributed_runner(strategy, distributed):
    """One epoch of a ``strategy.run`` step over ``distributed``; returns examples/s."""
    import tensorflow as tf

    @tf.function
    def step(batch):
        def replica(images, labels):
            return tf.cast(tf.shape(images)[0], tf.float32) + 0.0 * tf.reduce_sum(images)

        return strategy.reduce("sum", strategy.run(replica, args=batch), axis=None)

    for batch in distributed:  # warm-up: trace
        step(batch)
        break

    def epoch() -> float:
        count, start = 0.0, time.perf_counter()
        for batch in distributed:
            count += float(step(batch))
        return count / (time.perf_counter() - start)

    return epoch


def measure(quick: bool = False) -> dict:
    """Runs the measurements in this interpreter (splits the CPU into 4 devices first).

    Every variant runs one epoch per trial, trials interleaved (so that a busy machine
    slows all variants alike); the best and the median trial are reported.
    """
    import statistics

    import keras_replicator as kr

    kr.simulate_devices(REPLICAS)
    import tensorflow as tf

    num_examples = 2048 if quick else 8192
    trials = 3 if quick else 5
    strategy = kr.ReplicatorStrategy()
    source = _source(num_examples)
    runners = {
        "tf.data alone (host, not distributed)": _host_runner(source.batch(GLOBAL_BATCH).prefetch(tf.data.AUTOTUNE)),
        "tf.distribute experimental_distribute_dataset, 4 replicas": _distributed_runner(
            strategy,
            tf.distribute.Strategy.experimental_distribute_dataset(
                strategy, source.batch(GLOBAL_BATCH).prefetch(tf.data.AUTOTUNE)
            ),
        ),
        "keras_replicator distribute_dataset, 4 replicas": _distributed_runner(
            strategy, strategy.distribute_dataset(source, global_batch_size=GLOBAL_BATCH)
        ),
    }
    with tempfile.TemporaryDirectory() as folder:
        files = _write_records(folder, num_examples)
        for label, pipelines, policy in (
            ("TFRecords, 1 pipeline (unsharded)", 1, "off"),
            ("TFRecords, pipeline 0 of 2, shard by data", 2, "data"),
            ("TFRecords, pipeline 0 of 2, shard by file", 2, "file"),
        ):
            input_fn = kr.data.make_input_fn(_records(files), global_batch_size=GLOBAL_BATCH, shard_policy=policy)
            runners[f"{label} (host)"] = _host_runner(input_fn(tf.distribute.InputContext(pipelines, 0, REPLICAS)))
        samples: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(trials):
            for name, epoch in runners.items():
                samples[name].append(epoch())
    return {
        "benchmark": "input_pipeline",
        "quick": quick,
        "replicas": REPLICAS,
        "global_batch_size": GLOBAL_BATCH,
        "examples_per_epoch": num_examples,
        "image_shape": list(IMAGE),
        "trials": trials,
        "unit": "examples/s",
        "results": {k: round(max(v), 1) for k, v in samples.items()},
        "median": {k: round(statistics.median(v), 1) for k, v in samples.items()},
        "notes": (
            "results: best trial; median: median trial. Host rows consume one input pipeline's "
            "per-replica batches inside TensorFlow (Dataset.reduce), without a model; "
            "'pipeline 0 of 2' counts only the examples that pipeline delivers (half the data). "
            "Shard by data reads every record and keeps its slices; shard by file reads half "
            "the files. Simulated CPU devices share the host's cores."
        ),
    }


def run(quick: bool = False) -> dict:
    """Measures in a fresh interpreter (own device configuration); returns the results."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    args = [sys.executable, "-m", "benchmarks.input_pipeline", "--json-only"] + (["--quick"] if quick else [])
    done = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"benchmarks.input_pipeline failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _table(result: dict) -> str:
    width = max(len(k) for k in result["results"])
    lines = [f"Input pipeline, global batch {result['global_batch_size']}, {result['replicas']} replicas"]
    lines[0] += f" (best / median of {result['trials']} epochs)"
    lines += [
        f"  {name:<{width}}  {value:>10,.0f} / {result['median'][name]:>10,.0f} examples/s"
        for name, value in result["results"].items()
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer examples and repeats")
    parser.add_argument("--output", help="also write the JSON result to this file")
    parser.add_argument("--json-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    result = measure(args.quick)
    if args.json_only:
        print(json.dumps(result))
        return 0
    print(_table(result))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
