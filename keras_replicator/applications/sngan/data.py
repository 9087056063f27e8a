"""SN-GAN input pipelines: scikit-learn's digits (small scale) and ImageNet 128x128.

Images are NHWC float32 in [-1, 1] (the generator's tanh range), labels int32.
A training step of `SNGAN` consumes `n_dis * global_batch_size` real examples
(one batch per discriminator update), so the datasets here are batched by that.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tensorflow as tf

from keras_replicator._validation import ArgumentError, check_bool, check_int
from keras_replicator.applications import imagenet

__all__ = [
    "DIGITS_CLASSES",
    "digits",
    "digits_dataset",
    "imagenet_dataset",
    "imagenet_input_fn",
    "preprocess_imagenet",
]

DIGITS_CLASSES = 10


def digits(image_size: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1,797 8x8 digits, upsampled (bilinear) to `image_size`, in [-1, 1].

    Returns:
        `(images, labels)`: float32 `(1797, image_size, image_size, 1)` and int32 `(1797,)`.

    Example:
        ```python
        x, y = kr.applications.sngan.digits(32)
        ```
    """
    from sklearn.datasets import load_digits

    image_size = check_int("image_size", image_size, minimum=8)
    bunch = load_digits()
    x = bunch.images.astype(np.float32)[..., None] / 8.0 - 1.0  # 0..16 -> -1..1
    x = tf.image.resize(x, [image_size, image_size], method="bilinear").numpy()
    return np.clip(x, -1.0, 1.0).astype(np.float32), bunch.target.astype(np.int32)


def _check_batches(global_batch_size, n_dis, num_replicas) -> tuple[int, int]:
    global_batch_size = check_int("global_batch_size", global_batch_size, minimum=1)
    n_dis = check_int("n_dis", n_dis, minimum=1)
    num_replicas = check_int("num_replicas", num_replicas, minimum=1)
    if global_batch_size % num_replicas:
        raise ArgumentError(
            f"global_batch_size={global_batch_size} is not divisible by the number of "
            f"replicas ({num_replicas})."
        )
    return global_batch_size, n_dis


def digits_dataset(
    global_batch_size: int,
    n_dis: int = 5,
    *,
    image_size: int = 32,
    num_replicas: int = 1,
    seed: int = 0,
    shuffle: bool = True,
    data: tuple[np.ndarray, np.ndarray] | None = None,
) -> tf.data.Dataset:
    """Endless shuffled digits in batches of `n_dis * global_batch_size` for `SNGAN.fit`.

    Args:
        global_batch_size: examples per discriminator update, over all replicas.
        n_dis: discriminator updates per step.
        image_size: side of the images.
        num_replicas: the replicas that will share each batch (checked to divide it).
        seed: the shuffling seed.
        shuffle: shuffle (each pass anew); `False` keeps the order of `data`.
        data: `(images, labels)` to use instead of `digits(image_size)`.

    Example:
        ```python
        from keras_replicator.applications import sngan

        ds = sngan.digits_dataset(64, n_dis=5, num_replicas=2)
        images, labels = next(iter(ds))   # (320, 32, 32, 1) in [-1, 1] and (320,): 5 batches of 64
        # gan.fit(ds, steps_per_epoch=100): each step makes 5 discriminator updates
        ```
    """
    global_batch_size, n_dis = _check_batches(global_batch_size, n_dis, num_replicas)
    x, y = data if data is not None else digits(image_size)
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    if check_bool("shuffle", shuffle):
        ds = ds.shuffle(len(x), seed=seed, reshuffle_each_iteration=True)
    ds = ds.repeat()
    return ds.batch(n_dis * global_batch_size, drop_remainder=True).prefetch(2)


def preprocess_imagenet(image: tf.Tensor, image_size: int = 128) -> tf.Tensor:
    """The central square of an image (decoded or JPEG bytes), resized, in [-1, 1].

    Example:
        ```python
        import tensorflow as tf
        from keras_replicator.applications.sngan import preprocess_imagenet

        images = tf.zeros((2, 300, 400, 3), tf.uint8)      # or JPEG bytes
        ds = tf.data.Dataset.from_tensor_slices((images, [7, 3]))
        ds = ds.map(lambda image, label: (preprocess_imagenet(image), label))
        image, label = next(iter(ds))   # (128, 128, 3): the central 300x300, resized; black is -1.0
        ```
    """
    return imagenet.preprocess_for_eval(
        image, image_size=image_size, crop_fraction=1.0, mean=(127.5,), stddev=(127.5,)
    )


def imagenet_input_fn(
    split: str = "train",
    *,
    image_size: int = 128,
    data_dir: str | None = None,
    seed: int = 0,
    shuffle_buffer: int = 10_000,
) -> Callable[[tf.distribute.InputContext | None], tf.data.Dataset]:
    """TFDS `imagenet2012` with labels, center-cropped and resized, for `distribute_dataset`.

    Files are sharded per input pipeline as in `applications.imagenet.input_fn`
    (`tfds.ReadConfig(input_context=ctx)`: each worker reads its own files);
    examples are shuffled, repeated, unbatched. ImageNet must be prepared by hand
    (see `applications.imagenet.input_fn`).

    Example:
        ```python
        train = strategy.distribute_dataset(
            sngan.imagenet_input_fn(data_dir="~/tensorflow_datasets"),
            global_batch_size=5 * 256)
        ```
    """
    if not isinstance(split, str) or not split:
        raise ArgumentError(f"split must be a TFDS split name such as 'train', got {split!r}.")
    image_size = check_int("image_size", image_size, minimum=1)
    shuffle_buffer = check_int("shuffle_buffer", shuffle_buffer, minimum=1)

    def fn(ctx: tf.distribute.InputContext | None = None) -> tf.data.Dataset:
        import tensorflow_datasets as tfds

        pipeline = ctx.input_pipeline_id if ctx is not None else 0
        ds = tfds.load(
            "imagenet2012", split=split, data_dir=data_dir, as_supervised=True,
            shuffle_files=True, decoders={"image": tfds.decode.SkipDecoding()},
            read_config=tfds.ReadConfig(input_context=ctx, shuffle_seed=seed + pipeline),
        )
        ds = ds.shuffle(shuffle_buffer, seed=seed + pipeline).repeat()
        return ds.map(
            lambda image, label: (preprocess_imagenet(image, image_size), tf.cast(label, tf.int32)),
            num_parallel_calls=tf.data.AUTOTUNE,
        )

    return fn


def imagenet_dataset(
    strategy: tf.distribute.Strategy,
    global_batch_size: int,
    n_dis: int = 5,
    **kwargs,
) -> tf.distribute.DistributedDataset:
    """ImageNet batched by `n_dis * global_batch_size` and distributed by `strategy`.

    `kwargs` go to `imagenet_input_fn`.

    Example:
        ```python
        train = sngan.imagenet_dataset(strategy, 256, n_dis=5, data_dir="/data/tfds")
        gan.fit(train, steps_per_epoch=1000)
        ```
    """
    global_batch_size, n_dis = _check_batches(
        global_batch_size, n_dis, strategy.num_replicas_in_sync)
    return strategy.distribute_dataset(
        imagenet_input_fn(**kwargs), global_batch_size=n_dis * global_batch_size,
        drop_remainder=True)
