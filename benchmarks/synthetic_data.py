"""The synthetic datasets the training benchmarks read: random images and labels, repeated."""

from __future__ import annotations

from benchmarks.models import IMAGE_SIZE, NUM_CLASSES, SNGAN_IMAGE_SIZE, SNGAN_N_DIS


def synthetic_dataset(global_batch: int):
    """Normal images at the benchmarks' image size with int labels, batched ``global_batch``."""
    import numpy as np

    rng = np.random.default_rng(0)
    n = 4 * global_batch
    x = rng.normal(size=(n, IMAGE_SIZE, IMAGE_SIZE, 3)).astype("float32")
    y = rng.integers(0, NUM_CLASSES, size=(n,)).astype("int32")
    return _repeated_batches(x, y, global_batch)


def sngan_dataset(global_batch: int):
    """Synthetic images in [-1, 1] with int labels, batched ``n_dis x global_batch`` as
    ``sngan.digits_dataset`` batches the digits (one batch per generator update)."""
    import numpy as np

    rng = np.random.default_rng(0)
    n = 4 * SNGAN_N_DIS * global_batch
    x = rng.uniform(-1.0, 1.0, size=(n, SNGAN_IMAGE_SIZE, SNGAN_IMAGE_SIZE, 1)).astype("float32")
    y = rng.integers(0, NUM_CLASSES, size=(n,)).astype("int32")
    return _repeated_batches(x, y, SNGAN_N_DIS * global_batch)


def token_dataset(global_batch: int):
    """The peers' LM data (``benchmarks.peers_worker.data``): token ids and their next tokens,
    batched ``global_batch``."""
    from benchmarks.peers_worker import SIZES, data

    sizes = dict(SIZES["full"]["lm"], batch=global_batch, steps=4)
    return _repeated_batches(*data("lm", sizes), global_batch)


def _repeated_batches(x, y, batch: int):
    """``(x, y)`` repeated forever in batches of ``batch``, prefetched."""
    import tensorflow as tf

    return (
        tf.data.Dataset.from_tensor_slices((x, y))
        .repeat()
        .batch(batch, drop_remainder=True)
        .prefetch(tf.data.AUTOTUNE)
    )
