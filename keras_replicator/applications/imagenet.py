"""ImageNet for replicated training: the input pipeline and the large-batch recipe.

The pipeline reads TFDS's ``imagenet2012`` (which must be prepared by hand, see
:func:`input_fn`) and applies the transforms of the reference ResNet
implementations: for training an Inception-style random-resized crop (a random
box covering 8% to 100% of the image with aspect ratio 3/4 to 4/3, decoded
straight from the JPEG) and a random horizontal flip; for evaluation the
central 87.5% of the image, resized (the "resize to 256, crop 224" rule).
Random choices are stateless, drawn from a per-example seed, so a pipeline is
reproducible for a given seed whatever its parallelism.

The recipe (:class:`Recipe`) is the one of Goyal et al. (2017) with later
refinements (He et al., 2019, "Bag of Tricks"): SGD with Nesterov momentum
0.9, learning rate ``0.1 * global_batch / 256`` reached over 5 warm-up epochs,
then cosine (or step) decay, label smoothing 0.1, weight decay 1e-4 on kernels
only, 90 epochs.

Example:
    ```python
    import keras_replicator as kr
    from keras_replicator.applications import imagenet

    strategy = kr.ReplicatorStrategy()
    recipe = imagenet.Recipe(global_batch_size=256 * strategy.num_replicas_in_sync)
    train = strategy.distribute_dataset(
        imagenet.input_fn("train"), global_batch_size=recipe.global_batch_size)
    ```
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

# Per-channel mean and standard deviation of ImageNet's training images (RGB, 0..255).
MEAN_RGB = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STDDEV_RGB = (0.229 * 255, 0.224 * 255, 0.225 * 255)

NUM_CLASSES = 1000
NUM_TRAIN_EXAMPLES = 1_281_167
NUM_EVAL_EXAMPLES = 50_000

# The reference numbers this recipe reproduces at full scale (top-1 on the
# validation set after 90 epochs).
REFERENCE_TOP1 = {
    "Goyal et al. (2017), ResNet-50, 90 epochs, batch 8k": 0.763,
    "TF-Replicator paper (2019), ResNet-50 on 32 TPUv3 cores": 0.753,
}


def _check_image_size(image_size: Any) -> int:
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 1:
        raise ValueError(f"image_size must be a positive integer, got {image_size!r}.")
    return image_size


def _check_range(name: str, value: Any, low: float, high: float | None) -> tuple[float, float]:
    try:
        a, b = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a pair (min, max), got {value!r}.") from None
    if not (low < a <= b and (high is None or b <= high)):
        upper = "" if high is None else f" <= {high}"
        raise ValueError(f"{name} must satisfy {low} < min <= max{upper}, got {value!r}.")
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
        ds = ds.map(lambda image, seed: preprocess_for_train(image, seed, image_size=224))
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
        ds = ds.map(lambda image, label: (preprocess_for_eval(image), label))
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
    if not 0.0 < crop_fraction <= 1.0:
        raise ValueError(f"crop_fraction must be in (0, 1], got {crop_fraction!r}.")
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


def example_seeds(seed: int) -> tf.data.Dataset:
    """An endless dataset of per-example ``[2]`` seeds, new ones at every pass.

    Zip it with a dataset of examples to give each example its own random
    crop and flip; the sequence is fixed by ``seed``.

    Example:
        ```python
        ds = tf.data.Dataset.zip(images, example_seeds(0))
        ```
    """
    return tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True).batch(2)


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
    for the input pipeline ``ctx`` describes (each worker reads its own files),
    shuffles and repeats the training split, decodes and transforms each
    example (:func:`preprocess_for_train` or :func:`preprocess_for_eval`) and
    one-hot encodes the label (for label smoothing). The examples are
    unbatched: give the function to ``strategy.distribute_dataset`` with the
    global batch size.

    ImageNet cannot be downloaded automatically: get ``ILSVRC2012_img_train.tar``
    and ``ILSVRC2012_img_val.tar`` from https://image-net.org (free account,
    non-commercial terms), put them in ``<data_dir>/downloads/manual/`` and run
    ``tfds build imagenet2012 --data_dir <data_dir>`` once (about 150 GB, a few
    hours). Tests and the tutorial's smoke mode use ``tfds.testing.mock_data``
    instead. Needs ``tensorflow-datasets`` (``pip install "keras-replicator[datasets]"``).

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
        raise ValueError(f"split must be a TFDS split name such as 'train', got {split!r}.")
    if training is None:
        training = split.startswith("train")
    _check_image_size(image_size)
    _check_range("area_range", area_range, 0.0, 1.0)
    if not 0.0 < crop_fraction <= 1.0:
        raise ValueError(f"crop_fraction must be in (0, 1], got {crop_fraction!r}.")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}.")
    if isinstance(shuffle_buffer, bool) or not isinstance(shuffle_buffer, int) or shuffle_buffer < 1:
        raise ValueError(f"shuffle_buffer must be a positive integer, got {shuffle_buffer!r}.")

    def fn(ctx: tf.distribute.InputContext | None = None) -> tf.data.Dataset:
        import tensorflow_datasets as tfds

        pipeline = ctx.input_pipeline_id if ctx is not None else 0
        read_config = tfds.ReadConfig(input_context=ctx, shuffle_seed=seed + pipeline)
        ds = tfds.load(
            "imagenet2012",
            split=split,
            data_dir=data_dir,
            as_supervised=True,
            shuffle_files=training,
            decoders={"image": tfds.decode.SkipDecoding()},
            read_config=read_config,
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

        ds = ds.shuffle(shuffle_buffer, seed=seed + pipeline).repeat()
        ds = tf.data.Dataset.zip(ds, example_seeds(seed + 7919 * (pipeline + 1)))
        return ds.map(training_example, num_parallel_calls=tf.data.AUTOTUNE)

    return fn


def mixed_precision_policy(strategy: tf.distribute.Strategy | None = None) -> str:
    """The mixed-precision policy for the strategy's devices.

    ``"mixed_float16"`` on GPUs, ``"mixed_bfloat16"`` on TPUs and CPUs (modern
    x86 CPUs run bfloat16 convolutions natively). Give it as ``dtype=`` to
    :func:`keras_replicator.applications.resnet50`; :meth:`Recipe.compile` then
    adds loss scaling for float16.

    Example:
        ```python
        model = kr.applications.resnet50(dtype=imagenet.mixed_precision_policy(strategy))
        ```
    """
    if strategy is None:
        strategy = tf.distribute.get_strategy()
    devices = getattr(strategy.extended, "worker_devices", ("/cpu:0",))
    types = {(tf.DeviceSpec.from_string(d).device_type or "CPU").upper() for d in devices}
    return "mixed_float16" if "GPU" in types else "mixed_bfloat16"


# --- the recipe ------------------------------------------------------------------

_SCHEDULES = ("cosine", "step")

#: At and above this global batch, :class:`Recipe` halves the weight decay.
LARGE_BATCH = 16_384


def _uses_float16(model: keras.Model) -> bool:
    policies = [model.dtype_policy] + [layer.dtype_policy for layer in model.layers]
    return any(getattr(p, "name", None) == "mixed_float16" for p in policies)


class LearningRateDecay(keras.callbacks.Callback):
    """Cosine or step decay of the learning rate after a warmup, step by step.

    Pair it with :class:`keras_replicator.callbacks.LearningRateWarmup`, listed
    before it: during the first ``warmup_epochs`` this callback does nothing;
    from then on it sets the rate of each step (each execution, with
    ``steps_per_execution > 1``) to ``peak_lr * f(t)``, where ``t`` goes from 0
    at the end of the warmup to 1 at the end of ``epochs``, and ``f(t)`` is
    ``(1 + cos(pi t)) / 2`` (``"cosine"``) or ``factor ** k`` with ``k`` the
    number of ``boundaries`` (in epochs) passed (``"step"``). The rate depends
    only on the step, so a run resumed by ``BackupAndRestore`` continues the
    schedule exactly.

    Example:
        ```python
        callbacks = [
            kr.callbacks.LearningRateWarmup(0.1, 5, global_batch_size=1024),
            LearningRateDecay(peak_lr=0.4, warmup_epochs=5, epochs=90),
        ]
        ```

    Args:
        peak_lr: the rate at the end of the warmup (``LearningRateWarmup``'s
            target, ``base_lr * global_batch / reference_batch``).
        warmup_epochs: epochs of warmup before the decay starts.
        epochs: total epochs of training.
        schedule: ``"cosine"`` or ``"step"``.
        boundaries: for ``"step"``, the epochs at which the rate is multiplied
            by ``factor``.
        factor: for ``"step"``, the multiplier at each boundary.
    """

    def __init__(
        self,
        peak_lr: float,
        warmup_epochs: float,
        epochs: int,
        schedule: str = "cosine",
        boundaries: Sequence[float] = (30, 60, 80),
        factor: float = 0.1,
    ):
        super().__init__()
        if not (isinstance(peak_lr, (int, float)) and not isinstance(peak_lr, bool) and peak_lr > 0):
            raise ValueError(f"peak_lr must be a positive number, got {peak_lr!r}.")
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs must be a positive integer, got {epochs!r}.")
        if not (isinstance(warmup_epochs, (int, float)) and 0 <= warmup_epochs < epochs):
            raise ValueError(f"warmup_epochs must be in [0, epochs={epochs}), got {warmup_epochs!r}.")
        if schedule not in _SCHEDULES:
            raise ValueError(f"schedule must be one of {list(_SCHEDULES)}, got {schedule!r}.")
        boundaries = tuple(float(b) for b in boundaries)
        if list(boundaries) != sorted(boundaries):
            raise ValueError(f"boundaries must be increasing, got {boundaries!r}.")
        if not 0 < factor <= 1:
            raise ValueError(f"factor must be in (0, 1], got {factor!r}.")
        self.peak_lr = float(peak_lr)
        self.warmup_epochs = float(warmup_epochs)
        self.epochs = epochs
        self.schedule = schedule
        self.boundaries = boundaries
        self.factor = float(factor)
        self._epoch = 0
        self._steps_per_epoch: int | None = None

    def learning_rate(self, step: int, steps_per_epoch: int) -> float | None:
        """The rate of global step ``step`` (0-based), or None during the warmup.

        Example:
            ```python
            decay = LearningRateDecay(peak_lr=0.4, warmup_epochs=5, epochs=90)
            decay.learning_rate(500, steps_per_epoch=100)     # 0.4, end of the warmup
            decay.learning_rate(9000, steps_per_epoch=100)    # 0.0, end of training
            ```
        """
        warmup_steps = int(round(self.warmup_epochs * steps_per_epoch))
        if step < warmup_steps:
            return None
        if self.schedule == "step":
            passed = sum(step >= round(b * steps_per_epoch) for b in self.boundaries)
            return self.peak_lr * self.factor**passed
        total = self.epochs * steps_per_epoch
        t = min(1.0, (step - warmup_steps) / max(1, total - warmup_steps))
        return self.peak_lr * 0.5 * (1.0 + math.cos(math.pi * t))

    def on_train_begin(self, logs=None):
        steps = (self.params or {}).get("steps")
        if not steps:
            raise ValueError(
                "LearningRateDecay needs the number of steps per epoch; pass steps_per_epoch= to fit()."
            )
        self._steps_per_epoch = int(steps)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        lr = self.learning_rate(self._epoch * self._steps_per_epoch + batch, self._steps_per_epoch)
        if lr is not None:
            self.model.optimizer.learning_rate = lr

    def get_config(self) -> dict:
        return {
            "peak_lr": self.peak_lr,
            "warmup_epochs": self.warmup_epochs,
            "epochs": self.epochs,
            "schedule": self.schedule,
            "boundaries": list(self.boundaries),
            "factor": self.factor,
        }


@dataclasses.dataclass(frozen=True)
class Recipe:
    """The large-batch ResNet-50 recipe (Goyal et al., 2017, with label smoothing and cosine decay).

    Everything but the model and the data: the optimizer (SGD, Nesterov
    momentum 0.9), the learning rate (``base_learning_rate * global_batch /
    256`` after a linear warmup of 5 epochs from ``base_learning_rate``, then
    cosine or step decay), the loss (cross-entropy with label smoothing 0.1),
    the weight decay to build the model with (1e-4; 5e-5 from a global batch of
    :data:`LARGE_BATCH`), the metrics and the callbacks (warmup, decay,
    :class:`keras_replicator.callbacks.Throughput`, and checkpoints, which only
    the chief writes under a multi-worker ``ReplicatorStrategy``).

    Example:
        ```python
        recipe = imagenet.Recipe(global_batch_size=1024)
        with strategy.scope():
            model = kr.applications.resnet50(weight_decay=recipe.weight_decay)
            recipe.compile(model)
        model.fit(train, epochs=recipe.epochs, steps_per_epoch=recipe.steps_per_epoch(),
                  callbacks=recipe.callbacks(backup_dir="/tmp/backup"))
        ```

    Args:
        global_batch_size: examples per step over all replicas of all workers.
        epochs: epochs of training (90 at full scale).
        base_learning_rate: the rate for a batch of ``reference_batch_size``.
        reference_batch_size: the batch ``base_learning_rate`` is for (256).
        warmup_epochs: epochs of linear warmup.
        schedule: ``"cosine"`` or ``"step"`` (x0.1 at epochs 30, 60 and 80).
        step_boundaries: the epochs of the step schedule.
        momentum: SGD momentum.
        nesterov: Nesterov momentum.
        label_smoothing: label smoothing of the cross-entropy.
        weight_decay: L2 decay on kernels; None for 1e-4, or 5e-5 at and
            above :data:`LARGE_BATCH`.
        num_train_examples: examples in an epoch, for :meth:`steps_per_epoch`.
    """

    global_batch_size: int
    epochs: int = 90
    base_learning_rate: float = 0.1
    reference_batch_size: int = 256
    warmup_epochs: float = 5
    schedule: str = "cosine"
    step_boundaries: tuple[float, ...] = (30, 60, 80)
    momentum: float = 0.9
    nesterov: bool = True
    label_smoothing: float = 0.1
    weight_decay: float | None = None
    num_train_examples: int = NUM_TRAIN_EXAMPLES

    def __post_init__(self):
        for name in ("global_batch_size", "epochs", "reference_batch_size", "num_train_examples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if not self.base_learning_rate > 0:
            raise ValueError(f"base_learning_rate must be > 0, got {self.base_learning_rate!r}.")
        if not 0 <= self.warmup_epochs < self.epochs:
            raise ValueError(
                f"warmup_epochs must be in [0, epochs={self.epochs}), got {self.warmup_epochs!r}."
            )
        if self.schedule not in _SCHEDULES:
            raise ValueError(f"schedule must be one of {list(_SCHEDULES)}, got {self.schedule!r}.")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum!r}.")
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing!r}.")
        if self.weight_decay is None:
            wd = 5e-5 if self.global_batch_size >= LARGE_BATCH else 1e-4
            object.__setattr__(self, "weight_decay", wd)
        elif not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}.")
        object.__setattr__(self, "step_boundaries", tuple(self.step_boundaries))

    @property
    def peak_learning_rate(self) -> float:
        """``base_learning_rate * global_batch_size / reference_batch_size`` (the linear scaling rule)."""
        return self.base_learning_rate * self.global_batch_size / self.reference_batch_size

    def steps_per_epoch(self) -> int:
        """Training steps in one epoch: ``num_train_examples // global_batch_size`` (at least 1)."""
        return max(1, self.num_train_examples // self.global_batch_size)

    def _warmup(self):
        from keras_replicator.callbacks import LearningRateWarmup

        return LearningRateWarmup(
            self.base_learning_rate,
            self.warmup_epochs,
            reference_batch=self.reference_batch_size,
            global_batch_size=self.global_batch_size,
        )

    def _decay(self) -> LearningRateDecay:
        return LearningRateDecay(
            self.peak_learning_rate,
            self.warmup_epochs,
            self.epochs,
            schedule=self.schedule,
            boundaries=self.step_boundaries,
        )

    def learning_rate(self, step: int, steps_per_epoch: int | None = None) -> float:
        """The learning rate of global step ``step`` (0-based): warmup, then decay.

        Example:
            ```python
            recipe = imagenet.Recipe(global_batch_size=1024)
            rates = [recipe.learning_rate(s) for s in range(0, 90 * 1251, 1251)]
            ```
        """
        steps = steps_per_epoch or self.steps_per_epoch()
        decayed = self._decay().learning_rate(step, steps)
        if decayed is not None:
            return decayed
        return self._warmup().learning_rate(step, steps, self.global_batch_size)

    def optimizer(self) -> keras.optimizers.Optimizer:
        """SGD with (Nesterov) momentum; the callbacks set its learning rate every step."""
        return keras.optimizers.SGD(
            learning_rate=self.base_learning_rate, momentum=self.momentum, nesterov=self.nesterov
        )

    def loss(self) -> keras.losses.Loss:
        """Cross-entropy on logits and one-hot labels, with label smoothing."""
        return keras.losses.CategoricalCrossentropy(
            from_logits=True, label_smoothing=self.label_smoothing
        )

    def metrics(self) -> list[keras.metrics.Metric]:
        """Top-1 (``accuracy``) and top-5 (``top5_accuracy``) accuracy on one-hot labels."""
        return [
            keras.metrics.CategoricalAccuracy(name="accuracy"),
            keras.metrics.TopKCategoricalAccuracy(k=5, name="top5_accuracy"),
        ]

    def compile(self, model: keras.Model, *, steps_per_execution: int = 1, **kwargs: Any) -> keras.Model:
        """Compiles ``model`` with the recipe's optimizer, loss and metrics (call under the strategy scope).

        Under a ``"mixed_float16"`` policy the optimizer is wrapped in
        ``keras.optimizers.LossScaleOptimizer`` (dynamic loss scaling).

        Example:
            ```python
            with strategy.scope():
                recipe.compile(model, steps_per_execution=8)
            ```

        Args:
            model: the model to compile.
            steps_per_execution: training steps per call into TensorFlow.
            **kwargs: more ``model.compile`` arguments (e.g. ``jit_compile``).

        Returns:
            ``model``.
        """
        optimizer = self.optimizer()
        if _uses_float16(model):
            # Keras only adds loss scaling by itself when the model's own policy is
            # mixed_float16; a functional model's layers carry the policy instead.
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        model.compile(
            optimizer=optimizer,
            loss=self.loss(),
            metrics=self.metrics(),
            steps_per_execution=steps_per_execution,
            **kwargs,
        )
        return model

    def callbacks(
        self,
        *,
        backup_dir: str | None = None,
        checkpoint_path: str | None = None,
        throughput: bool = True,
    ) -> list[keras.callbacks.Callback]:
        """The training callbacks: warmup, decay, throughput and checkpoints.

        Under a multi-worker ``ReplicatorStrategy`` only the chief writes the
        checkpoint and backup files.

        Example:
            ```python
            model.fit(train, epochs=recipe.epochs, steps_per_epoch=recipe.steps_per_epoch(),
                      callbacks=recipe.callbacks(backup_dir="/shared/run1/backup"))
            ```

        Args:
            backup_dir: if given, ``keras.callbacks.BackupAndRestore`` there, so
                a restarted job resumes from its last epoch.
            checkpoint_path: if given, ``keras.callbacks.ModelCheckpoint`` saving
                the weights there every epoch (a ``.weights.h5`` path, may
                contain ``{epoch}``).
            throughput: add :class:`keras_replicator.callbacks.Throughput`.

        Returns:
            A list of callbacks for ``model.fit`` (the order matters: the
            warmup before the decay, throughput before any logger you append).
        """
        from keras_replicator.callbacks import Throughput

        callbacks: list[keras.callbacks.Callback] = []
        if backup_dir is not None:
            callbacks.append(keras.callbacks.BackupAndRestore(backup_dir))
        callbacks += [self._warmup(), self._decay()]
        if throughput:
            callbacks.append(Throughput(global_batch_size=self.global_batch_size))
        if checkpoint_path is not None:
            callbacks.append(
                keras.callbacks.ModelCheckpoint(checkpoint_path, save_weights_only=True)
            )
        return callbacks
