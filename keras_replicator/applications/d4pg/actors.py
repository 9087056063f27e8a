"""D4PG's actors as Ray actors, and starting Ray on the loopback address.

Each `Actor` owns an environment and its Gaussian exploration noise (its own `sigma`, as a
fraction of the half-range of the action bounds). The learner calls
`actor.run.remote(weights, num_steps)`: the actor loads the latest policy weights it is sent,
steps its environment `num_steps` times and returns the N-step transitions completed, with the
returns of the episodes that ended. So an actor pulls fresh weights every `num_steps` steps,
and gets no new work while the replay's rate limiter says the learner is behind.

Actors are created with `max_restarts=-1`: when an actor's process dies, Ray starts a new one
(fresh environment, fresh episode) and the learner re-sends the call that failed.

Example:
    ```python
    import ray
    from keras_replicator.applications import d4pg
    from keras_replicator.applications.d4pg import actors

    policy = d4pg.make_policy(3, low=[-2.0], high=[2.0])   # Pendulum: 3 observations, 1 action
    actors.start_ray()                                     # a local instance on 127.0.0.1
    pool = actors.make_actors("Pendulum-v1", 2, seed=0)
    transitions, returns, steps = ray.get(pool[0].run.remote(policy.get_weights(), 100))
    actors.stop_ray()
    ```
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import numpy as np

from keras_replicator._validation import ArgumentError, check_int, check_number
from keras_replicator.applications.d4pg import environments, networks, replay
from keras_replicator.applications.d4pg._deps import require

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def actor_sigmas(num_actors: int, low: float = 0.1, high: float = 0.5) -> list[float]:
    """Per-actor exploration noise: evenly spaced on `[low, high]` (0.3 for a single actor).

    Example:
        ```python
        actor_sigmas(4)    # [0.1, 0.233, 0.367, 0.5]
        ```
    """
    num_actors = check_int("num_actors", num_actors, minimum=1)
    if num_actors == 1:
        return [0.3]
    return [float(s) for s in np.linspace(low, high, num_actors)]


def actor_seeds(seed: int, num_actors: int) -> list[int]:
    """The seeds of the actors of a run seeded ``seed``: ``seed + 1000 * (i + 1)``.

    Each actor seeds its environment's first reset and its noise with its own.

    Example:
        ```python
        actor_seeds(0, 2)    # [1000, 2000]
        ```
    """
    return [int(seed) + 1000 * (i + 1) for i in range(num_actors)]


class Actor:
    """One environment and its noisy copy of the policy (wrapped by `ray.remote`)."""

    def __init__(self, env_id: str, seed: int, sigma: float, n_step: int = 5,
                 discount: float = 0.99, reward_scale: float = 1.0):
        self.env = environments.make_env(env_id, seed=seed)
        self.spec = environments.env_spec(env_id)
        self.sigma = check_number("sigma", sigma, non_negative=True)
        self.reward_scale = float(reward_scale)
        self.accumulator = replay.NStepAccumulator(n_step, discount)
        self.rng = np.random.default_rng(seed)
        self.low = np.asarray(self.spec.low, np.float32)
        self.high = np.asarray(self.spec.high, np.float32)
        self.obs, _ = self.env.reset(seed=int(seed))
        self.episode_return = 0.0
        self.steps = 0

    def pid(self) -> int:
        """This actor's process id (the restart test kills it)."""
        return os.getpid()

    def run(self, weights: Sequence[np.ndarray], num_steps: int):
        """Steps `num_steps` times with `weights`; returns (transitions, episode returns, steps)."""
        half_range = (self.high - self.low) / 2
        items, returns = [], []
        for _ in range(num_steps):
            action = networks.policy_forward_numpy(weights, self.obs, self.low, self.high)
            noise = self.rng.normal(size=action.shape).astype(np.float32)
            action = np.clip(action + self.sigma * half_range * noise, self.low, self.high)
            next_obs, reward, terminated, truncated, _ = self.env.step(action)
            self.episode_return += float(reward)
            items += self.accumulator.add(self.obs, action, self.reward_scale * float(reward),
                                          next_obs, terminated, truncated)
            self.steps += 1
            if terminated or truncated:
                returns.append(self.episode_return)
                self.episode_return = 0.0
                next_obs, _ = self.env.reset()
            self.obs = next_obs
        transitions = replay.stack_transitions(items, self.spec.obs_dim, self.spec.action_dim)
        return transitions, returns, num_steps


def start_ray(address: str | None = None, num_cpus: int | None = None):
    """Starts a local Ray instance on 127.0.0.1 (or joins the cluster at `address`).

    For a local instance, `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` is set before Ray starts, so
    that Ray 2.60 registers the node on 127.0.0.1 instead of the machine's network address
    and every socket stays on the loopback; `RAY_AUTH_MODE` defaults to `token` (Ray's own
    default, which it otherwise announces on stderr). The instance is always a new one of this
    process: `ray.init()` without an address would join whatever cluster `RAY_ADDRESS` or
    `/tmp/ray/ray_current_cluster` names (`ray start` and `ray.cluster_utils` write that file),
    another program's on a shared machine, which stops when that program does. Returns the Ray
    module.

    Example:
        ```python
        ray = start_ray()
        assert ray.util.get_node_ip_address() == "127.0.0.1"
        stop_ray()
        ```
    """
    if address is None:
        os.environ.update(LOOPBACK_ENV)
        # Token authentication, Ray's default for a new local instance, said explicitly: Ray then
        # starts without printing that it chose it (with no token yet, Ray writes one).
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    # Importing Ray in a notebook logs (INFO) that ipywidgets, for Ray's HTML reprs, is missing.
    logging.getLogger("ray.widgets.util").setLevel(logging.WARNING)
    ray = require("ray")
    if ray.is_initialized():
        return ray
    kwargs = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
    if address is None:
        # Ray's workers inherit this process's environment, including the loopback setting.
        # address="local": a new instance, never another program's cluster found on the machine.
        ray.init(address="local", num_cpus=num_cpus, runtime_env={"env_vars": dict(LOOPBACK_ENV)}, **kwargs)
        ip = ray.util.get_node_ip_address()
        if ip != "127.0.0.1":
            ray.shutdown()
            raise RuntimeError(f"Ray registered its node on {ip}, not 127.0.0.1.")
    else:
        ray.init(address=address, **kwargs)
    return ray


def stop_ray() -> None:
    """Shuts Ray down (its GCS server, raylet and workers stop with it)."""
    ray = require("ray")
    if ray.is_initialized():
        ray.shutdown()


def make_actors(env_id: str, num_actors: int, *, seed: int = 0, n_step: int = 5,
                discount: float = 0.99, reward_scale: float = 1.0,
                sigmas: Sequence[float] | None = None) -> list:
    """`num_actors` Ray actor handles (Ray must be started), restarted by Ray if they die.

    Example:
        ```python
        start_ray()
        pool = make_actors("Pendulum-v1", 4, seed=0)   # exploration noise 0.1 to 0.5 (actor_sigmas)
        stop_ray()
        ```
    """
    ray = require("ray")
    num_actors = check_int("num_actors", num_actors, minimum=1)
    sigmas = list(sigmas) if sigmas is not None else actor_sigmas(num_actors)
    if len(sigmas) != num_actors:
        raise ArgumentError(f"got {len(sigmas)} sigmas for {num_actors} actors.")
    remote = ray.remote(num_cpus=0, max_restarts=-1)(Actor)
    return [
        remote.remote(env_id, actor_seed, sigmas[i], n_step, discount, reward_scale)
        for i, actor_seed in enumerate(actor_seeds(seed, num_actors))
    ]
