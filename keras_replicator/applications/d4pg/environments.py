"""Continuous-control environments through Gymnasium: its own tasks (`Pendulum-v1`) and the
DeepMind Control Suite through `shimmy` (`dm_control/cartpole-swingup-v0`, any suite task as
`dm_control/<domain>-<task>-v0`).

Observations are flattened to one float32 vector (the suite's are dicts); actions must be a
bounded `Box`. `EnvSpec` carries what the networks need, and the reward scale and critic
support of known tasks (Pendulum's rewards reach -16 per step, so a return of a few hundred
steps would fall outside the default support [-150, 150] of the critic: they are scaled by 0.1;
the suite's rewards are in [0, 1] per step and need no scaling).

Example:
    ```python
    from keras_replicator.applications.d4pg import environments

    env = environments.make_env("Pendulum-v1", seed=0)
    spec = environments.env_spec("Pendulum-v1")     # obs_dim 3, actions in [-2, 2]
    ```
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from keras_replicator._validation import ArgumentError
from keras_replicator.applications.d4pg._deps import require

# Reward scale of known tasks (1.0 for any other).
REWARD_SCALES = {"Pendulum-v1": 0.1}
# Adam's learning rate where Acme's 1e-4 is too slow for the step budget of the docs: Pendulum
# reached -121 at 20k steps with 1e-3 and -1018 with 1e-4 on a 10-episode curve (docs/d4pg.md).
LEARNING_RATES = {"Pendulum-v1": 1e-3}
DEFAULT_LEARNING_RATE = 1e-4
# Learner updates between target copies where a task's step budget allows few updates: at 32
# samples per insert and batch 256 a 20k-step Pendulum run makes about 2,360 updates, so 100
# gives 23 copies, each carrying values 5 steps (n-step) further back. Measured together with
# the penalty below (docs/d4pg.md: 5 of 5 runs at -141 to -148 held-out).
TARGET_UPDATE_PERIODS = {"Pendulum-v1": 20}
DEFAULT_TARGET_UPDATE_PERIOD = 100
# The learner's penalty on the policy's pre-tanh outputs (`D4PGLearner`), where a task needs one:
# at learning rate 1e-3 a Pendulum policy saturated its tanh in 1 run of 5 (docs/d4pg.md).
PRE_TANH_PENALTIES = {"Pendulum-v1": 1e-3}
# The first reset seed of the learning curve's evaluations (episode i: CURVE_EVAL_SEED + i).
CURVE_EVAL_SEED = 10_000


class EnvSpec(NamedTuple):
    """What the agent needs to know about an environment."""

    env_id: str
    obs_dim: int
    low: tuple
    high: tuple
    reward_scale: float

    @property
    def action_dim(self) -> int:
        return len(self.low)


def _gym():
    gym = require("gymnasium")
    if any(k.startswith("dm_control/") for k in gym.registry) is False:
        try:
            shimmy = require("shimmy")
            gym.register_envs(shimmy)
        except ImportError:
            pass  # Gymnasium's own tasks still work; a dm_control id gets the error below
    return gym


def make_env(env_id: str, seed: int | None = None):
    """A Gymnasium environment with a flat float32 observation and a bounded `Box` action.

    Raises:
        ValueError: an unknown id, a discrete (or unbounded) action space.
        ImportError: Gymnasium (or shimmy/dm-control for `dm_control/...`) is not installed.

    Example:
        ```python
        env = make_env("dm_control/cartpole-swingup-v0", seed=1)
        ```
    """
    if not isinstance(env_id, str) or not env_id:
        raise ArgumentError(f"env_id must be a non-empty string, got {env_id!r}.")
    gym = _gym()
    if env_id.startswith("dm_control/"):
        require("shimmy")
        require("dm_control")
    if env_id not in gym.registry:
        close = sorted(k for k in gym.registry if env_id.split("/")[-1].split("-")[0].lower()
                       in k.lower())[:8]
        hint = f" Similar ids: {', '.join(close)}." if close else ""
        raise ArgumentError(
            f"Unknown environment id {env_id!r}: not registered with Gymnasium "
            f"(Gymnasium tasks such as 'Pendulum-v1'; DeepMind Control Suite tasks as "
            f"'dm_control/cartpole-swingup-v0').{hint}"
        )
    env = gym.make(env_id)
    if not isinstance(env.action_space, gym.spaces.Box):
        env.close()
        raise ArgumentError(
            f"{env_id} has a {type(env.action_space).__name__} action space; D4PG needs "
            f"continuous actions (a gymnasium.spaces.Box)."
        )
    low, high = env.action_space.low, env.action_space.high
    if not (np.all(np.isfinite(low)) and np.all(np.isfinite(high))):
        env.close()
        raise ArgumentError(f"{env_id} has unbounded actions ({low}, {high}); D4PG needs bounds.")
    if not isinstance(env.observation_space, gym.spaces.Box) or len(
        env.observation_space.shape
    ) != 1:
        env = gym.wrappers.FlattenObservation(env)
    if seed is not None:
        env.reset(seed=int(seed))
        env.action_space.seed(int(seed))
    return env


def env_spec(env_id: str) -> EnvSpec:
    """Observation size, action bounds and reward scale of `env_id` (checks it first).

    Example:
        ```python
        env_spec("Pendulum-v1")   # EnvSpec('Pendulum-v1', 3, (-2.0,), (2.0,), 0.1)
        ```
    """
    env = make_env(env_id)
    try:
        obs_dim = int(np.prod(env.observation_space.shape))
        low = tuple(float(v) for v in np.ravel(env.action_space.low))
        high = tuple(float(v) for v in np.ravel(env.action_space.high))
    finally:
        env.close()
    return EnvSpec(env_id, obs_dim, low, high, REWARD_SCALES.get(env_id, 1.0))


def evaluate(env_id: str, policy_fn, episodes: int = 10, seed: int = CURVE_EVAL_SEED) -> list[float]:
    """Undiscounted returns of `policy_fn` (observation -> action) over whole episodes.

    Episode `i` starts from `reset(seed=seed + i)`, so every evaluation sees the same starts.

    Example:
        ```python
        returns = evaluate("Pendulum-v1", lambda o: np.zeros(1), episodes=2)   # about -1,200 each
        ```
    """
    env = make_env(env_id)
    returns = []
    try:
        for i in range(episodes):
            obs, _ = env.reset(seed=seed + i)
            total, done = 0.0, False
            while not done:
                obs, reward, terminated, truncated, _ = env.step(policy_fn(obs))
                total += float(reward)
                done = terminated or truncated
            returns.append(total)
    finally:
        env.close()
    return returns
