"""The parts of an SN-GAN run, each built from a `RunConfig`; `run` wires them.

`make_strategy` (first: in a cluster it configures TensorFlow's runtime), `make_data`
(the training batches and what measures the samples), `make_gan`, `resume` (from the
run's checkpoint), the `Interval` callback (evaluation, `metrics.json`, the checkpoint)
and `write_outputs` (the generator and `samples.png`). Only the chief writes to
``config.out``; every worker reads its checkpoint to resume. The files are written
atomically (`applications._runs`).

Example:
    ```python
    from keras_replicator.applications.sngan import builder

    builder.run(config)   # a checked RunConfig: what the command line does
    ```
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import keras_replicator as kr
from keras_replicator.applications import _runs
from keras_replicator.applications.sngan import data, metrics, models, training
from keras_replicator.applications.sngan.config import RunConfig

__all__ = ["Interval", "RunData", "make_data", "make_gan", "make_strategy", "resume", "run",
           "write_outputs"]


def make_strategy(config: RunConfig) -> kr.ReplicatorStrategy:
    """The strategy over ``config.replicas`` devices (of each worker in a cluster)."""
    if not tf.config.list_physical_devices("GPU"):
        kr.simulate_devices(config.replicas)  # the launcher's --devices-per-worker wins
        return kr.ReplicatorStrategy()
    return kr.ReplicatorStrategy([f"/gpu:{i}" for i in range(config.replicas)])


def model_config(config: RunConfig) -> models.SNGANConfig:
    """The networks' configuration: ``config.config`` with its width and channels set."""
    cfg = models.get_config(config.config)
    if config.ch:
        cfg = dataclasses.replace(cfg, ch=config.ch)
    if config.dataset == "digits":
        cfg = dataclasses.replace(cfg, channels=1)
    return cfg


@dataclasses.dataclass(frozen=True)
class RunData:
    """The training batches, and what measures the samples (``extractor`` None: not measured)."""

    train: Any
    num_classes: int
    extractor: Any = None
    real_features: Any = None
    #: The real digits (images, labels); None on imagenet2012.
    images: Any = None
    labels: Any = None


def _digits_judge(config: RunConfig, x, y, chief: bool):
    """The classifier whose features FID uses, kept with the run (trained once per run folder).

    A resumed run measures with the same features (and does not train it again). In a
    cluster the other workers measure with their own, unrecorded: only the chief's metrics
    are written.
    """
    classifier_path = os.path.join(config.out, "classifier.keras")
    if os.path.exists(classifier_path):
        return keras.saving.load_model(classifier_path)
    classifier = metrics.train_digits_classifier(x, y)
    if chief:
        _runs.write_atomically(classifier_path, classifier.save)
    return classifier


def make_data(config: RunConfig, strategy, cfg: models.SNGANConfig) -> RunData:
    """The dataset's training batches, and the features of real images for FID."""
    if config.dataset == "digits":
        x, y = data.digits(cfg.image_size)
        train = data.digits_dataset(config.global_batch_size, config.n_dis, image_size=cfg.image_size,
                                    num_replicas=strategy.num_replicas_in_sync, seed=config.seed,
                                    data=(x, y))
        extractor = metrics.classifier_extractor(_digits_judge(config, x, y, strategy.is_chief))
        real_feats, _ = metrics.real_features(extractor, x)
        return RunData(train, data.DIGITS_CLASSES, extractor, real_feats, x, y)
    train = data.imagenet_dataset(strategy, config.global_batch_size, config.n_dis,
                                  image_size=cfg.image_size, data_dir=config.data_dir, seed=config.seed)
    if not config.inception_weights:
        return RunData(train, 1000)
    extractor = metrics.inception_extractor(config.inception_weights)
    val = data.imagenet_input_fn("validation", image_size=cfg.image_size, data_dir=config.data_dir)(None)
    images = np.concatenate([b[0].numpy() for b in val.batch(250).take(
        -(-config.eval_samples // 250))])[:config.eval_samples]
    real_feats, _ = metrics.real_features(extractor, images)
    return RunData(train, 1000, extractor, real_feats)


def make_gan(config: RunConfig, strategy, cfg: models.SNGANConfig, num_classes: int) -> training.SNGAN:
    """The compiled GAN, its variables under ``strategy``."""
    with strategy.scope():
        keras.utils.set_random_seed(config.seed)
        gan = training.SNGAN(models.generator(cfg, num_classes), models.discriminator(cfg, num_classes),
                             num_classes=num_classes, n_dis=config.n_dis, seed=config.seed,
                             ema_decay=None if config.ema_decay < 0 else config.ema_decay)
        gan.compile(d_optimizer=training.default_optimizer(config.learning_rate),
                    g_optimizer=training.default_optimizer(config.learning_rate))
    return gan


# --- the checkpoint: OUT/checkpoint/gan-STEP.weights.h5 and state.json naming it ------------


def _checkpoint(config: RunConfig) -> str:
    return os.path.join(config.out, "checkpoint")


def write_state(folder: str, gan, step: int) -> None:
    """Weights first, then `state.json` naming them (each replaced atomically), then old files.

    Every worker of a cluster calls it (reading the weights may need them all); only the
    chief writes to `folder`.
    """
    name = f"gan-{step}.weights.h5"
    if gan.distribute_strategy.is_chief:
        os.makedirs(folder, exist_ok=True)
    if not _runs.write_atomically(os.path.join(folder, name), lambda tmp: kr.save_model(gan, tmp)):
        return
    _runs.write_json(os.path.join(folder, "state.json"), {"step": step, "weights": name})
    for old in os.listdir(folder):
        if old.startswith("gan-") and old != name:
            os.remove(os.path.join(folder, old))


def resume(config: RunConfig, gan, strategy) -> int:
    """Loads the run's checkpoint if there is one; returns the generator updates done."""
    checkpoint = _checkpoint(config)
    state = _runs.read_json(os.path.join(checkpoint, "state.json"))
    if state is None:
        return 0
    with strategy.scope():
        gan.load_weights(os.path.join(checkpoint, state["weights"]))
    done = int(gan.g_optimizer.iterations.numpy())
    if done != state["step"]:
        raise SystemExit(f"{checkpoint}: state.json says step {state['step']} but the "
                         f"weights hold {done} generator updates")
    print(f"resuming from step {done} ({checkpoint})", flush=True)
    return done


# --- evaluation intervals ---------------------------------------------------------------


def evaluate(config: RunConfig, cfg: models.SNGANConfig, gan, strategy, run_data: RunData,
             step: int) -> dict:
    """FID, Inception Score and (on digits) the class accuracy and per-class diversity of
    generated samples (``cfg``: the networks' configuration, for metrics that draw latents
    themselves)."""
    if run_data.extractor is None:
        return {}
    with strategy.scope():
        sampler = gan.sampler()
    # Latents keyed by (seed + step, round, replica): never the training's, which
    # are keyed by (seed, ...) (see SNGAN._latents).
    feats, probs, asked = metrics.generated_features(
        strategy, sampler, run_data.extractor, num_samples=config.eval_samples,
        num_classes=run_data.num_classes, seed=config.seed + step)
    record = {"fid": metrics.frechet_distance(*metrics.gaussian_statistics(run_data.real_features),
                                              *metrics.gaussian_statistics(feats)),
              "inception_score": metrics.inception_score(probs)[0]}
    if config.dataset == "digits":
        # The classifier of real digits names the class asked for.
        record["class_accuracy"] = float(np.mean(np.argmax(probs, 1) == asked))
        # Within-class diversity (8x8) over real digits', every class: a mean over classes
        # would hide one collapsed class.
        ratios = _class_diversity(sampler, cfg.z_dim, run_data.images, run_data.labels,
                                  config.seed + step)
        record["worst_class_diversity"] = float(ratios.min())
        record["class_diversity"] = [round(float(r), 4) for r in ratios]
    return record


def _class_diversity(sampler, z_dim: int, x, y, seed: int, per_class: int = 100):
    """`metrics.class_diversity` of `per_class` samples of each digit (latents from `seed`)."""
    classes = int(y.max()) + 1
    z = np.random.default_rng(seed).standard_normal((classes * per_class, z_dim)).astype("float32")
    labels = np.repeat(np.arange(classes, dtype=np.int32), per_class)
    samples = sampler([z, labels], training=False).numpy()
    return metrics.class_diversity(samples, labels, x, y, per_class=per_class)


class Interval(keras.callbacks.Callback):
    """Evaluates, writes metrics.json and the checkpoint; stops at exactly ``config.steps``.

    Its own state: ``history`` (metrics.json's records) and ``train_seconds``, the time in
    training steps summed over resumes: fit's epochs without the evaluation and checkpoint
    (done in on_epoch_end) and without this process's first step (graph building). One
    instance serves every ``fit`` of the invocation.

    Example:
        ```python
        interval = Interval(config, cfg, gan, strategy, run_data, history=[])
        gan.fit(train, epochs=3, steps_per_epoch=config.eval_every, callbacks=[interval])
        ```
    """

    def __init__(self, config: RunConfig, cfg: models.SNGANConfig, gan, strategy, run_data: RunData,
                 history: list[dict]):
        super().__init__()
        self.config, self.cfg, self.gan, self.strategy, self.run_data = config, cfg, gan, strategy, run_data
        self.history = history
        self.start = time.time()
        self.train_seconds = history[-1].get("train_seconds", 0.0) if history else 0.0
        self.built = False
        self.begin = 0.0

    def on_train_batch_end(self, batch, logs=None):
        if int(self.gan.g_optimizer.iterations.numpy()) >= self.config.steps:
            self.model.stop_training = True
        if not self.built:
            self.built, self.begin = True, time.perf_counter()

    def on_epoch_begin(self, epoch, logs=None):
        self.begin = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.train_seconds += time.perf_counter() - self.begin
        step = int(self.gan.g_optimizer.iterations.numpy())
        record = {"step": step, "d_loss": float(logs["d_loss"]), "g_loss": float(logs["g_loss"]),
                  "seconds": time.time() - self.start, "train_seconds": self.train_seconds}
        record.update(evaluate(self.config, self.cfg, self.gan, self.strategy, self.run_data, step))
        self.history[:] = [h for h in self.history if h["step"] < step] + [record]
        chief = self.strategy.is_chief
        if chief:
            _runs.write_json(os.path.join(self.config.out, "metrics.json"), self.history, indent=1)
        write_state(_checkpoint(self.config), self.gan, step)
        if chief:
            print("step {step}: ".format(**record) + ", ".join(
                f"{k} {v:.4g}" if k != "class_diversity" else f"{k} {v}"
                for k, v in record.items() if k != "step"), flush=True)


def fit(config: RunConfig, gan, train, interval: Interval, done: int) -> None:
    """Trains from ``done`` to ``config.steps`` generator updates, in evaluation intervals.

    Intervals end at multiples of ``eval_every`` (and at ``steps``): a resumed run
    first completes the interval it was in.
    """
    verbose = config.verbose if gan.distribute_strategy.is_chief else 0
    if done >= config.steps:
        return
    first = config.eval_every - done % config.eval_every
    if first < config.eval_every:
        gan.fit(train, epochs=1, steps_per_epoch=min(first, config.steps - done),
                verbose=verbose, shuffle=False, callbacks=[interval])
        done = int(gan.g_optimizer.iterations.numpy())
    if done < config.steps:
        gan.fit(train, epochs=-(-(config.steps - done) // config.eval_every),
                steps_per_epoch=config.eval_every, verbose=verbose, shuffle=False, callbacks=[interval])


def _samples_png(path: str, images, rows: int, cols: int) -> None:
    from PIL import Image

    images = np.asarray((images + 1.0) * 127.5).clip(0, 255).astype(np.uint8)
    n, h, w, c = images.shape
    grid = images.reshape(rows, cols, h, w, c).transpose(0, 2, 1, 3, 4).reshape(rows * h, cols * w, c)
    Image.fromarray(grid[..., 0] if c == 1 else grid).save(path)


def write_outputs(config: RunConfig, gan, strategy, cfg: models.SNGANConfig, num_classes: int) -> None:
    """`generator.keras` (every worker saves; the chief's lands in OUT) and, on the chief, `samples.png`."""
    with strategy.scope():
        sampler = gan.sampler()
    kr.save_model(sampler, os.path.join(config.out, "generator.keras"))
    if not strategy.is_chief:
        return
    rows = min(num_classes, 10)
    z = np.random.default_rng(config.seed).standard_normal((rows * 10, cfg.z_dim)).astype("float32")
    labels = np.repeat(np.arange(rows, dtype=np.int32), 10)
    _samples_png(os.path.join(config.out, "samples.png"),
                 sampler([z, labels], training=False).numpy(), rows, 10)
    print(f"wrote {config.out}/generator.keras, metrics.json, samples.png")


def run(config: RunConfig, strategy=None) -> None:
    """Trains (or resumes) the run ``config`` describes, writing to ``config.out`` on the chief."""
    # The strategy first, before any tensor: in a cluster it configures TensorFlow's runtime.
    strategy = strategy or make_strategy(config)
    if strategy.is_chief:
        os.makedirs(config.out, exist_ok=True)
    cfg = model_config(config)
    run_data = make_data(config, strategy, cfg)
    gan = make_gan(config, strategy, cfg, run_data.num_classes)
    done = resume(config, gan, strategy)
    history = _runs.read_json(os.path.join(config.out, "metrics.json"), default=[])
    history = [h for h in history if h["step"] <= done]  # past the checkpoint: redone
    fit(config, gan, run_data.train, Interval(config, cfg, gan, strategy, run_data, history), done)
    write_outputs(config, gan, strategy, cfg, run_data.num_classes)
