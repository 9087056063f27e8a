"""D4PG (Barth-Maron et al., 2018): actors on Ray feeding a replicated learner.

The learner (`D4PGLearner`, a `keras.Model`) trains a deterministic policy and a
distributional critic with `model.fit` under `ReplicatorStrategy`; actors (`Actor`, Ray actors)
step their own environments with Gaussian exploration noise and send N-step transitions to a
replay with a samples-per-insert rate limiter. `python -m keras_replicator.applications.d4pg`
trains on a Gymnasium or DeepMind Control Suite task: the command line fills a
`config.D4PGConfig`, `builder` makes the run's parts from it (`make_learner`, `make_replay`,
`make_actors`, `make_feeder`) and `training.run` wires them. Environments and actors need the `rl`
extra (`pip install ".[rl]"` from the root of your clone); networks, losses and the learner do not.

Example:
    ```python
    from keras_replicator.applications import d4pg

    learner = d4pg.D4PGLearner.create(obs_dim=3, low=[-2.0], high=[2.0])
    ```
"""

from keras_replicator.applications.d4pg.learner import D4PGLearner
from keras_replicator.applications.d4pg.losses import (
    categorical_cross_entropy,
    categorical_projection,
    critic_mean,
    dpg_loss,
)
from keras_replicator.applications.d4pg.networks import (
    ScaleToBounds,
    make_atoms,
    make_critic,
    make_policy,
    policy_forward_numpy,
)
from keras_replicator.applications.d4pg.replay import (
    NStepAccumulator,
    RateLimiter,
    ReplayBuffer,
    Transitions,
)

__all__ = [
    "D4PGLearner",
    "NStepAccumulator",
    "RateLimiter",
    "ReplayBuffer",
    "ScaleToBounds",
    "Transitions",
    "categorical_cross_entropy",
    "categorical_projection",
    "critic_mean",
    "dpg_loss",
    "make_atoms",
    "make_critic",
    "make_policy",
    "policy_forward_numpy",
]
