"""The pieces of a D4PG run, each built from a `D4PGConfig` (as Acme's `d4pg/builder.py`).

`check_config` refuses a bad configuration before Ray or TensorFlow does any work and
fills what the configuration leaves to the task (the learning rate) or the machine (the
replicas); `make_strategy`, `make_learner`, `make_replay`, `make_actors` and `make_feeder`
build the run's parts; `training.run` wires them.

Example:
    ```python
    from keras_replicator.applications.d4pg import builder
    from keras_replicator.applications.d4pg.config import D4PGConfig

    config = builder.check_config(D4PGConfig("Pendulum-v1", "runs/pendulum", replicas=2))
    strategy = builder.make_strategy(config)
    learner = builder.make_learner(config, strategy)
    ```
"""

from __future__ import annotations

import dataclasses
import os

from keras_replicator._validation import ArgumentError, check_int, check_number
from keras_replicator.applications.d4pg import actors as actors_lib
from keras_replicator.applications.d4pg import environments, replay
from keras_replicator.applications.d4pg.config import D4PGConfig
from keras_replicator.applications.d4pg.feeder import Feeder
from keras_replicator.applications.d4pg.learner import D4PGLearner

__all__ = [
    "check_arguments",
    "check_config",
    "make_actors",
    "make_feeder",
    "make_learner",
    "make_replay",
    "make_strategy",
]

REPLAY_CAPACITY = 1_000_000


def check_arguments(config: D4PGConfig) -> D4PGConfig:
    """The checks that need neither the environment nor the devices (a bad value raises)."""
    ints = {"actors": 1, "env_steps": 1, "batch_size": 1, "seed": 0, "eval_every": 1,
            "eval_episodes": 1, "final_eval_episodes": 1, "final_eval_seed": 0,
            "min_replay_size": 1, "steps_per_call": 1}
    checked = {name: check_int(name, getattr(config, name), minimum=low) for name, low in ints.items()}
    checked["replicas"] = check_int("replicas", config.replicas, minimum=1, optional=True)
    checked["samples_per_insert"] = check_number(
        "samples_per_insert", config.samples_per_insert, positive=True
    )
    if checked["env_steps"] <= checked["min_replay_size"]:
        raise ArgumentError(f"env_steps ({config.env_steps}) must exceed min_replay_size "
                            f"({config.min_replay_size}): training starts once the replay holds that many.")
    _check_held_out(checked)
    if not isinstance(config.out_dir, (str, os.PathLike)):
        raise ArgumentError(f"out_dir must be a path, got {config.out_dir!r}.")
    checked["learning_rate"] = check_number(
        "learning_rate", config.learning_rate, positive=True, optional=True
    )
    checked["pre_tanh_penalty"] = check_number(
        "pre_tanh_penalty", config.pre_tanh_penalty, non_negative=True, optional=True
    )
    checked["target_update_period"] = check_int(
        "target_update_period", config.target_update_period, minimum=1, optional=True
    )
    return dataclasses.replace(config, **checked)


def _check_held_out(checked: dict) -> None:
    """The held-out evaluation's reset seeds meet neither the curve's nor the actors'."""
    start = checked["final_eval_seed"]
    held_out = range(start, start + checked["final_eval_episodes"])
    curve = range(environments.CURVE_EVAL_SEED,
                  environments.CURVE_EVAL_SEED + checked["eval_episodes"])
    actor_seeds = actors_lib.actor_seeds(checked["seed"], checked["actors"])
    if (held_out.start < curve.stop and curve.start < held_out.stop) or any(
            s in held_out for s in actor_seeds):
        raise ArgumentError(
            f"final_eval_seed {start} with final_eval_episodes {checked['final_eval_episodes']} "
            f"must give reset seeds disjoint from the curve's ({curve.start}..{curve.stop - 1}) "
            f"and the actors' ({', '.join(map(str, actor_seeds))}): the final evaluation is "
            f"held out.")


def check_config(config: D4PGConfig) -> D4PGConfig:
    """``config`` checked, with its learning rate, target update period and replicas filled in.

    Unknown environment ids and discrete action spaces fail here, and replicas
    the machine does not have, before Ray or TensorFlow does any work.
    """
    config = check_arguments(config)
    environments.env_spec(config.env_id)  # unknown ids and discrete actions fail here
    learning_rate = config.learning_rate
    if learning_rate is None:
        learning_rate = environments.LEARNING_RATES.get(config.env_id,
                                                        environments.DEFAULT_LEARNING_RATE)
    period = config.target_update_period
    if period is None:
        period = environments.TARGET_UPDATE_PERIODS.get(config.env_id,
                                                        environments.DEFAULT_TARGET_UPDATE_PERIOD)
    penalty = config.pre_tanh_penalty
    if penalty is None:
        penalty = environments.PRE_TANH_PENALTIES.get(config.env_id, 0.0)
    import keras_replicator as kr

    devices = kr.local_devices()
    replicas = config.replicas or len(devices)
    if replicas > len(devices):
        raise ArgumentError(
            f"replicas={replicas} but only {len(devices)} devices exist; on a CPU-only machine "
            f"call keras_replicator.simulate_devices({replicas}) before TensorFlow starts."
        )
    if config.batch_size % replicas:
        raise ArgumentError(f"batch_size {config.batch_size} must be divisible by replicas {replicas}.")
    return dataclasses.replace(config, learning_rate=learning_rate, replicas=replicas,
                               target_update_period=period, pre_tanh_penalty=penalty)


def make_strategy(config: D4PGConfig):
    """The learner's `ReplicatorStrategy` over the first ``config.replicas`` local devices."""
    import keras_replicator as kr

    return kr.ReplicatorStrategy(kr.local_devices()[: config.replicas])


def make_learner(config: D4PGConfig, strategy) -> D4PGLearner:
    """The compiled learner, its variables under ``strategy`` (seed Keras first: `training.run`)."""
    spec = environments.env_spec(config.env_id)
    with strategy.scope():
        learner = D4PGLearner.create(
            spec.obs_dim, spec.low, spec.high, v_min=config.v_min, v_max=config.v_max,
            policy_layers=config.policy_layers, critic_layers=config.critic_layers,
            target_update_period=config.target_update_period,
            pre_tanh_penalty=config.pre_tanh_penalty,
        )
        learner.compile(learning_rate=config.learning_rate)
    return learner


def make_replay(config: D4PGConfig) -> tuple[replay.ReplayBuffer, replay.RateLimiter]:
    """The replay buffer and its samples-per-insert rate limiter."""
    spec = environments.env_spec(config.env_id)
    buffer = replay.ReplayBuffer(REPLAY_CAPACITY, spec.obs_dim, spec.action_dim, seed=config.seed)
    return buffer, replay.RateLimiter(config.samples_per_insert, config.min_replay_size)


def make_actors(config: D4PGConfig) -> list:
    """The Ray actors (Ray must be started), each with its own environment and noise."""
    spec = environments.env_spec(config.env_id)
    return actors_lib.make_actors(config.env_id, config.actors, seed=config.seed, n_step=config.n_step,
                                  discount=config.discount, reward_scale=spec.reward_scale)


def make_feeder(config: D4PGConfig, pool, buffer, limiter, learner: D4PGLearner, done_steps: int) -> Feeder:
    """The feeder of this invocation, allowed the environment steps the run has left."""
    return Feeder(pool, buffer, limiter, learner.policy.get_weights,
                  batch_size=config.batch_size, steps_per_call=config.steps_per_call,
                  env_step_limit=config.env_steps - done_steps)
