"""FID and Inception Score, with samples drawn on every replica and features all-gathered.

A *feature extractor* is a Keras model `images -> [features, probabilities]`:

* full scale: `inception_extractor(weights_path)`, `keras.applications.InceptionV3`
  from a weights file you supply (pool features, 2048-d; class probabilities);
* small scale: `classifier_extractor(classifier)` on a classifier of the real data
  (e.g. `train_digits_classifier`), its penultimate layer as features.

`generated_features` runs the generator and the extractor inside `strategy.run`:
each replica samples its own latents (a stateless draw keyed by the seed, the
batch and the replica), and the features are all-gathered with `kr.all_gather`, so
the work is spread over the replicas and the host receives the whole set.
"""

from __future__ import annotations

import contextlib
import warnings

import keras
import numpy as np
import tensorflow as tf

from keras_replicator import collectives
from keras_replicator._validation import ArgumentError, check_int

__all__ = [
    "class_diversity",
    "classifier_extractor",
    "digits_classifier",
    "frechet_distance",
    "generated_features",
    "gaussian_statistics",
    "inception_extractor",
    "inception_score",
    "real_features",
    "train_digits_classifier",
]


def gaussian_statistics(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and (unbiased) covariance of `[n, d]` features, in float64.

    Example:
        ```python
        import numpy as np
        from keras_replicator.applications.sngan.metrics import gaussian_statistics

        features = np.random.default_rng(0).normal(size=(10_000, 2))
        mu, sigma = gaussian_statistics(features)   # about [0, 0] and the 2x2 identity
        ```
    """
    f = np.asarray(features, np.float64)
    if f.ndim != 2 or f.shape[0] < 2:
        raise ArgumentError(f"features must be [n >= 2, d], got shape {f.shape}.")
    return f.mean(0), np.cov(f, rowvar=False)


def _sqrt_psd(matrix: np.ndarray) -> np.ndarray:
    w, v = np.linalg.eigh((matrix + matrix.T) / 2)
    return (v * np.sqrt(np.clip(w, 0.0, None))) @ v.T


def frechet_distance(mu1, sigma1, mu2, sigma2) -> float:
    """Frechet distance between Gaussians `N(mu1, sigma1)` and `N(mu2, sigma2)`.

    `|mu1 - mu2|^2 + tr(sigma1) + tr(sigma2) - 2 tr((sigma1^1/2 sigma2 sigma1^1/2)^1/2)`,
    the symmetric form (equal to `tr((sigma1 sigma2)^1/2)`), computed by symmetric
    eigendecompositions in float64: no complex round-off as with a general `sqrtm`.

    Example:
        ```python
        import numpy as np
        from keras_replicator.applications.sngan.metrics import frechet_distance, gaussian_statistics

        rng = np.random.default_rng(0)
        real, fake = rng.normal(size=(10_000, 2)), rng.normal(1.0, size=(10_000, 2))
        fid = frechet_distance(*gaussian_statistics(real), *gaussian_statistics(fake))
        # about 2.0: the means are sqrt(2) apart, the covariances equal
        ```
    """
    mu1, mu2 = np.asarray(mu1, np.float64), np.asarray(mu2, np.float64)
    s1, s2 = np.atleast_2d(sigma1).astype(np.float64), np.atleast_2d(sigma2).astype(np.float64)
    if mu1.shape != mu2.shape or s1.shape != s2.shape or s1.shape != (mu1.size, mu1.size):
        raise ArgumentError(
            f"Shapes do not match: mu {mu1.shape} / {mu2.shape}, sigma {s1.shape} / {s2.shape}.")
    root1 = _sqrt_psd(s1)
    middle = np.linalg.eigvalsh(root1 @ s2 @ root1)
    trace_root = np.sum(np.sqrt(np.clip(middle, 0.0, None)))
    diff = mu1 - mu2
    return float(diff @ diff + np.trace(s1) + np.trace(s2) - 2.0 * trace_root)


def inception_score(probabilities: np.ndarray, splits: int = 1) -> tuple[float, float]:
    """`exp(E_x KL(p(y|x) || p(y)))`, mean and standard deviation over `splits`.

    Example:
        ```python
        import numpy as np
        from keras_replicator.applications.sngan.metrics import inception_score

        probs = np.eye(10)[np.arange(100) % 10]    # confident, and every class as often
        score, spread = inception_score(probs, splits=10)   # (10.0, 0.0): the number of classes
        inception_score(np.full((100, 10), 0.1))             # (1.0, 0.0): the least
        ```
    """
    p = np.asarray(probabilities, np.float64)
    splits = check_int("splits", splits, minimum=1)
    if p.ndim != 2 or p.shape[0] < splits:
        raise ArgumentError(f"probabilities must be [n >= splits, classes], got shape {p.shape}.")
    scores = []
    for part in np.array_split(p, splits):
        marginal = part.mean(0, keepdims=True)
        kl = np.sum(part * (np.log(part + 1e-12) - np.log(marginal + 1e-12)), axis=1)
        scores.append(np.exp(kl.mean()))
    return float(np.mean(scores)), float(np.std(scores))


def _two_outputs(model: keras.Model, features: keras.layers.Layer, name: str) -> keras.Model:
    """`model`'s input to `[features, outputs]`, always in inference mode.

    The extractor is a fixed measuring instrument: its graph calls the network
    with `training=False`, so no call (not even one outside `predict`, without a
    `training` argument) runs batch norm on batch statistics or updates its moving
    statistics, or applies dropout.
    """
    inner = keras.Model(model.inputs, [features.output, model.outputs[0]])
    inputs = keras.Input(model.inputs[0].shape[1:], name="images")
    return keras.Model(inputs, inner(inputs, training=False), name=name)


def inception_extractor(weights: str | None, input_size: int = 299) -> keras.Model:
    """InceptionV3 as `images in [-1, 1] -> [pool features (2048), probabilities (1000)]`.

    Args:
        weights: path of an InceptionV3 weights file with the top (e.g.
            `inception_v3_weights_tf_dim_ordering_tf_kernels.h5`, downloaded by you:
            nothing is downloaded here), or `None` for random weights (tests).
        input_size: side the images are resized to (299 as published; >= 75).

    Example:
        ```python
        extractor = inception_extractor("/data/inception_v3_weights.h5")
        ```
    """
    input_size = check_int("input_size", input_size, minimum=75)
    if weights is not None and not tf.io.gfile.exists(weights):
        raise ValueError(f"InceptionV3 weights file not found: {weights!r}.")
    images = keras.Input((None, None, 3), name="images")
    resized = keras.layers.Resizing(input_size, input_size, name="resize")(images)
    net = keras.applications.InceptionV3(
        include_top=True, weights=weights, input_shape=(input_size, input_size, 3))
    net.trainable = False  # frozen batch norm runs on its moving statistics, whatever `training`
    pool = keras.Model(net.inputs, [net.get_layer("avg_pool").output, net.outputs[0]])
    # InceptionV3 expects [-1, 1]: our range. Inference mode always (see `_two_outputs`):
    # a call without `training` must not normalize by the batch and move the statistics.
    features, probs = pool(resized, training=False)
    return keras.Model(images, [features, probs], name="inception_extractor")


def classifier_extractor(classifier: keras.Model, features_layer: str = "features") -> keras.Model:
    """A classifier as `images -> [features of features_layer, probabilities]`.

    Example:
        ```python
        from keras_replicator.applications import sngan
        from keras_replicator.applications.sngan.metrics import (
            classifier_extractor, train_digits_classifier)

        x, y = sngan.digits(32)
        extractor = classifier_extractor(train_digits_classifier(x[:256], y[:256], epochs=1))
        features, probs = extractor(x[:8])   # (8, 64) and (8, 10)
        ```
    """
    return _two_outputs(classifier, classifier.get_layer(features_layer), "classifier_extractor")


def digits_classifier(image_size: int = 32, num_classes: int = 10, channels: int = 1) -> keras.Model:
    """A small CNN for digits with a 64-d `features` layer and softmax outputs.

    Example:
        ```python
        clf = digits_classifier(32)
        ```
    """
    return keras.Sequential([
        keras.Input((image_size, image_size, channels)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dropout(0.3),
        keras.layers.Dense(64, activation="relu", name="features"),
        keras.layers.Dense(num_classes, activation="softmax", name="probabilities"),
    ], name="digits_classifier")


@contextlib.contextmanager
def _on_one_device_on_purpose():
    """Silences the package's "runs on one device" warning: the judge of the samples is local."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"model\.\w+\(\) runs on one device")
        yield


def train_digits_classifier(
    x: np.ndarray, y: np.ndarray, epochs: int = 15, seed: int = 0
) -> keras.Model:
    """Trains `digits_classifier` on `(x, y)` (one device, seconds on a CPU).

    Example:
        ```python
        from keras_replicator.applications import sngan
        from keras_replicator.applications.sngan.metrics import train_digits_classifier

        x, y = sngan.digits(32)
        clf = train_digits_classifier(x[:256], y[:256], epochs=1)   # all and 15 epochs by default
        probs = clf.predict(x[:8], verbose=0)                       # (8, 10)
        ```
    """
    keras.utils.set_random_seed(seed)
    model = digits_classifier(x.shape[1], int(np.max(y)) + 1, x.shape[-1])
    model.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    epochs = check_int("epochs", epochs, minimum=1)
    with _on_one_device_on_purpose():
        model.fit(x, y, batch_size=64, epochs=epochs, verbose=0)
    return model


def _mean_pairwise_distance(images: np.ndarray) -> float:
    flat = images.reshape(len(images), -1).astype(np.float64)
    squared = np.sum((flat[:, None] - flat[None]) ** 2, -1)
    return float(np.sqrt(np.maximum(squared[np.triu_indices(len(flat), 1)], 0)).mean())


def class_diversity(
    samples: np.ndarray,
    labels: np.ndarray,
    real_images: np.ndarray,
    real_labels: np.ndarray,
    *,
    size: int = 8,
    per_class: int = 100,
) -> np.ndarray:
    """Per class: the samples' within-class diversity relative to real images of the class.

    For class `c`, the mean pairwise Euclidean distance between (up to `per_class`) samples
    asked for `c`, over that between the first `per_class` real images of `c`, both resized
    to `size x size` (area averaging; digits are 8x8 originally). 1.0 is as varied as the real
    class; a class collapsing to one image goes to 0. A mean over classes hides one collapsed
    class: look at the minimum.

    Example:
        ```python
        from keras_replicator.applications import sngan

        x, y = sngan.digits(16)                       # real digits, 16x16, in [-1, 1]
        collapsed = np.repeat(x[y == 3][:1], 20, 0)   # 20 copies of one "3"
        samples = np.concatenate([x[y == c][100:120] for c in range(10) if c != 3] + [collapsed])
        asked = np.concatenate([np.full(20, c) for c in range(10) if c != 3] + [np.full(20, 3)])
        ratios = class_diversity(samples, asked, x, y)   # one ratio per class: about 1, and 0 for 3
        worst = ratios.min()
        ```
    """
    size = check_int("size", size, minimum=1)
    per_class = check_int("per_class", per_class, minimum=2)
    labels, real_labels = np.asarray(labels), np.asarray(real_labels)
    classes = np.unique(real_labels)

    def small(images):
        return tf.image.resize(np.asarray(images, np.float32), [size, size], method="area").numpy()

    for c in classes:
        fakes, reals = int(np.sum(labels == c)), int(np.sum(real_labels == c))
        if fakes < 2 or reals < 2:
            raise ValueError(f"class {c}: need at least 2 samples and 2 real images, got "
                             f"{fakes} and {reals}")
    ratios = []
    for c in classes:
        fake, real = samples[labels == c][:per_class], real_images[real_labels == c][:per_class]
        ratios.append(_mean_pairwise_distance(small(fake)) / _mean_pairwise_distance(small(real)))
    return np.asarray(ratios)


def real_features(extractor: keras.Model, images: np.ndarray, batch_size: int = 256):
    """`(features, probabilities)` of real images (one device).

    Example:
        ```python
        from keras_replicator.applications import sngan
        from keras_replicator.applications.sngan.metrics import (
            classifier_extractor, digits_classifier, real_features)

        x_real, _ = sngan.digits(32)
        extractor = classifier_extractor(digits_classifier(32))   # untrained here: use a trained one
        feats, probs = real_features(extractor, x_real[:100])     # (100, 64) and (100, 10)
        ```
    """
    with _on_one_device_on_purpose():
        features, probs = extractor.predict(images, batch_size=batch_size, verbose=0)
    return np.asarray(features), np.asarray(probs)


def generated_features(
    strategy: tf.distribute.Strategy,
    generator: keras.Model,
    extractor: keras.Model,
    *,
    num_samples: int,
    num_classes: int,
    per_replica_batch: int = 64,
    seed: int = 0,
    labels: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Samples, extracts features on every replica, all-gathers: `(features, probs, labels)`.

    Each replica generates `per_replica_batch` images per round from latents and
    labels drawn from `(seed, round, replica)` (or the given class `labels`, cycled
    over the global sample index); rounds repeat until `num_samples` are made (the
    last round's extra samples are dropped). The generator runs in inference mode.

    Example:
        ```python
        import dataclasses
        import keras_replicator as kr
        from keras_replicator.applications import sngan
        from keras_replicator.applications.sngan.metrics import (
            classifier_extractor, digits_classifier, generated_features)

        strategy = kr.ReplicatorStrategy()
        config = dataclasses.replace(sngan.CONFIGS["small16"], channels=1)
        with strategy.scope():
            generator = sngan.generator(config, 10)        # a trained one: gan.sampler()
            extractor = classifier_extractor(digits_classifier(16))
        feats, probs, labels = generated_features(
            strategy, generator, extractor, num_samples=100, num_classes=10, per_replica_batch=32)
        # (100, 64), (100, 10) and (100,): 2 rounds of 32 samples on each replica, 28 dropped
        ```
    """
    num_samples = check_int("num_samples", num_samples, minimum=1)
    num_classes = check_int("num_classes", num_classes, minimum=1)
    per_replica_batch = check_int("per_replica_batch", per_replica_batch, minimum=1)
    z_dim = int(generator.inputs[0].shape[-1])
    fixed = None if labels is None else tf.constant(np.asarray(labels, np.int32))
    replicas = strategy.num_replicas_in_sync
    rounds = -(-num_samples // (replicas * per_replica_batch))

    @tf.function
    def one_round(r):
        def replica_fn():
            rid = collectives.replica_id()
            key = tf.stack([tf.constant(seed, tf.int32), r * 65536 + rid])
            z = tf.random.stateless_normal([per_replica_batch, z_dim], key)
            if fixed is None:
                y = tf.random.stateless_uniform([per_replica_batch], key + [0, 1 << 30], 0,
                                                num_classes, tf.int32)
            else:
                index = (r * replicas + rid) * per_replica_batch + tf.range(per_replica_batch)
                y = tf.gather(fixed, index % tf.size(fixed))
            images = generator([z, y], training=False)
            features, probs = extractor(images, training=False)
            return tuple(collectives.all_gather(t) for t in (features, probs, y))
        outputs = strategy.run(replica_fn)
        return tuple(strategy.experimental_local_results(o)[0] for o in outputs)

    parts = [one_round(tf.constant(r, tf.int32)) for r in range(rounds)]
    return tuple(np.concatenate([p[i].numpy() for p in parts])[:num_samples] for i in range(3))
