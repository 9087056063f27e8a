"""Minimal reproduction of the iterator stall (a new epoch waiting on tf.data autotuning threads), TensorFlow only: worth filing upstream.

Dropping a tf.data iterator joins its autotuning thread (`RootDataset::Iterator`,
"tf_data_model", running `model::Model::OptimizeLoop`). That thread sleeps for
an optimization period that doubles every round (10 ms, 20 ms, ... up to a
minute) and, when woken, checks `CancellationManager::IsCancelled()`.
`CancellationManager::StartCancel` runs the callback that wakes it *before* it
sets the cancelled flag, so a thread woken at once (likely on a busy machine
with few cores) reads "not cancelled" and sleeps out the rest of its period,
and the destructor waits for it. A distributed iterator on K devices has K + 1
such threads (one per device's iterator, one for the host pipeline), so
MirroredStrategy pays it at almost every new iterator (Keras: every epoch).

    python -m benchmarks.iterator_stall [--lifetime 1.5] [--rounds 6] [--devices 4]

prints, for each variant, the seconds each `del iterator` took after the
iterator had lived `--lifetime` seconds; without the race they take milliseconds.
Variants: a plain `iter(dataset)` on one device; `MirroredStrategy`'s distributed
iterator (TensorFlow's defaults); and the same with autotuning off in the
per-device datasets (what keras_replicator does, `_compat/multi_device_iterator.py`).
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lifetime", type=float, default=1.5)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--devices", type=int, default=4)
    args = parser.parse_args()

    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(args.devices)])
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(args.devices)])
    dataset = tf.data.Dataset.range(10**9).map(lambda i: tf.fill([8], i)).batch(4 * args.devices)

    def drop_times(make) -> list[float]:
        times = []
        for _ in range(args.rounds):
            iterator = make()
            next(iterator)
            time.sleep(args.lifetime)
            start = time.perf_counter()
            del iterator
            times.append(round(time.perf_counter() - start, 3))
        return times

    print("plain iter(dataset), one device:", drop_times(lambda: iter(dataset)), flush=True)
    distributed = strategy.experimental_distribute_dataset(dataset)
    print(f"MirroredStrategy, {args.devices} devices:", drop_times(lambda: iter(distributed)),
          flush=True)
    # The work-around: no autotuning in the per-device datasets (they have nothing to tune).
    from tensorflow.python.data.ops import multi_device_iterator_ops as ops

    create = ops._create_device_dataset

    def without_autotune(*a, **k):
        options = tf.data.Options()
        options.autotune.enabled = False
        return create(*a, **k).with_options(options)

    ops._create_device_dataset = without_autotune
    print(f"MirroredStrategy, {args.devices} devices, per-device autotuning off:",
          drop_times(lambda: iter(distributed)), flush=True)


if __name__ == "__main__":
    main()
