"""ResNet v1.5 from Keras layers, set up for large-batch replicated training.

The architecture is the "v1.5" ResNet of the reference TensorFlow and PyTorch
implementations (He et al., 2016, with the stride-2 moved from the first 1x1
convolution of a bottleneck to its 3x3 convolution), with the choices of
Goyal et al. (2017, "Accurate, Large Minibatch SGD") that make large global
batches train well:

* batch normalization is global (cross-replica) by default, so the statistics
  are those of the global batch whatever the number of replicas;
* the last batch normalization of every residual block starts with gamma = 0,
  so every block starts as the identity;
* weight decay is an L2 penalty on convolution and dense kernels only, never on
  batch-normalization parameters or biases (the refinement of Jia et al., 2018,
  and He et al., 2019, "Bag of Tricks"); ``weight_decay=w`` adds ``w/2 * |k|^2``
  per kernel ``k`` to the loss, so the gradient gets ``w * k``, the weight decay
  of the reference implementations.

Example:
    ```python
    import keras_replicator as kr

    strategy = kr.ReplicatorStrategy()
    with strategy.scope():
        model = kr.applications.resnet50(num_classes=1000)       # 25.6M parameters
    ```
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras

from keras_replicator._validation import ArgumentError, check_choice, check_int, check_number

_VARIANTS = ("v1.5", "keras_applications")
_BLOCKS = ("bottleneck", "basic")
_STEMS = ("imagenet", "small")
_BATCH_NORMS = ("global", "keras")

# The 50-layer configuration: bottleneck blocks per stage.
RESNET50_BLOCKS = (3, 4, 6, 3)


def _check_weight_decay(weight_decay: Any) -> float:
    return check_number("weight_decay", weight_decay, non_negative=True)


def _regularizer(weight_decay: float) -> keras.regularizers.Regularizer | None:
    # L2(l) adds l * sum(k^2); its gradient 2 * l * k equals weight_decay * k.
    return keras.regularizers.L2(weight_decay / 2.0) if weight_decay > 0 else None


def _batch_norm_class(batch_norm: str) -> type[keras.layers.Layer]:
    if batch_norm == "keras":
        return keras.layers.BatchNormalization
    from keras_replicator.layers import GlobalBatchNormalization

    return GlobalBatchNormalization


def apply_weight_decay(model: keras.Model, weight_decay: float) -> keras.Model:
    """Puts an L2 weight-decay penalty on every kernel of ``model``, and nowhere else.

    Every layer with a ``kernel`` (convolutions, dense layers) gets
    ``kernel_regularizer=keras.regularizers.L2(weight_decay / 2)``, so the
    gradient of the penalty is ``weight_decay * kernel``; batch-normalization
    parameters and biases get none (Goyal et al., 2017; He et al., 2019). The
    regularizers are part of the layers' configs, so they survive saving and
    `keras_replicator.layers.convert_to_global_batch_norm`. Under a
    strategy, Keras divides the penalty by the number of replicas like the data
    loss, so the update is the one-device update.

    Example:
        ```python
        model = keras.applications.ResNet50(weights=None)
        kr.applications.apply_weight_decay(model, 1e-4)
        ```

    Args:
        model: a built Keras model (nested models are handled).
        weight_decay: the decay coefficient, >= 0; 0 removes kernel penalties.

    Returns:
        ``model``, changed in place.

    Raises:
        ValueError: ``weight_decay`` is negative or not a number.
        TypeError: ``model`` is not a Keras model.
    """
    if not isinstance(model, keras.Model):
        raise ArgumentError(f"apply_weight_decay needs a keras.Model, got {type(model).__name__}.")
    regularizer = _regularizer(_check_weight_decay(weight_decay))

    def visit(layer: keras.layers.Layer) -> None:
        if isinstance(layer, keras.Model):
            for sub in layer.layers:
                visit(sub)
            return
        kernel = getattr(layer, "kernel", None)
        if kernel is not None and hasattr(layer, "kernel_regularizer"):
            layer.kernel_regularizer = regularizer
            kernel.regularizer = regularizer

    visit(model)
    return model


class _Builder:
    """Holds the options shared by every layer of one ResNet."""

    def __init__(self, *, weight_decay, batch_norm, bn_momentum, bn_epsilon, bn_kwargs, dtype):
        self.regularizer = _regularizer(weight_decay)
        self.bn_class = _batch_norm_class(batch_norm)
        self.bn_momentum = bn_momentum
        self.bn_epsilon = bn_epsilon
        self.bn_kwargs = bn_kwargs
        self.dtype = dtype

    def conv(self, x, filters: int, kernel_size: int, strides: int, name: str):
        # Strided convolutions pad explicitly (k // 2 on each side) so the output
        # does not depend on whether the input size is even ("fixed padding" of
        # the reference implementations).
        if strides > 1 and kernel_size > 1:
            x = keras.layers.ZeroPadding2D(kernel_size // 2, name=f"{name}_pad", dtype=self.dtype)(x)
            padding = "valid"
        else:
            padding = "same"
        return keras.layers.Conv2D(
            filters,
            kernel_size,
            strides=strides,
            padding=padding,
            use_bias=False,
            kernel_initializer=keras.initializers.VarianceScaling(2.0, "fan_out", "untruncated_normal"),
            kernel_regularizer=self.regularizer,
            name=name,
            dtype=self.dtype,
        )(x)

    def bn(self, x, name: str, zero_gamma: bool = False):
        return self.bn_class(
            axis=-1,
            momentum=self.bn_momentum,
            epsilon=self.bn_epsilon,
            gamma_initializer="zeros" if zero_gamma else "ones",
            name=name,
            dtype=self.dtype,
            **self.bn_kwargs,
        )(x)

    def relu(self, x, name: str):
        return keras.layers.Activation("relu", name=name, dtype=self.dtype)(x)

    def block(self, x, filters, strides, kind, zero_init, name):
        out_filters = filters * 4 if kind == "bottleneck" else filters
        if strides != 1 or x.shape[-1] != out_filters:
            shortcut = self.conv(x, out_filters, 1, strides, f"{name}_0_conv")
            shortcut = self.bn(shortcut, f"{name}_0_bn")
        else:
            shortcut = x
        if kind == "bottleneck":
            h = self.conv(x, filters, 1, 1, f"{name}_1_conv")
            h = self.relu(self.bn(h, f"{name}_1_bn"), f"{name}_1_relu")
            h = self.conv(h, filters, 3, strides, f"{name}_2_conv")  # v1.5: stride here
            h = self.relu(self.bn(h, f"{name}_2_bn"), f"{name}_2_relu")
            h = self.conv(h, out_filters, 1, 1, f"{name}_3_conv")
            h = self.bn(h, f"{name}_3_bn", zero_gamma=zero_init)
        else:
            h = self.conv(x, filters, 3, strides, f"{name}_1_conv")
            h = self.relu(self.bn(h, f"{name}_1_bn"), f"{name}_1_relu")
            h = self.conv(h, filters, 3, 1, f"{name}_2_conv")
            h = self.bn(h, f"{name}_2_bn", zero_gamma=zero_init)
        h = keras.layers.Add(name=f"{name}_add", dtype=self.dtype)([shortcut, h])
        return self.relu(h, f"{name}_out")


def resnet(
    block_sizes: Sequence[int],
    *,
    num_classes: int,
    input_shape: Sequence[int | None] = (224, 224, 3),
    block: str = "bottleneck",
    width: int = 64,
    stem: str = "imagenet",
    zero_init_residual: bool = True,
    weight_decay: float = 1e-4,
    batch_norm: str = "global",
    bn_momentum: float = 0.9,
    bn_epsilon: float = 1e-5,
    bn_kwargs: dict[str, Any] | None = None,
    dtype: str | keras.DTypePolicy | None = None,
    name: str | None = None,
) -> keras.Model:
    """A ResNet v1.5 of any depth and width, as a functional Keras model returning logits.

    ``resnet((3, 4, 6, 3), num_classes=1000)`` is ResNet-50; ``block="basic"``
    with ``(2, 2, 2, 2)`` is ResNet-18. Small members of the family (fewer
    blocks, a smaller ``width``, ``stem="small"`` for 32x32 images) train the
    same way on small images; the learning check of the test suite uses one.

    Example:
        ```python
        model = kr.applications.resnet(
            (1, 1, 1), num_classes=10, input_shape=(32, 32, 1), width=16, stem="small")
        ```

    Args:
        block_sizes: residual blocks per stage; stage ``i`` has ``width * 2**i``
            filters (times 4 at a bottleneck's output) and, after the first,
            starts with a stride-2 block.
        num_classes: number of output logits (no softmax: use a loss with
            ``from_logits=True``).
        input_shape: ``(height, width, channels)``; height and width may be None.
        block: ``"bottleneck"`` (ResNet-50/101/152) or ``"basic"`` (ResNet-18/34).
        width: filters of the first stage (64 in the paper).
        stem: ``"imagenet"`` (7x7/2 convolution and 3x3/2 max-pool, for 224x224
            images) or ``"small"`` (one 3x3/1 convolution, for 32x32 images).
        zero_init_residual: start each block's last batch-norm gamma at 0.
        weight_decay: L2 decay on convolution and dense kernels only (see
            `apply_weight_decay`); 0 for none.
        batch_norm: ``"global"`` (`keras_replicator.layers.GlobalBatchNormalization`,
            statistics over all replicas) or ``"keras"`` (Keras's
            ``BatchNormalization``).
        bn_momentum: moving-average momentum of the batch-norm statistics.
        bn_epsilon: batch-norm epsilon.
        bn_kwargs: extra arguments for every batch-norm layer, e.g.
            ``{"group_size": 8}`` for grouped global batch norm.
        dtype: a dtype policy for every layer, e.g. ``"mixed_bfloat16"`` (see
            `keras_replicator.applications.resnet.mixed_precision_policy`);
            the classifier always computes in float32.
        name: the model's name.

    Returns:
        An uncompiled ``keras.Model`` from images to ``num_classes`` logits.

    Raises:
        ValueError: an argument is out of range or not one of its choices.
    """
    if isinstance(block_sizes, (str, bytes)) or not isinstance(block_sizes, Sequence) or not block_sizes:
        raise ArgumentError(f"block_sizes must be a non-empty sequence of positive integers, got {block_sizes!r}.")
    for n in block_sizes:
        check_int("each entry of block_sizes", n, minimum=1)
    check_int("num_classes", num_classes, minimum=1)
    check_int("width", width, minimum=1)
    check_choice("block", block, _BLOCKS)
    check_choice("stem", stem, _STEMS)
    check_choice("batch_norm", batch_norm, _BATCH_NORMS)
    weight_decay = _check_weight_decay(weight_decay)
    input_shape = tuple(input_shape)
    if len(input_shape) != 3:
        raise ArgumentError(f"input_shape must be (height, width, channels), got {input_shape!r}.")
    if not 0.0 <= check_number("bn_momentum", bn_momentum) < 1.0:
        raise ArgumentError(f"bn_momentum must be in [0, 1), got {bn_momentum!r}.")
    check_number("bn_epsilon", bn_epsilon, positive=True)

    b = _Builder(
        weight_decay=weight_decay,
        batch_norm=batch_norm,
        bn_momentum=bn_momentum,
        bn_epsilon=bn_epsilon,
        bn_kwargs=dict(bn_kwargs or {}),
        dtype=dtype,
    )
    inputs = keras.Input(input_shape, name="images")
    if stem == "imagenet":
        x = b.conv(inputs, width, 7, 2, "conv1_conv")
        x = b.relu(b.bn(x, "conv1_bn"), "conv1_relu")
        # Zero padding is exact here: the inputs of the pool are >= 0 after the ReLU.
        x = keras.layers.ZeroPadding2D(1, name="pool1_pad", dtype=dtype)(x)
        x = keras.layers.MaxPooling2D(3, strides=2, name="pool1_pool", dtype=dtype)(x)
    else:
        x = b.conv(inputs, width, 3, 1, "conv1_conv")
        x = b.relu(b.bn(x, "conv1_bn"), "conv1_relu")
    for stage, blocks in enumerate(block_sizes):
        for i in range(blocks):
            strides = 2 if (stage > 0 and i == 0) else 1
            x = b.block(
                x, width * 2**stage, strides, block, zero_init_residual, f"conv{stage + 2}_block{i + 1}"
            )
    x = keras.layers.GlobalAveragePooling2D(name="avg_pool", dtype=dtype)(x)
    # The classifier in float32 (also under mixed precision), initialised as in
    # Goyal et al.: weights from N(0, 0.01^2), zero bias.
    outputs = keras.layers.Dense(
        num_classes,
        kernel_initializer=keras.initializers.RandomNormal(stddev=0.01),
        kernel_regularizer=b.regularizer,
        name="predictions",
        dtype="float32",
    )(x)
    return keras.Model(inputs, outputs, name=name or f"resnet_{_depth(block_sizes, block)}", dtype=dtype)


def _depth(block_sizes: Sequence[int], block: str) -> int:
    return 2 + sum(block_sizes) * (3 if block == "bottleneck" else 2)


def resnet50(
    num_classes: int = 1000,
    *,
    input_shape: Sequence[int | None] = (224, 224, 3),
    variant: str = "v1.5",
    weight_decay: float = 1e-4,
    zero_init_residual: bool = True,
    batch_norm: str = "global",
    bn_kwargs: dict[str, Any] | None = None,
    weights: str | None = None,
    dtype: str | keras.DTypePolicy | None = None,
) -> keras.Model:
    """ResNet-50 for replicated training: 25.6M parameters at 1000 classes.

    ``variant="v1.5"`` (the default) builds the reference ResNet-50 v1.5 with
    `resnet`: 25,557,032 trainable parameters at 1000 classes, as
    torchvision's ``resnet50``. ``variant="keras_applications"`` returns
    ``keras.applications.ResNet50`` (ResNet v1, with convolution biases) with
    every ``BatchNormalization`` converted by
    `keras_replicator.layers.convert_to_global_batch_norm`, the same weight
    decay rule and, when training from scratch, the same zero-initialised gammas;
    use it to start from Keras's pretrained ``weights``.

    Example:
        ```python
        with strategy.scope():
            model = kr.applications.resnet50(num_classes=1000, dtype="mixed_bfloat16")
            keras_model = kr.applications.resnet50(variant="keras_applications")
        ```

    Args:
        num_classes: number of output logits (no softmax).
        input_shape: ``(height, width, 3)``.
        variant: ``"v1.5"`` or ``"keras_applications"``.
        weight_decay: L2 decay on kernels only; 0 for none.
        zero_init_residual: start each block's last batch-norm gamma at 0 (for
            ``"keras_applications"``, only when ``weights`` is None).
        batch_norm: ``"global"`` or ``"keras"`` (``"v1.5"`` only; the Keras
            variant is always converted to global batch norm).
        bn_kwargs: extra batch-norm arguments (``"v1.5"`` only).
        weights: ``"keras_applications"`` only: None, ``"imagenet"`` (downloaded
            by Keras) or the path of a weights file, as for
            ``keras.applications.ResNet50``.
        dtype: a dtype policy such as ``"mixed_bfloat16"``.

    Returns:
        A ``keras.Model`` from images to logits.

    Raises:
        ValueError: an argument is out of range or does not fit the variant.
    """
    check_choice("variant", variant, _VARIANTS)
    if variant == "v1.5":
        if weights is not None:
            raise ArgumentError(
                "weights are only available for variant='keras_applications' "
                "(Keras's pretrained ResNet50); the v1.5 model trains from scratch."
            )
        return resnet(
            RESNET50_BLOCKS,
            num_classes=num_classes,
            input_shape=input_shape,
            weight_decay=weight_decay,
            zero_init_residual=zero_init_residual,
            batch_norm=batch_norm,
            bn_kwargs=bn_kwargs,
            dtype=dtype,
            name="resnet50_v1_5",
        )
    check_int("num_classes", num_classes, minimum=1)
    _check_weight_decay(weight_decay)
    if batch_norm != "global" or bn_kwargs:
        raise ArgumentError(
            "variant='keras_applications' always uses GlobalBatchNormalization with its "
            "defaults; batch_norm and bn_kwargs apply to variant='v1.5' only."
        )
    from keras_replicator.layers import convert_to_global_batch_norm

    # keras.applications takes no dtype: its layers read the global policy.
    previous = keras.config.dtype_policy()
    if dtype is not None:
        keras.config.set_dtype_policy(dtype)
    try:
        base = keras.applications.ResNet50(
            weights=weights,
            input_shape=tuple(input_shape),
            classes=num_classes,
            classifier_activation=None,
        )
    finally:
        keras.config.set_dtype_policy(previous)
    if weights is None and zero_init_residual:
        for layer in base.layers:
            # keras.applications names a block's last batch norm "convN_blockM_3_bn".
            if layer.name.endswith("_3_bn") and "_block" in layer.name:
                layer.gamma.assign(keras.ops.zeros_like(layer.gamma))
    apply_weight_decay(base, weight_decay)
    return convert_to_global_batch_norm(base)
