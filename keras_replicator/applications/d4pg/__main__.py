"""`python -m keras_replicator.applications.d4pg --env Pendulum-v1 --out DIR`: train D4PG.

Writes `DIR/policy.keras`, `DIR/returns.csv`, `DIR/learning_curve.png`, `DIR/checkpoint.npz`
(a second run with the same `--out` resumes from it) and `DIR/final_evaluation.json` (the saved
policy on 100 held-out episodes).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

# The command line only fills a D4PGConfig: its defaults and checks are the config's and the
# builder's (imported when the command runs: they start TensorFlow).
_FLAGS = {"env_id": "--env", "out_dir": "--out"}


def _parser() -> argparse.ArgumentParser:
    from keras_replicator.applications.d4pg.config import D4PGConfig as C

    p = argparse.ArgumentParser(
        prog="python -m keras_replicator.applications.d4pg",
        description="D4PG: Ray actors feeding a learner replicated with ReplicatorStrategy.",
    )
    p.add_argument("--env", dest="env_id", default="Pendulum-v1",
                   help="Gymnasium id, e.g. Pendulum-v1 or dm_control/cartpole-swingup-v0")
    p.add_argument("--out", dest="out_dir", required=True,
                   help="output directory (resumed if it has a run)")
    p.add_argument("--actors", type=int, default=C.actors, help=f"number of Ray actors (default {C.actors})")
    p.add_argument("--replicas", type=int, default=2,
                   help="learner replicas (simulated CPU devices on a CPU-only machine)")
    p.add_argument("--env-steps", type=int, default=C.env_steps, help="environment steps in all")
    p.add_argument("--samples-per-insert", type=float, default=C.samples_per_insert,
                   help="rate limiter: transitions sampled per transition inserted (Acme: 32)")
    p.add_argument("--batch-size", type=int, default=C.batch_size,
                   help=f"global batch (default {C.batch_size})")
    p.add_argument("--learning-rate", type=float, default=C.learning_rate,
                   help="Adam's, both networks (default: 1e-3 for Pendulum-v1, else 1e-4 as Acme)")
    p.add_argument("--target-update-period", type=int, default=C.target_update_period,
                   help="learner updates between target copies (default: 20 for Pendulum-v1, "
                        "else 100 as Acme)")
    p.add_argument("--pre-tanh-penalty", type=float, default=C.pre_tanh_penalty,
                   help="penalty on the policy's pre-tanh outputs (default: 1e-3 for "
                        "Pendulum-v1, else 0 as Acme)")
    p.add_argument("--eval-every", type=int, default=C.eval_every, help="env steps between evaluations")
    p.add_argument("--eval-episodes", type=int, default=C.eval_episodes,
                   help=f"episodes of each learning-curve evaluation (default {C.eval_episodes})")
    p.add_argument("--final-eval-episodes", type=int, default=C.final_eval_episodes,
                   help="episodes of the final held-out evaluation of policy.keras "
                        f"(default {C.final_eval_episodes})")
    p.add_argument("--ray-address", default=C.ray_address,
                   help="join this Ray cluster (default: a local instance on 127.0.0.1)")
    p.add_argument("--seed", type=int, default=C.seed)
    return p


def config_from_args(argv=None):
    """The `D4PGConfig` the command line asks for, its arguments checked (exits on a bad one)."""
    from keras_replicator.applications.d4pg import builder
    from keras_replicator.applications.d4pg.config import D4PGConfig

    parser = _parser()
    config = D4PGConfig(**vars(parser.parse_args(argv)))
    try:
        return builder.check_arguments(config)
    except ValueError as e:  # "<field> must be ...": named as its flag
        name, _, rest = str(e).partition(" ")
        if name not in {f.name for f in dataclasses.fields(D4PGConfig)}:
            raise
        parser.error(f"{_FLAGS.get(name, '--' + name.replace('_', '-'))} {rest}")


def main(argv=None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    config = config_from_args(argv)
    import keras_replicator as kr

    try:
        from keras_replicator.applications.d4pg import environments

        environments.env_spec(config.env_id)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import tensorflow as tf

    if not tf.config.list_physical_devices("GPU"):
        kr.simulate_devices(config.replicas)
    from keras_replicator.applications.d4pg import training

    training.run(config)
    final = training.read_final_evaluation(config.out_dir)
    if final:
        print(f"held-out evaluation of policy.keras: mean {final['mean']:.1f} +- "
              f"{final['std']:.1f} (worst {final['worst']:.1f}) over {final['episodes']} episodes "
              f"after {final['env_steps']} environment steps; outputs in {config.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
