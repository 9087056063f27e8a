"""The configuration of a D4PG run: a logic-free dataclass, as Acme's `agents/jax/d4pg/config.py`.

The command line (`python -m keras_replicator.applications.d4pg`) and `training.train` only
fill it; `builder.check_config` checks it and `training.run` trains it.

Example:
    ```python
    from keras_replicator.applications.d4pg.config import D4PGConfig

    config = D4PGConfig("Pendulum-v1", "runs/pendulum", actors=2, env_steps=20_000)
    ```
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from keras_replicator.applications.d4pg import networks

__all__ = ["D4PGConfig"]


@dataclasses.dataclass(frozen=True)
class D4PGConfig:
    """Every choice of a D4PG run (checked by `builder.check_config`, not here).

    Example:
        ```python
        config = D4PGConfig("Pendulum-v1", "runs/pendulum", replicas=2)
        ```

    Attributes:
        env_id: the Gymnasium id (``Pendulum-v1``, ``dm_control/cartpole-swingup-v0``).
        out_dir: where the run writes its outputs and checkpoint (a rerun resumes).
        actors: Ray actors stepping environments.
        replicas: learner replicas (``None``: every local device).
        env_steps: environment steps in all (over resumes).
        samples_per_insert: the rate limiter's transitions sampled per transition inserted.
        batch_size: the learner's global batch.
        seed: seeds the networks, the replay and the actors.
        ray_address: a Ray cluster to join (``None``: a local instance on 127.0.0.1).
        eval_every: environment steps between evaluations (and checkpoints).
        eval_episodes: episodes of each evaluation of the learning curve (short: it reads a
            trend; its starts are ``reset(seed=10_000 + i)``).
        final_eval_episodes: episodes of the run's final, held-out evaluation of the saved
            policy (``final_evaluation.json``; starts ``reset(seed=final_eval_seed + i)``).
        final_eval_seed: the first reset seed of the held-out evaluation; its seeds must be
            disjoint from the curve's and from the actors' (``seed + 1000 * (i + 1)``).
        min_replay_size: transitions in the replay before the first update.
        steps_per_call: environment steps of one actor call.
        n_step: the N of the N-step transitions.
        discount: the discount of rewards.
        v_min: the critic's lowest atom.
        v_max: the critic's highest atom.
        learning_rate: Adam's, both networks (``None``: the task's, see
            ``environments.LEARNING_RATES``, else Acme's 1e-4).
        target_update_period: learner updates between target network copies (``None``: the
            task's, see ``environments.TARGET_UPDATE_PERIODS``, else Acme's 100).
        pre_tanh_penalty: the learner's penalty on the policy's pre-tanh outputs (``None``:
            the task's, see ``environments.PRE_TANH_PENALTIES``, else 0 as Acme).
        policy_layers: the policy's hidden layer widths.
        critic_layers: the critic's hidden layer widths.
        verbose: print a line per evaluation.
        keep_ray: leave Ray running at the end (a notebook's next run reuses it).
    """

    env_id: str
    out_dir: str
    actors: int = 2
    replicas: int | None = None
    env_steps: int = 20_000
    samples_per_insert: float = 32.0
    batch_size: int = 256
    seed: int = 0
    ray_address: str | None = None
    eval_every: int = 2_000
    eval_episodes: int = 10
    final_eval_episodes: int = 100
    final_eval_seed: int = 50_000
    min_replay_size: int = 1_000
    steps_per_call: int = 50
    n_step: int = 5
    discount: float = 0.99
    v_min: float = -150.0
    v_max: float = 150.0
    learning_rate: float | None = None
    target_update_period: int | None = None
    pre_tanh_penalty: float | None = None
    policy_layers: Sequence[int] = networks.POLICY_LAYERS
    critic_layers: Sequence[int] = networks.CRITIC_LAYERS
    verbose: bool = True
    keep_ray: bool = False
