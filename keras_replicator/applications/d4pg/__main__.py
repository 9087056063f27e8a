"""`python -m keras_replicator.applications.d4pg --env Pendulum-v1 --out DIR`: train D4PG.

Writes `DIR/policy.keras`, `DIR/returns.csv`, `DIR/learning_curve.png` and `DIR/checkpoint.npz`
(a second run with the same `--out` resumes from it).
"""

from __future__ import annotations

import argparse
import os
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m keras_replicator.applications.d4pg",
        description="D4PG: Ray actors feeding a learner replicated with ReplicatorStrategy.",
    )
    p.add_argument("--env", default="Pendulum-v1",
                   help="Gymnasium id, e.g. Pendulum-v1 or dm_control/cartpole-swingup-v0")
    p.add_argument("--out", required=True, help="output directory (resumed if it has a run)")
    p.add_argument("--actors", type=int, default=2, help="number of Ray actors (default 2)")
    p.add_argument("--replicas", type=int, default=2,
                   help="learner replicas (simulated CPU devices on a CPU-only machine)")
    p.add_argument("--env-steps", type=int, default=20_000, help="environment steps in all")
    p.add_argument("--samples-per-insert", type=float, default=32.0,
                   help="rate limiter: transitions sampled per transition inserted (Acme: 32)")
    p.add_argument("--batch-size", type=int, default=256, help="global batch (default 256)")
    p.add_argument("--learning-rate", type=float, default=None,
                   help="Adam's, both networks (default: 1e-3 for Pendulum-v1, else 1e-4 as Acme)")
    p.add_argument("--eval-every", type=int, default=2_000, help="env steps between evaluations")
    p.add_argument("--eval-episodes", type=int, default=10)
    p.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (default: a local instance on 127.0.0.1)")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    for name in ("actors", "replicas", "env_steps", "batch_size", "eval_every", "eval_episodes"):
        if getattr(args, name) < 1:
            _parser().error(f"--{name.replace('_', '-')} must be a positive integer, "
                            f"got {getattr(args, name)}.")
    if args.learning_rate is not None and not args.learning_rate > 0:
        _parser().error(f"--learning-rate must be positive, got {args.learning_rate}.")
    if not args.samples_per_insert > 0:
        _parser().error(f"--samples-per-insert must be positive, got {args.samples_per_insert}.")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras_replicator as kr

    try:
        from keras_replicator.applications.d4pg import environments

        environments.env_spec(args.env)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import tensorflow as tf

    if not tf.config.list_physical_devices("GPU"):
        kr.simulate_devices(args.replicas)
    from keras_replicator.applications.d4pg import training

    rows = training.train(
        args.env, args.out, actors=args.actors, replicas=args.replicas,
        env_steps=args.env_steps, samples_per_insert=args.samples_per_insert,
        batch_size=args.batch_size, seed=args.seed, ray_address=args.ray_address,
        learning_rate=args.learning_rate, eval_every=args.eval_every, eval_episodes=args.eval_episodes,
    )
    if rows:
        print(f"final evaluation return {rows[-1]['eval_return']:.1f} after "
              f"{int(rows[-1]['env_steps'])} environment steps; outputs in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
