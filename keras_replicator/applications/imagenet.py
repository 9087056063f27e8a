"""ImageNet for replicated training: the TFDS input pipeline and its transforms.

The pipeline reads TFDS's `imagenet2012` (which must be prepared by hand, see
`input_fn`), each input pipeline its own files (`keras_replicator.applications.tfds_input`),
and applies the transforms of the reference ResNet
implementations: for training an Inception-style random-resized crop (a random
box covering 8% to 100% of the image with aspect ratio 3/4 to 4/3, decoded
straight from the JPEG) and a random horizontal flip; for evaluation the
central 87.5% of the image, resized (the "resize to 256, crop 224" rule).
Random choices are stateless, drawn from a per-example seed, so a pipeline is
reproducible for a given seed whatever its parallelism.

The data set serves more than one tutorial, so it lives beside the models
rather than in one of them; ResNet-50's training recipe is
`keras_replicator.applications.resnet.Recipe`.

Example:
    ```python
    import keras_replicator as kr
    from keras_replicator.applications import imagenet

    strategy = kr.ReplicatorStrategy()
    train = strategy.distribute_dataset(
        imagenet.input_fn("train"), global_batch_size=256 * strategy.num_replicas_in_sync)
    ```
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from keras_replicator._validation import ArgumentError, check_bool, check_int, check_number
from keras_replicator.applications.tfds_input import example_seeds, sharded_dataset

__all__ = [
    "MEAN_RGB",
    "NUM_CLASSES",
    "NUM_EVAL_EXAMPLES",
    "NUM_TRAIN_EXAMPLES",
    "STDDEV_RGB",
    "example_seeds",
    "input_fn",
    "preprocess_for_eval",
    "preprocess_for_train",
]

# Per-channel mean and standard deviation of ImageNet's training images (RGB, 0..255).
MEAN_RGB = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STDDEV_RGB = (0.229 * 255, 0.224 * 255, 0.225 * 255)

NUM_CLASSES = 1000
NUM_TRAIN_EXAMPLES = 1_281_167
NUM_EVAL_EXAMPLES = 50_000


def _check_image_size(image_size: Any) -> int:
    return check_int("image_size", image_size, minimum=1)


def _check_crop_fraction(crop_fraction: Any) -> float:
    if not 0.0 < check_number("crop_fraction", crop_fraction) <= 1.0:
        raise ArgumentError(f"crop_fraction must be in (0, 1], got {crop_fraction!r}.")
    return float(crop_fraction)


def _check_range(name: str, value: Any, low: float, high: float | None) -> tuple[float, float]:
    try:
        a, b = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ArgumentError(f"{name} must be a pair (min, max), got {value!r}.") from None
    if not (low < a <= b and (high is None or b <= high)):
        upper = "" if high is None else f" <= {high}"
        raise ArgumentError(f"{name} must satisfy {low} < min <= max{upper}, got {value!r}.")
    return a, b


def _image_shape(image: tf.Tensor) -> tf.Tensor:
    """[height, width, channels] of a decoded image or of encoded JPEG bytes."""
    if image.dtype == tf.string:
        return tf.image.extract_jpeg_shape(image)
    return tf.shape(image)


def _crop(image: tf.Tensor, top, left, height, width) -> tf.Tensor:
    """A crop of a decoded image, or decoded straight from JPEG bytes (only the crop)."""
    if image.dtype == tf.string:
        window = tf.stack([top, left, height, width])
        return tf.image.decode_and_crop_jpeg(image, window, channels=3)
    return image[top : top + height, left : left + width, :]


def _check_image(image: Any) -> tf.Tensor:
    image = tf.convert_to_tensor(image)
    if image.dtype == tf.string:
        if image.shape.rank not in (None, 0):
            raise ValueError(f"Encoded images must be scalar strings (one JPEG), got shape {image.shape}.")
        return image
    if image.shape.rank != 3:
        raise ValueError(
            f"Images must be (height, width, channels) tensors or JPEG bytes; got shape {image.shape}. "
            "The transforms work on one example: apply them with Dataset.map before batching."
        )
    return image


def _finish(image: tf.Tensor, image_size: int, mean, stddev, dtype) -> tf.Tensor:
    image = tf.image.resize(image, [image_size, image_size], method="bilinear")
    channels = image.shape[-1]
    mean = tf.constant(mean, tf.float32)
    stddev = tf.constant(stddev, tf.float32)
    if channels is not None and mean.shape[0] not in (1, channels):
        raise ValueError(f"mean has {mean.shape[0]} values for {channels}-channel images.")
    image = (image - mean) / stddev
    image.set_shape([image_size, image_size, channels])
    return tf.cast(image, dtype)


def preprocess_for_train(
    image: tf.Tensor,
    seed: tf.Tensor,
    *,
    image_size: int = 224,
    area_range: Sequence[float] = (0.08, 1.0),
    aspect_ratio_range: Sequence[float] = (3 / 4, 4 / 3),
    flip: bool = True,
    mean: Sequence[float] = MEAN_RGB,
    stddev: Sequence[float] = STDDEV_RGB,
    dtype: tf.DType | str = tf.float32,
) -> tf.Tensor:
    """Inception-style augmentation of one training image: random-resized crop and flip.

    A box covering ``area_range`` of the image, with aspect ratio in
    ``aspect_ratio_range``, is drawn (``tf.image.stateless_sample_distorted_bounding_box``,
    10 attempts, else the whole image), cropped (decoding only the box when
    ``image`` is JPEG bytes), resized to ``image_size`` square, flipped left to
    right with probability 1/2 and normalised per channel.

    Example:
        ```python
        import tensorflow as tf
        from keras_replicator.applications.imagenet import example_seeds, preprocess_for_train

        images = tf.data.Dataset.from_tensor_slices(tf.zeros((2, 300, 400, 3), tf.uint8))
        ds = tf.data.Dataset.zip(images, example_seeds(0))   # a seed per example
        ds = ds.map(lambda image, seed: preprocess_for_train(image, seed, image_size=224))
        image = next(iter(ds))          # (224, 224, 3) float32: a random crop, resized, flipped or not
        ```

    Args:
        image: a ``uint8`` ``(height, width, channels)`` image, or a scalar
            string of JPEG bytes (decoded to RGB).
        seed: shape ``[2]`` integer seed of this example (the same seed gives
            the same crop and flip).
        image_size: side of the square output.
        area_range: fraction of the image area the crop covers (min, max).
        aspect_ratio_range: width / height of the crop (min, max).
        flip: whether to flip left-right at random (off for digits, text...).
        mean: per-channel (or one) mean subtracted, in pixel units (0..255).
        stddev: per-channel (or one) standard deviation divided by.
        dtype: the output dtype, e.g. ``tf.bfloat16`` to halve the transfer.

    Returns:
        A ``(image_size, image_size, channels)`` tensor of ``dtype``.

    Raises:
        ValueError: an argument is out of range, or ``image`` is not one image.
    """
    image_size = _check_image_size(image_size)
    area_range = _check_range("area_range", area_range, 0.0, 1.0)
    aspect_ratio_range = _check_range("aspect_ratio_range", aspect_ratio_range, 0.0, None)
    image = _check_image(image)
    seed = tf.convert_to_tensor(seed)
    crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
    shape = _image_shape(image)
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        shape,
        bounding_boxes=tf.constant([0.0, 0.0, 1.0, 1.0], tf.float32, [1, 1, 4]),
        seed=crop_seed,
        min_object_covered=area_range[0],
        aspect_ratio_range=aspect_ratio_range,
        area_range=area_range,
        max_attempts=10,
        use_image_if_no_bounding_boxes=True,
    )
    top, left, _ = tf.unstack(begin)
    height, width, _ = tf.unstack(size)
    image = _crop(image, top, left, height, width)
    if flip:
        image = tf.image.stateless_random_flip_left_right(image, seed=flip_seed)
    return _finish(tf.cast(image, tf.float32), image_size, mean, stddev, dtype)


def preprocess_for_eval(
    image: tf.Tensor,
    *,
    image_size: int = 224,
    crop_fraction: float = 0.875,
    mean: Sequence[float] = MEAN_RGB,
    stddev: Sequence[float] = STDDEV_RGB,
    dtype: tf.DType | str = tf.float32,
) -> tf.Tensor:
    """Evaluation transform of one image: the central crop, resized, normalised.

    The crop is the centred square whose side is ``crop_fraction`` of the
    image's shorter side, resized to ``image_size``: with the defaults this is
    "resize the shorter side to 256, take the central 224x224" (224 / 256 =
    0.875).

    Example:
        ```python
        import tensorflow as tf
        from keras_replicator.applications.imagenet import preprocess_for_eval

        images = tf.zeros((2, 300, 400, 3), tf.uint8)      # or JPEG bytes, as TFDS gives them
        ds = tf.data.Dataset.from_tensor_slices((images, [7, 3]))
        ds = ds.map(lambda image, label: (preprocess_for_eval(image), label))
        image, label = next(iter(ds))   # (224, 224, 3) float32: the central 262x262, resized
        ```

    Args:
        image: a ``uint8`` ``(height, width, channels)`` image, or JPEG bytes.
        image_size: side of the square output.
        crop_fraction: side of the crop over the shorter side, in (0, 1].
        mean: per-channel (or one) mean subtracted, in pixel units.
        stddev: per-channel (or one) standard deviation divided by.
        dtype: the output dtype.

    Returns:
        A ``(image_size, image_size, channels)`` tensor of ``dtype``.

    Raises:
        ValueError: an argument is out of range, or ``image`` is not one image.
    """
    image_size = _check_image_size(image_size)
    _check_crop_fraction(crop_fraction)
    image = _check_image(image)
    shape = _image_shape(image)
    height, width = shape[0], shape[1]
    side = tf.maximum(
        tf.cast(crop_fraction * tf.cast(tf.minimum(height, width), tf.float32), tf.int32), 1
    )
    top = (height - side + 1) // 2
    left = (width - side + 1) // 2
    image = _crop(image, top, left, side, side)
    return _finish(tf.cast(image, tf.float32), image_size, mean, stddev, dtype)


def input_fn(
    split: str = "train",
    *,
    training: bool | None = None,
    image_size: int = 224,
    num_classes: int = NUM_CLASSES,
    data_dir: str | None = None,
    seed: int = 0,
    shuffle_buffer: int = 16_384,
    dtype: tf.DType | str = tf.float32,
    area_range: Sequence[float] = (0.08, 1.0),
    crop_fraction: float = 0.875,
) -> Callable[[tf.distribute.InputContext | None], tf.data.Dataset]:
    """The ImageNet input function: ``input_fn(ctx)`` gives this pipeline's examples.

    Reads TFDS ``imagenet2012`` with the JPEG bytes undecoded, sharded by file
    for the input pipeline ``ctx`` describes (each worker reads its own files;
    `keras_replicator.applications.tfds_input.sharded_dataset`), shuffles and
    repeats the training split, decodes and transforms each
    example (`preprocess_for_train` or `preprocess_for_eval`) and
    one-hot encodes the label (for label smoothing). The examples are
    unbatched: give the function to ``strategy.distribute_dataset`` with the
    global batch size.

    ImageNet cannot be downloaded automatically: get ``ILSVRC2012_img_train.tar``
    and ``ILSVRC2012_img_val.tar`` from https://image-net.org (free account,
    non-commercial terms), put them in ``<data_dir>/downloads/manual/`` and run
    ``tfds build imagenet2012 --data_dir <data_dir>`` once (about 150 GB, a few
    hours). Tests and the tutorial's smoke mode use ``tfds.testing.mock_data``
    instead. Needs ``tensorflow-datasets`` (``pip install tensorflow-datasets``, or the clone's ``pip install ".[datasets]"``).

    Example:
        ```python
        train = strategy.distribute_dataset(
            imagenet.input_fn("train", data_dir="~/tensorflow_datasets"),
            global_batch_size=1024)
        ```

    Args:
        split: a TFDS split of ``imagenet2012``: ``"train"``, ``"validation"``,
            or a slice such as ``"train[:1%]"``.
        training: augment, shuffle and repeat; defaults to ``split`` starting
            with ``"train"``.
        image_size: side of the square images.
        num_classes: length of the one-hot labels.
        data_dir: where the prepared dataset is; None for TFDS's default.
        seed: the seed of shuffling and augmentation (each input pipeline
            derives its own from it).
        shuffle_buffer: examples in the shuffle buffer (training).
        dtype: dtype of the images, e.g. ``tf.bfloat16``.
        area_range: the training crop's area range.
        crop_fraction: the evaluation crop's fraction of the shorter side.

    Returns:
        ``input_fn(ctx)`` returning a ``tf.data.Dataset`` of ``(image,
        one_hot_label)``; ``ctx`` may be None (one input pipeline).

    Raises:
        ValueError: an argument is out of range (checked before any data is read).
    """
    if not isinstance(split, str) or not split:
        raise ArgumentError(f"split must be a TFDS split name such as 'train', got {split!r}.")
    if training is None:
        training = split.startswith("train")
    training = check_bool("training", training)
    _check_image_size(image_size)
    _check_range("area_range", area_range, 0.0, 1.0)
    _check_crop_fraction(crop_fraction)
    check_int("num_classes", num_classes, minimum=2)
    check_int("shuffle_buffer", shuffle_buffer, minimum=1)
    check_int("seed", seed)

    def fn(ctx: tf.distribute.InputContext | None = None) -> tf.data.Dataset:
        import tensorflow_datasets as tfds

        ds = sharded_dataset(
            "imagenet2012",
            split,
            ctx,
            training=training,
            data_dir=data_dir,
            seed=seed,
            shuffle_buffer=shuffle_buffer,
            decoders={"image": tfds.decode.SkipDecoding()},
        )
        if not training:

            def evaluation_example(image, label):
                image = preprocess_for_eval(
                    image, image_size=image_size, crop_fraction=crop_fraction, dtype=dtype
                )
                return image, tf.one_hot(label, num_classes)

            return ds.map(evaluation_example, num_parallel_calls=tf.data.AUTOTUNE)

        def training_example(example, example_seed):
            image, label = example
            image = preprocess_for_train(
                image, example_seed, image_size=image_size, area_range=area_range, dtype=dtype
            )
            return image, tf.one_hot(label, num_classes)

        return ds.map(training_example, num_parallel_calls=tf.data.AUTOTUNE)

    return fn


# The recipe moved to keras_replicator.applications.resnet (it is ResNet's, not the data
# set's); the old names keep working for tutorial 1's readers, with a warning. The shim
# resolves the new names from these strings when one is read: this module does not
# depend on the recipe (which depends on it, for NUM_TRAIN_EXAMPLES).
_MOVED = {
    "LARGE_BATCH": "keras_replicator.applications.resnet.LARGE_BATCH",
    "REFERENCE_TOP1": "keras_replicator.applications.resnet.REFERENCE_TOP1",
    "Recipe": "keras_replicator.applications.resnet.Recipe",
    "mixed_precision_policy": "keras_replicator.applications.resnet.mixed_precision_policy",
}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        import importlib
        import warnings

        warnings.warn(
            f"keras_replicator.applications.imagenet.{name} moved to {_MOVED[name]}.",
            DeprecationWarning,
            stacklevel=2,
        )
        module, attribute = _MOVED[name].rsplit(".", 1)
        return getattr(importlib.import_module(module), attribute)
    if name == "LearningRateDecay":
        raise AttributeError(
            "keras_replicator.applications.imagenet.LearningRateDecay was removed: the warmup "
            "and decay are one schedule, keras_replicator.schedules.LinearScalingWarmup "
            "(Recipe.learning_rate_schedule() builds the recipe's)."
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
