"""Reading a TensorFlow Datasets data set for replicated training, shared by the tutorials.

`sharded_dataset` is the input side every tutorial needs: each input pipeline
(one per worker, described by `tf.distribute.InputContext`) reads its own share
of the data set's files, and for training shuffles, repeats and pairs every
example with its own random seed for stateless augmentation. The tutorials
add their own transforms on top (`keras_replicator.applications.imagenet` for
ResNet-50; the GAN tutorial reuses the same reader).

Example:
    ```python
    import tensorflow as tf
    import keras_replicator as kr
    from keras_replicator.applications import tfds_input

    strategy = kr.ReplicatorStrategy()

    def augment(image, seed):                 # the same flip whatever the pipeline's parallelism
        return tf.image.stateless_random_flip_left_right(image, seed)

    def input_fn(ctx=None):
        ds = tfds_input.sharded_dataset("cifar10", "train", ctx, training=True, seed=0)
        return ds.map(lambda example, seed: (augment(example[0], seed), example[1]))

    train = strategy.distribute_dataset(input_fn, global_batch_size=256)
    ```
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from keras_replicator._validation import ArgumentError, check_bool, check_int

__all__ = ["example_seeds", "sharded_dataset"]


def example_seeds(seed: int) -> tf.data.Dataset:
    """An endless dataset of per-example `[2]` seeds, new ones at every pass.

    Zip it with a dataset of examples to give each example its own random
    crop and flip; the sequence is fixed by `seed`.

    Example:
        ```python
        import tensorflow as tf
        from keras_replicator.applications.tfds_input import example_seeds

        images = tf.data.Dataset.range(3)               # stands for 3 images
        ds = tf.data.Dataset.zip(images, example_seeds(0))
        [seed.shape for _, seed in ds]                  # three [2] int64 seeds, new ones each pass
        ```
    """
    check_int("seed", seed)
    return tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True).batch(2)


def sharded_dataset(
    name: str,
    split: str,
    ctx: tf.distribute.InputContext | None = None,
    *,
    training: bool,
    data_dir: str | None = None,
    seed: int = 0,
    shuffle_buffer: int = 16_384,
    decoders: Any = None,
    as_supervised: bool = True,
) -> tf.data.Dataset:
    """This input pipeline's share of a prepared TFDS data set, unbatched.

    The files of `split` are divided between the input pipelines `ctx`
    describes (`tfds.ReadConfig(input_context=ctx)`): every worker reads its
    own files, and together they read each example once per pass. For
    training the files and the examples are shuffled (seeds derived from
    `seed` and the pipeline's id), the data repeats forever, and every example
    comes with its own `[2]` seed (`example_seeds`): the elements are
    `(example, seed)`. For evaluation the elements are the examples, once.
    Needs `tensorflow-datasets` (`pip install tensorflow-datasets`, or the clone's `pip install ".[datasets]"`).

    Example:
        ```python
        import tensorflow_datasets as tfds
        from keras_replicator.applications.tfds_input import sharded_dataset

        def input_fn(ctx=None):   # ImageNet with the JPEG bytes kept, for a decode-and-crop
            return sharded_dataset("imagenet2012", "train", ctx, training=True,
                                   decoders={"image": tfds.decode.SkipDecoding()})
        ```

    Args:
        name: the TFDS name, e.g. `"imagenet2012"`.
        split: a split or slice of it, e.g. `"train[:1%]"`.
        ctx: the input pipeline's context; None for one pipeline.
        training: shuffle, repeat and add per-example seeds.
        data_dir: where the prepared data set is; None for TFDS's default.
        seed: the seed everything random derives from.
        shuffle_buffer: examples in the shuffle buffer (training).
        decoders: TFDS decoders, e.g. `{"image": tfds.decode.SkipDecoding()}`
            to keep JPEG bytes for a decode-and-crop.
        as_supervised: `(input, label)` pairs rather than feature dicts.

    Returns:
        A `tf.data.Dataset`.

    Raises:
        ValueError: an argument is out of range (checked before any data is read).
    """
    if not isinstance(name, str) or not name:
        raise ArgumentError(f"name must be a TFDS data set name such as 'mnist', got {name!r}.")
    if not isinstance(split, str) or not split:
        raise ArgumentError(f"split must be a TFDS split name such as 'train', got {split!r}.")
    training = check_bool("training", training)
    seed = check_int("seed", seed)
    shuffle_buffer = check_int("shuffle_buffer", shuffle_buffer, minimum=1)
    import tensorflow_datasets as tfds

    pipeline = ctx.input_pipeline_id if ctx is not None else 0
    read_config = tfds.ReadConfig(input_context=ctx, shuffle_seed=seed + pipeline)
    ds = tfds.load(
        name,
        split=split,
        data_dir=data_dir,
        as_supervised=as_supervised,
        shuffle_files=training,
        decoders=decoders,
        read_config=read_config,
    )
    if not training:
        return ds
    ds = ds.shuffle(shuffle_buffer, seed=seed + pipeline).repeat()
    return tf.data.Dataset.zip(ds, example_seeds(seed + 7919 * (pipeline + 1)))
