"""The models the benchmarks train: a small CNN, ResNet-50 (v1 and v2), its batch-norm layers alone, the SN-GAN.

Keras is imported only inside the functions: a worker sets its devices first.
"""

from __future__ import annotations

# Image side of the training benchmarks: ResNet-50 at 32x32 (CIFAR size) keeps
# a step on 2 CPU cores well under a second.
IMAGE_SIZE = 32
NUM_CLASSES = 10

# The small SN-GAN of the digits command (`CONFIGS["small16"]` with the digits' one
# channel): on 4 replicas it learns digits (docs/sngan_large_batch.md), and its steps are short enough
# for windows of a few steps. Each `fit` step is one generator update: `SNGAN_N_DIS`
# discriminator updates, each on a global batch of `global_batch` real and as many
# fake images, then one generator update on `global_batch` fakes.
SNGAN_IMAGE_SIZE, SNGAN_N_DIS = 16, 1
# Training models whose step is a GAN's (n_dis discriminator updates and one generator
# update): measured on the largest device count only (one group: one device, stock and
# ours), in their own table of step times, not in the throughput table and target.
GAN_MODELS = ("sngan",)


def batch_norm_layer(kind: str):
    """A batch-norm layer: ``global`` (ours), ``keras_sync`` (``synchronized=True``) or Keras's plain one."""
    import keras

    if kind == "global":
        from keras_replicator.layers import GlobalBatchNormalization

        return GlobalBatchNormalization()
    if kind == "keras_sync":
        return keras.layers.BatchNormalization(synchronized=True)
    return keras.layers.BatchNormalization()


def resnet50():
    """``keras.applications.ResNet50`` at 32x32, untrained, logits out."""
    import keras

    return keras.applications.ResNet50(weights=None, input_shape=(IMAGE_SIZE, IMAGE_SIZE, 3),
                                       classes=NUM_CLASSES, classifier_activation=None)


def resnet50v2():
    """``keras.applications.ResNet50V2`` at 32x32, untrained, logits out (the model of issue 54's steady table)."""
    import keras

    return keras.applications.ResNet50V2(weights=None, input_shape=(IMAGE_SIZE, IMAGE_SIZE, 3),
                                         classes=NUM_CLASSES, classifier_activation=None)


def resnet50_batch_norm_layers(batch_norm: str):
    """ResNet-50's 53 batch-norm layers at their input shapes, with little else.

    For each input shape of ResNet-50's batch-norm layers (16x16x64 to
    1x1x2048 at 32x32 images), the image is average-pooled to its size and a
    1x1 convolution makes its channels (so that every layer's input has a
    gradient, as in ResNet-50); then as many ``batch_norm`` layers as ResNet-50
    has at that shape follow each other. Most of a step is in the batch-norm
    layers, so their step time shows, which the whole ResNet-50 (where they
    are about a tenth of a step) cannot resolve.
    """
    import collections

    import keras

    counts = collections.Counter(
        tuple(layer.input.shape[1:]) for layer in resnet50().layers
        if isinstance(layer, keras.layers.BatchNormalization))
    inputs = keras.Input((IMAGE_SIZE, IMAGE_SIZE, 3))
    features = []
    for (height, _, channels), count in counts.items():
        h = keras.layers.AveragePooling2D(IMAGE_SIZE // height)(inputs)
        h = keras.layers.Conv2D(channels, 1, use_bias=False)(h)
        for _ in range(count):
            h = batch_norm_layer(batch_norm)(h)
        features.append(keras.layers.GlobalAveragePooling2D()(h))
    outputs = keras.layers.Dense(NUM_CLASSES)(keras.layers.Concatenate()(features))
    return keras.Model(inputs, outputs)


def build_model(name: str, batch_norm: str = "keras"):
    """``cnn``: a 4-conv CNN; ``cnn_bn``: the same with batch norm after each conv;
    ``resnet50``: ``keras.applications.ResNet50`` at 32x32 with ``batch_norm``
    (``keras``: its own plain BN; ``keras_sync``: ``synchronized=True``;
    ``global``: converted to ``GlobalBatchNormalization``); ``resnet50v2``: ``ResNet50V2`` at 32x32
    with its own batch norm; ``resnet50_bn``: ResNet-50's batch-norm layers alone
    (:func:`resnet50_batch_norm_layers`)."""
    import keras

    keras.utils.set_random_seed(0)
    shape = (IMAGE_SIZE, IMAGE_SIZE, 3)
    if name == "resnet50_bn":
        return resnet50_batch_norm_layers(batch_norm)
    if name == "resnet50v2":
        return resnet50v2()
    if name == "resnet50":
        model = resnet50()
        if batch_norm == "global":
            from keras_replicator.layers import convert_to_global_batch_norm

            return convert_to_global_batch_norm(model)
        if batch_norm == "keras_sync":
            def synchronized(layer):
                config = layer.get_config()
                if isinstance(layer, keras.layers.BatchNormalization):
                    config["synchronized"] = True
                return type(layer).from_config(config)

            return keras.models.clone_model(model, clone_function=synchronized)
        return model
    if name not in ("cnn", "cnn_bn"):
        raise ValueError(f"unknown model {name!r}")
    inputs = keras.Input(shape)
    h = inputs
    for filters, stride in ((32, 1), (32, 2), (64, 1), (64, 2)):
        h = keras.layers.Conv2D(filters, 3, strides=stride, padding="same",
                                use_bias=name == "cnn")(h)
        if name == "cnn_bn":
            h = batch_norm_layer(batch_norm)(h)
        h = keras.layers.ReLU()(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    h = keras.layers.Dense(128, activation="relu")(h)
    outputs = keras.layers.Dense(NUM_CLASSES)(h)
    return keras.Model(inputs, outputs)


def build_sngan(learning_rate: float = 2e-4, steps_per_execution: int = 1):
    """The small SN-GAN (``sngan.SNGAN``), compiled with its two Adam optimizers."""
    import dataclasses

    import keras

    from keras_replicator.applications import sngan

    keras.utils.set_random_seed(0)
    config = dataclasses.replace(sngan.CONFIGS["small16"], channels=1)
    assert config.image_size == SNGAN_IMAGE_SIZE
    gan = sngan.SNGAN(sngan.generator(config, NUM_CLASSES), sngan.discriminator(config, NUM_CLASSES),
                      num_classes=NUM_CLASSES, n_dis=SNGAN_N_DIS, ema_decay=None)
    gan.compile(d_optimizer=sngan.default_optimizer(learning_rate),
                g_optimizer=sngan.default_optimizer(learning_rate),
                steps_per_execution=steps_per_execution)
    return gan
