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

The command line only fills a `config.RunConfig` (`config_from_args`, which refuses every bad
input before TensorFlow starts); `builder.run` trains it.

`OUT/checkpoint/` holds the run's own state, written atomically after every
evaluation interval: `gan-STEP.weights.h5` (both networks, the EMA weights, the
spectral-norm vectors and both optimizers' state, which includes the step) and
`state.json` naming it; on digits, `OUT/classifier.keras` is the classifier whose
features FID uses, trained once per run directory. A rerun of the command resumes from it, after an
interruption or with a larger `--steps`; the checkpoint stays after the run ends.
"""

from __future__ import annotations

import argparse
import os
import sys

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


def config_from_args(argv: list[str] | None, parser: argparse.ArgumentParser):
    """The `RunConfig` the command line asks for, every bad input refused before TensorFlow starts.

    A flag left out takes its dataset's default (`DEFAULTS`).
    """
    from keras_replicator.applications.sngan.config import RunConfig

    given = vars(parser.parse_args(argv))
    if given["dataset"] not in DATASETS:
        parser.error(f"unknown dataset {given['dataset']!r}; choose one of {', '.join(DATASETS)}")
    for name, value in DEFAULTS[given["dataset"]].items():
        if given[name] is None:
            given[name] = value
    args = RunConfig(**given)
    _check(args, parser)
    return args


def _check(args, parser: argparse.ArgumentParser) -> None:
    """Every bad input is refused here, before TensorFlow starts."""
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


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    config = config_from_args(argv, parser)
    from keras_replicator.applications.sngan import builder

    # The strategy first, before any tensor: in a cluster it configures TensorFlow's runtime.
    strategy = builder.make_strategy(config)
    if config.global_batch_size % strategy.num_replicas_in_sync:
        parser.error(f"--global-batch-size {config.global_batch_size} is not divisible by the "
                     f"{strategy.num_replicas_in_sync} replicas of {strategy}")
    builder.run(config, strategy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
