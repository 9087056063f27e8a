"""`python -m keras_replicator.applications.sngan`: train the tutorial's SN-GAN.

Example:
    ```bash
    python -m keras_replicator.applications.sngan --dataset digits --out runs/digits
    # the same run on 2 worker processes of 2 simulated devices each:
    keras-replicator launch --workers 2 --devices-per-worker 2 \
        -m keras_replicator.applications.sngan --dataset digits --out runs/digits2x2
    ```

Each dataset has its defaults (`DEFAULTS`): on digits the small-scale ones, chosen so the
command finishes in minutes on a CPU (`small16`, global batch 128, one discriminator update
per generator update, learning rate 1e-3: see the tutorial's large-batch study); on
imagenet2012 SN-GAN's (`imagenet128`, batch 64, `n_dis` 5, 2e-4, 450k updates).

Under the launcher (or any `TF_CONFIG` or Slurm cluster) the strategy spans every worker:
`--replicas` is then the replicas of each worker (the launcher's `--devices-per-worker` wins on
a CPU), the global batch is split over all of them, and only the chief writes to `OUT` (the
other workers save to temporary places, as `kr.save_model` does); every worker reads `OUT`'s
checkpoint to resume, so `OUT` must be a folder they share.

Writes `OUT/generator.keras` (the EMA generator if EMA is on), `OUT/metrics.json` (one
record per evaluation interval: `step`, the losses, FID and Inception Score, on digits the
`class_accuracy` of the samples and their `class_diversity` (per class, 8x8 within-class
distance over real digits') with its minimum `worst_class_diversity`, `seconds` since this
invocation started and `train_seconds`,
the run's time spent in training steps, summed over resumes: without the evaluations, the
checkpoints and each invocation's first step, which traces and builds the step's graph) and
`OUT/samples.png` (one row per class).

`OUT/checkpoint/` holds the run's own state, written atomically after every
evaluation interval: `gan-STEP.weights.h5` (both networks, the EMA weights, the
spectral-norm vectors and both optimizers' state, which includes the step) and
`state.json` naming it; on digits, `OUT/classifier.keras` is the classifier whose
features FID uses, trained once per run directory. A rerun of the command resumes from it, after an
interruption or with a larger `--steps`; the checkpoint stays after the run ends.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from keras_replicator.__main__ import _non_negative_int, _positive_float, _positive_int

DATASETS = ("digits", "imagenet2012")
# What a flag left out means, by dataset. digits: minutes on a CPU (docs/sngan_large_batch.md
# measured small16 with n_dis 1 and 1e-3: class accuracy 0.91 at 300 updates with batch 128);
# imagenet2012: SN-GAN's projection model (Miyato & Koyama 2018), 450k updates.
DEFAULTS = {
    "digits": {"config": "small16", "global_batch_size": 128, "steps": 600, "n_dis": 1,
               "learning_rate": 1e-3, "eval_every": 100},
    "imagenet2012": {"config": "imagenet128", "global_batch_size": 64, "steps": 450_000,
                     "n_dis": 5, "learning_rate": 2e-4, "eval_every": 5000},
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m keras_replicator.applications.sngan",
        description="Train the class-conditional SN-GAN of tutorial 2 with ReplicatorStrategy.")
    p.add_argument("--dataset", required=True, help=f"one of {', '.join(DATASETS)}")
    p.add_argument("--out", required=True, help="output directory (rerun to resume)")
    p.add_argument("--data-dir", default=None, help="TFDS data_dir of imagenet2012")
    p.add_argument("--config", default=None,
                   help="small16 (digits default), small32 or imagenet128 (imagenet2012 default)")
    p.add_argument("--ch", type=_positive_int, default=None,
                   help="base width of both networks (default: the configuration's)")
    p.add_argument("--image-size", type=_positive_int, default=None,
                   help="image side; must be what the configuration makes")
    p.add_argument("--global-batch-size", type=_positive_int, default=None,
                   help="examples per discriminator update over all replicas (digits 128, "
                   "imagenet2012 64)")
    p.add_argument("--steps", type=_positive_int, default=None,
                   help="generator updates (digits 600, imagenet2012 450000)")
    p.add_argument("--replicas", type=_positive_int, default=4,
                   help="replicas of this machine, or of each worker under the launcher "
                   "(simulated CPU devices when there is no GPU)")
    p.add_argument("--n-dis", type=_positive_int, default=None,
                   help="discriminator updates per generator update (digits 1, imagenet2012 5)")
    p.add_argument("--learning-rate", type=_positive_float, default=None,
                   help="Adam's, both networks (digits 1e-3, imagenet2012 2e-4)")
    p.add_argument("--ema-decay", type=float, default=0.999,
                   help="generator EMA decay, warmed up (negative: no EMA)")
    p.add_argument("--eval-every", type=_positive_int, default=None,
                   help="generator updates between evaluations and checkpoints "
                   "(digits 100, imagenet2012 5000)")
    p.add_argument("--eval-samples", type=_positive_int, default=1000)
    p.add_argument("--inception-weights", default=None,
                   help="InceptionV3 weights file for FID/IS on imagenet2012 (none: skipped)")
    p.add_argument("--seed", type=_non_negative_int, default=0)
    p.add_argument("--verbose", type=int, choices=(0, 1, 2), default=2)
    return p


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Every bad input is refused here, before TensorFlow starts."""
    if args.dataset not in DATASETS:
        parser.error(f"unknown dataset {args.dataset!r}; choose one of {', '.join(DATASETS)}")
    for name, value in DEFAULTS[args.dataset].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    from keras_replicator import cluster

    try:  # a TF_CONFIG (launcher, Kubeflow) or Slurm cluster: every worker's replicas share it
        resolver = cluster.resolve_cluster()
        local = cluster._devices_per_worker_from_env() or args.replicas  # the launcher's K wins
    except cluster.ClusterConfigError as e:
        parser.error(str(e))
    jobs = resolver.cluster_spec().as_dict() if resolver is not None else {}
    workers = sum(len(jobs.get(job, ())) for job in ("chief", "worker")) or 1
    if args.global_batch_size % (workers * local):
        parser.error(f"--global-batch-size {args.global_batch_size} is not divisible by "
                     + (f"--replicas {args.replicas}" if workers == 1 and local == args.replicas
                        else f"the job's {workers * local} replicas ({workers} workers x {local})"))
    if args.ema_decay >= 1.0:
        parser.error(f"--ema-decay must be < 1 (negative for no EMA), got {args.ema_decay}")
    from keras_replicator.applications.sngan import models

    try:
        cfg = models.get_config(args.config)
    except ValueError as e:
        parser.error(str(e))
    size = args.image_size or cfg.image_size
    if size != cfg.image_size:
        parser.error(f"--image-size {size} cannot be made by configuration {args.config!r} "
                     f"(it makes {cfg.image_size}x{cfg.image_size} images)")
    if args.dataset == "imagenet2012" and args.inception_weights and not os.path.exists(
            args.inception_weights):
        parser.error(f"--inception-weights {args.inception_weights!r} does not exist")


def _samples_png(path: str, images, rows: int, cols: int) -> None:
    import numpy as np
    from PIL import Image

    images = np.asarray((images + 1.0) * 127.5).clip(0, 255).astype(np.uint8)
    n, h, w, c = images.shape
    grid = images.reshape(rows, cols, h, w, c).transpose(0, 2, 1, 3, 4).reshape(rows * h, cols * w, c)
    Image.fromarray(grid[..., 0] if c == 1 else grid).save(path)


def _class_diversity(sampler, z_dim: int, x, y, seed: int, per_class: int = 100):
    """`metrics.class_diversity` of `per_class` samples of each digit (latents from `seed`)."""
    import numpy as np

    from keras_replicator.applications.sngan import metrics

    classes = int(y.max()) + 1
    z = np.random.default_rng(seed).standard_normal((classes * per_class, z_dim)).astype("float32")
    labels = np.repeat(np.arange(classes, dtype=np.int32), per_class)
    samples = sampler([z, labels], training=False).numpy()
    return metrics.class_diversity(samples, labels, x, y, per_class=per_class)


def _read_state(folder: str) -> dict | None:
    path = os.path.join(folder, "state.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _write_state(folder: str, gan, step: int) -> None:
    """Weights first, then `state.json` naming them (each replaced atomically), then old files.

    Every worker of a cluster calls it (reading the weights may need them all); only the
    chief writes to `folder`.
    """
    import keras_replicator as kr

    name = f"gan-{step}.weights.h5"
    tmp = os.path.join(folder, f".tmp-{name}")
    if gan.distribute_strategy.is_chief:
        os.makedirs(folder, exist_ok=True)
    if not kr.save_model(gan, tmp):
        return
    os.replace(tmp, os.path.join(folder, name))
    with open(os.path.join(folder, ".tmp-state.json"), "w") as f:
        json.dump({"step": step, "weights": name}, f)
    os.replace(os.path.join(folder, ".tmp-state.json"), os.path.join(folder, "state.json"))
    for old in os.listdir(folder):
        if old.startswith("gan-") and old != name:
            os.remove(os.path.join(folder, old))


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _check(args, parser)

    import tensorflow as tf

    import keras_replicator as kr

    # The strategy first, before any tensor: in a cluster it configures TensorFlow's runtime.
    if not tf.config.list_physical_devices("GPU"):
        kr.simulate_devices(args.replicas)  # the launcher's --devices-per-worker wins
        strategy = kr.ReplicatorStrategy()
    else:
        strategy = kr.ReplicatorStrategy([f"/gpu:{i}" for i in range(args.replicas)])
    if args.global_batch_size % strategy.num_replicas_in_sync:
        parser.error(f"--global-batch-size {args.global_batch_size} is not divisible by the "
                     f"{strategy.num_replicas_in_sync} replicas of {strategy}")
    chief = strategy.is_chief  # only the chief writes to --out; every worker reads it

    import dataclasses

    import keras
    import numpy as np

    from keras_replicator.applications import sngan
    from keras_replicator.applications.sngan import metrics

    if chief:
        os.makedirs(args.out, exist_ok=True)
    cfg = sngan.get_config(args.config)
    if args.ch:
        cfg = dataclasses.replace(cfg, ch=args.ch)
    if args.dataset == "digits":
        cfg = dataclasses.replace(cfg, channels=1)
        x, y = sngan.digits(cfg.image_size)
        num_classes = sngan.DIGITS_CLASSES
        train = sngan.digits_dataset(args.global_batch_size, args.n_dis, image_size=cfg.image_size,
                                     num_replicas=strategy.num_replicas_in_sync, seed=args.seed,
                                     data=(x, y))
        # The judge of FID and accuracy is kept with the run: a resumed run measures with the
        # same features (and does not train it again).
        classifier_path = os.path.join(args.out, "classifier.keras")
        # (In a cluster the other workers measure with their own, unrecorded: only the
        # chief's metrics are written.)
        if os.path.exists(classifier_path):
            classifier = keras.saving.load_model(classifier_path)
        else:
            classifier = metrics.train_digits_classifier(x, y)
            if chief:
                classifier.save(classifier_path + ".tmp.keras")
                os.replace(classifier_path + ".tmp.keras", classifier_path)
        extractor = metrics.classifier_extractor(classifier)
        real_feats, _ = metrics.real_features(extractor, x)
    else:
        num_classes = 1000
        train = sngan.imagenet_dataset(strategy, args.global_batch_size, args.n_dis,
                                       image_size=cfg.image_size, data_dir=args.data_dir,
                                       seed=args.seed)
        extractor = real_feats = None
        if args.inception_weights:
            extractor = metrics.inception_extractor(args.inception_weights)
            val = sngan.imagenet_input_fn("validation", image_size=cfg.image_size,
                                          data_dir=args.data_dir)(None)
            images = np.concatenate([b[0].numpy() for b in val.batch(250).take(
                -(-args.eval_samples // 250))])[:args.eval_samples]
            real_feats, _ = metrics.real_features(extractor, images)

    with strategy.scope():
        keras.utils.set_random_seed(args.seed)
        gan = sngan.SNGAN(sngan.generator(cfg, num_classes), sngan.discriminator(cfg, num_classes),
                          num_classes=num_classes, n_dis=args.n_dis, seed=args.seed,
                          ema_decay=None if args.ema_decay < 0 else args.ema_decay)
        gan.compile(d_optimizer=sngan.default_optimizer(args.learning_rate),
                    g_optimizer=sngan.default_optimizer(args.learning_rate))

    checkpoint = os.path.join(args.out, "checkpoint")
    state = _read_state(checkpoint)
    done = 0
    if state is not None:
        with strategy.scope():
            gan.load_weights(os.path.join(checkpoint, state["weights"]))
        done = int(gan.g_optimizer.iterations.numpy())
        if done != state["step"]:
            raise SystemExit(f"{checkpoint}: state.json says step {state['step']} but the "
                             f"weights hold {done} generator updates")
        print(f"resuming from step {done} ({checkpoint})", flush=True)

    metrics_path = os.path.join(args.out, "metrics.json")
    history = json.load(open(metrics_path)) if os.path.exists(metrics_path) else []
    history = [h for h in history if h["step"] <= done]  # past the checkpoint: redone
    start = time.time()
    # Time in training steps, summed over resumes: fit's epochs without the evaluation and
    # checkpoint (done in on_epoch_end) and without this process's first step (graph building).
    clock = {"train": history[-1].get("train_seconds", 0.0) if history else 0.0, "built": False}

    class Interval(keras.callbacks.Callback):
        """Evaluates, writes metrics.json and the checkpoint; stops at exactly --steps."""

        def on_train_batch_end(self, batch, logs=None):
            if int(gan.g_optimizer.iterations.numpy()) >= args.steps:
                self.model.stop_training = True
            if not clock["built"]:
                clock["built"], clock["begin"] = True, time.perf_counter()

        def on_epoch_begin(self, epoch, logs=None):
            clock["begin"] = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            clock["train"] += time.perf_counter() - clock["begin"]
            step = int(gan.g_optimizer.iterations.numpy())
            record = {"step": step, "d_loss": float(logs["d_loss"]),
                      "g_loss": float(logs["g_loss"]),
                      "seconds": time.time() - start, "train_seconds": clock["train"]}
            if extractor is not None:
                with strategy.scope():
                    sampler = gan.sampler()
                # Latents keyed by (seed + step, round, replica): never the training's, which
                # are keyed by (seed, ...) (see SNGAN._latents).
                feats, probs, asked = metrics.generated_features(
                    strategy, sampler, extractor, num_samples=args.eval_samples,
                    num_classes=num_classes, seed=args.seed + step)
                record["fid"] = metrics.frechet_distance(
                    *metrics.gaussian_statistics(real_feats), *metrics.gaussian_statistics(feats))
                record["inception_score"] = metrics.inception_score(probs)[0]
                if args.dataset == "digits":
                    # The classifier of real digits names the class asked for.
                    record["class_accuracy"] = float(np.mean(np.argmax(probs, 1) == asked))
                    # Within-class diversity (8x8) over real digits', every class: a mean
                    # over classes would hide one collapsed class.
                    ratios = _class_diversity(sampler, cfg.z_dim, x, y, args.seed + step)
                    record["worst_class_diversity"] = float(ratios.min())
                    record["class_diversity"] = [round(float(r), 4) for r in ratios]
            history[:] = [h for h in history if h["step"] < step] + [record]
            if chief:
                with open(metrics_path + ".tmp", "w") as f:
                    json.dump(history, f, indent=1)
                os.replace(metrics_path + ".tmp", metrics_path)
            _write_state(checkpoint, gan, step)
            if chief:
                print("step {step}: ".format(**record) + ", ".join(
                    f"{k} {v:.4g}" if k != "class_diversity" else f"{k} {v}"
                    for k, v in record.items() if k != "step"), flush=True)

    verbose = args.verbose if chief else 0
    if done < args.steps:
        # Intervals end at multiples of --eval-every (and at --steps): a resumed run
        # first completes the interval it was in.
        first = args.eval_every - done % args.eval_every
        if first < args.eval_every:
            gan.fit(train, epochs=1, steps_per_epoch=min(first, args.steps - done),
                    verbose=verbose, shuffle=False, callbacks=[Interval()])
            done = int(gan.g_optimizer.iterations.numpy())
        if done < args.steps:
            gan.fit(train, epochs=-(-(args.steps - done) // args.eval_every),
                    steps_per_epoch=args.eval_every, verbose=verbose, shuffle=False, callbacks=[Interval()])

    with strategy.scope():
        sampler = gan.sampler()
    kr.save_model(sampler, os.path.join(args.out, "generator.keras"))
    if not chief:
        return 0
    rows = min(num_classes, 10)
    z = np.random.default_rng(args.seed).standard_normal((rows * 10, cfg.z_dim)).astype("float32")
    labels = np.repeat(np.arange(rows, dtype=np.int32), 10)
    _samples_png(os.path.join(args.out, "samples.png"),
                 sampler([z, labels], training=False).numpy(), rows, 10)
    print(f"wrote {args.out}/generator.keras, metrics.json, samples.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
