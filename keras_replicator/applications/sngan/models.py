"""SN-GAN with a projection discriminator (Miyato & Koyama 2018), as Keras models.

The architecture follows pfnet-research/sngan_projection (`gen_models/resnet.py`,
`dis_models/snresnet.py`):

* generator: `z -> Dense -> [bottom, bottom, C]`, then residual up-blocks
  `CBN -> ReLU -> 2x nearest upsample -> conv3x3 -> CBN -> ReLU -> conv3x3` (shortcut:
  upsample, conv1x1), then `BN -> ReLU -> conv3x3 -> tanh`. Every `CBN` is
  `kr.layers.ConditionalGlobalBatchNormalization` (per-class gain and bias, statistics
  of the global batch); the last one is `kr.layers.GlobalBatchNormalization`. The
  layers whose outputs reach a batch norm before anything else have no bias (the
  reference's have one, which the normalization cancels: its gradient is zero up to
  rounding, and Adam would turn that rounding noise into full-size steps).
* discriminator: an optimized first block `conv3x3 -> ReLU -> conv3x3 -> avgpool`
  (shortcut: avgpool, conv1x1), residual down-blocks `ReLU -> conv3x3 -> ReLU ->
  conv3x3 [-> avgpool]` (shortcut conv1x1 [-> avgpool] when the shape changes),
  `ReLU -> global sum pooling -> Dense(1) + <Embedding(y), h>` (projection). Every
  weight (convolutions, dense, class embedding) is wrapped in
  `kr.layers.SpectralNormalization`; no batch norm.
"""

from __future__ import annotations

import dataclasses
import math

import keras
from keras import ops

from keras_replicator._validation import ArgumentError, check_int
from keras_replicator.layers import (
    ConditionalGlobalBatchNormalization,
    GlobalBatchNormalization,
    SpectralNormalization,
)

__all__ = ["CONFIGS", "SNGANConfig", "discriminator", "generator", "get_config"]

# Chainer's BatchNormalization defaults in the reference (decay 0.9, eps 2e-5).
_BN = {"momentum": 0.9, "epsilon": 2e-5}


@dataclasses.dataclass(frozen=True)
class SNGANConfig:
    """Widths and sizes of an SN-GAN.

    Example:
        ```python
        import dataclasses
        from keras_replicator.applications import sngan

        tiny = dataclasses.replace(sngan.CONFIGS["small32"], ch=8)
        g = sngan.generator(tiny, num_classes=10)
        ```

    Attributes:
        image_size: output height and width: `bottom_width * 2 ** len(g_multipliers)`.
        ch: base width; the block widths are `ch` times the multipliers.
        z_dim: the latent dimension.
        bottom_width: the generator's first spatial size.
        g_first: multiplier of the generator's first feature map.
        g_multipliers: output multiplier of each generator up-block.
        d_multipliers: output multiplier of each discriminator block (the first is
            the optimized block).
        d_downsample: whether each discriminator block halves the size (the first
            must be `True`).
        channels: image channels.
    """

    image_size: int
    ch: int
    z_dim: int
    g_first: int
    g_multipliers: tuple[int, ...]
    d_multipliers: tuple[int, ...]
    d_downsample: tuple[bool, ...]
    bottom_width: int = 4
    channels: int = 3

    def __post_init__(self):
        for name in ("image_size", "ch", "z_dim", "g_first", "bottom_width", "channels"):
            check_int(name, getattr(self, name), minimum=1)
        made = self.bottom_width * 2 ** len(self.g_multipliers)
        if made != self.image_size:
            raise ArgumentError(
                f"image_size={self.image_size} cannot be made by this configuration: "
                f"bottom_width {self.bottom_width} doubled by {len(self.g_multipliers)} "
                f"up-blocks gives {made}."
            )
        if len(self.d_multipliers) != len(self.d_downsample) or not self.d_downsample:
            raise ArgumentError("d_multipliers and d_downsample must have the same, non-zero length.")
        if not self.d_downsample[0]:
            raise ArgumentError("The discriminator's first (optimized) block always downsamples.")
        if self.image_size % 2 ** sum(self.d_downsample):
            raise ArgumentError(
                f"image_size={self.image_size} is not divisible by 2**{sum(self.d_downsample)} "
                "(the discriminator's downsampling)."
            )


CONFIGS: dict[str, SNGANConfig] = {
    # pfnet-research/sngan_projection, ImageNet 128x128: ch=64, generator
    # 1024 -> 1024, 512, 256, 128, 64 over 5 up-blocks; discriminator
    # 64, 128, 256, 512, 1024 (down) and 1024 (not down).
    "imagenet128": SNGANConfig(
        image_size=128, ch=64, z_dim=128, g_first=16, g_multipliers=(16, 8, 4, 2, 1),
        d_multipliers=(1, 2, 4, 8, 16, 16), d_downsample=(True,) * 5 + (False,),
    ),
    # The CIFAR-10 layout of the reference (3 up-blocks, 4 discriminator blocks)
    # at a width a CPU trains: 32x32 images.
    "small32": SNGANConfig(
        image_size=32, ch=32, z_dim=64, g_first=4, g_multipliers=(4, 2, 1),
        d_multipliers=(1, 2, 4, 4), d_downsample=(True, True, False, False),
    ),
    # Two up-blocks and three discriminator blocks at 16x16 (digits are 8x8): a step
    # costs about a quarter of small32's; the learning test and the batch-size study.
    "small16": SNGANConfig(
        image_size=16, ch=16, z_dim=64, g_first=4, g_multipliers=(2, 1),
        d_multipliers=(1, 2, 4), d_downsample=(True, True, False),
    ),
}


def get_config(config: str | SNGANConfig) -> SNGANConfig:
    """A configuration by name (`"imagenet128"`, `"small32"`, `"small16"`) or itself.

    Example:
        ```python
        cfg = kr.applications.sngan.get_config("small32")
        ```
    """
    if isinstance(config, SNGANConfig):
        return config
    if config not in CONFIGS:
        raise ArgumentError(f"Unknown SN-GAN configuration {config!r}; known: {sorted(CONFIGS)}.")
    return CONFIGS[config]


def _conv(
    filters: int, kernel: int, gain: float, name: str, use_bias: bool = True
) -> keras.layers.Conv2D:
    # Chainer's GlorotUniform(scale) multiplies the Glorot bound by scale: variance x scale^2.
    init = keras.initializers.VarianceScaling(gain**2, "fan_avg", "uniform")
    return keras.layers.Conv2D(filters, kernel, padding="same", kernel_initializer=init,
                               use_bias=use_bias, name=name)


def _sn(layer: keras.layers.Layer) -> SpectralNormalization:
    return SpectralNormalization(layer, name=f"sn_{layer.name}")


def generator(
    config: str | SNGANConfig = "small32", num_classes: int = 10, name: str = "generator"
) -> keras.Model:
    """The class-conditional ResNet generator: `[z, labels] -> images` in [-1, 1].

    Args:
        config: a name in `CONFIGS` or an `SNGANConfig`.
        num_classes: the number of classes.
        name: the model's name.

    Returns:
        A functional model called as `generator([z, labels])`, `z` float32 of shape
        `(n, z_dim)`, `labels` int32 of shape `(n,)`; NHWC images in [-1, 1].

    Example:
        ```python
        import numpy as np
        import keras_replicator as kr

        g = kr.applications.sngan.generator("small32", num_classes=10)
        images = g([np.random.randn(4, 64).astype("float32"), np.arange(4, dtype="int32")])
        ```
    """
    cfg = get_config(config)
    num_classes = check_int("num_classes", num_classes, minimum=1)
    z = keras.Input((cfg.z_dim,), name="z")
    labels = keras.Input((), dtype="int32", name="labels")
    width = cfg.ch * cfg.g_first
    init = keras.initializers.VarianceScaling(1.0, "fan_avg", "uniform")
    h = keras.layers.Dense(cfg.bottom_width**2 * width, kernel_initializer=init, use_bias=False,
                           name="l1")(z)
    h = keras.layers.Reshape((cfg.bottom_width, cfg.bottom_width, width))(h)
    for i, mult in enumerate(cfg.g_multipliers, start=2):
        out = cfg.ch * mult
        p = f"block{i}_"
        x = ConditionalGlobalBatchNormalization(num_classes, **_BN, name=p + "cbn1")([h, labels])
        x = keras.layers.ReLU()(x)
        x = keras.layers.UpSampling2D(2, name=p + "up")(x)
        x = _conv(out, 3, math.sqrt(2), p + "c1", use_bias=False)(x)
        x = ConditionalGlobalBatchNormalization(num_classes, **_BN, name=p + "cbn2")([x, labels])
        x = keras.layers.ReLU()(x)
        x = _conv(out, 3, math.sqrt(2), p + "c2", use_bias=False)(x)
        s = keras.layers.UpSampling2D(2, name=p + "sc_up")(h)
        s = _conv(out, 1, 1.0, p + "sc", use_bias=False)(s)
        h = keras.layers.Add(name=p + "add")([x, s])
    h = GlobalBatchNormalization(**_BN, name="b_out")(h)
    h = keras.layers.ReLU()(h)
    h = _conv(cfg.channels, 3, 1.0, "l_out")(h)
    images = keras.layers.Activation("tanh", name="tanh")(h)
    return keras.Model([z, labels], images, name=name)


class _GlobalSumPool(keras.layers.Layer):
    def call(self, x):
        return ops.sum(x, axis=(1, 2))

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[3])


class _Projection(keras.layers.Layer):
    def call(self, inputs):
        h, embedded = inputs
        return ops.sum(h * embedded, axis=1, keepdims=True)

    def compute_output_shape(self, input_shape):
        return (input_shape[0][0], 1)


keras.saving.register_keras_serializable(package="keras_replicator")(_GlobalSumPool)
keras.saving.register_keras_serializable(package="keras_replicator")(_Projection)


def discriminator(
    config: str | SNGANConfig = "small32", num_classes: int = 10, name: str = "discriminator"
) -> keras.Model:
    """The projection discriminator: `[images, labels] -> logits` of shape `(n, 1)`.

    Every weight is spectrally normalized (`kr.layers.SpectralNormalization`).

    Args:
        config: a name in `CONFIGS` or an `SNGANConfig`.
        num_classes: the number of classes.
        name: the model's name.

    Example:
        ```python
        import numpy as np
        import keras_replicator as kr

        d = kr.applications.sngan.discriminator("small32", num_classes=10)
        logits = d([np.zeros((2, 32, 32, 3), "float32"), np.array([0, 1], "int32")])
        ```
    """
    cfg = get_config(config)
    num_classes = check_int("num_classes", num_classes, minimum=1)
    images = keras.Input((cfg.image_size, cfg.image_size, cfg.channels), name="images")
    labels = keras.Input((), dtype="int32", name="labels")
    h = images
    in_ch = cfg.channels
    for i, (mult, down) in enumerate(zip(cfg.d_multipliers, cfg.d_downsample), start=1):
        out = cfg.ch * mult
        p = f"dblock{i}_"
        if i == 1:  # OptimizedBlock
            x = _sn(_conv(out, 3, math.sqrt(2), p + "c1"))(h)
            x = keras.layers.ReLU()(x)
            x = _sn(_conv(out, 3, math.sqrt(2), p + "c2"))(x)
            x = keras.layers.AveragePooling2D(2, name=p + "pool")(x)
            s = keras.layers.AveragePooling2D(2, name=p + "sc_pool")(h)
            s = _sn(_conv(out, 1, 1.0, p + "sc"))(s)
        else:
            x = keras.layers.ReLU()(h)
            x = _sn(_conv(in_ch, 3, math.sqrt(2), p + "c1"))(x)  # hidden = in channels
            x = keras.layers.ReLU()(x)
            x = _sn(_conv(out, 3, math.sqrt(2), p + "c2"))(x)
            if down:
                x = keras.layers.AveragePooling2D(2, name=p + "pool")(x)
            s = h
            if in_ch != out or down:
                s = _sn(_conv(out, 1, 1.0, p + "sc"))(s)
                if down:
                    s = keras.layers.AveragePooling2D(2, name=p + "sc_pool")(s)
        h = keras.layers.Add(name=p + "add")([x, s])
        in_ch = out
    h = keras.layers.ReLU()(h)
    h = _GlobalSumPool(name="sum_pool")(h)
    init = keras.initializers.VarianceScaling(1.0, "fan_avg", "uniform")
    logits = _sn(keras.layers.Dense(1, kernel_initializer=init, name="l_out"))(h)
    embedded = _sn(keras.layers.Embedding(num_classes, in_ch, embeddings_initializer=init,
                                          name="l_y"))(labels)
    logits = keras.layers.Add(name="logits")([logits, _Projection(name="projection")([h, embedded])])
    return keras.Model([images, labels], logits, name=name)
