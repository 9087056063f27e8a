"""The `Feeder`: Ray actors fill the replay, the rate limiter paces them, the learner reads batches.

Before each global batch the feeder inserts whatever the actors have returned, gives idle
actors new work (with the latest policy weights) while the limiter allows inserts, and waits
for the actors while the limiter says the learner is ahead. `make_dataset` is the `tf.data`
pipeline over its batches (`Dataset.from_generator`, distributed by `strategy.distribute_dataset`).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import tensorflow as tf

from keras_replicator.applications.d4pg import actors as actors_lib

__all__ = ["Feeder", "make_dataset"]


class Feeder:
    """Drives the actors and yields global batches from the replay under the rate limiter.

    Example:
        ```python
        from keras_replicator.applications import d4pg
        from keras_replicator.applications.d4pg import actors
        from keras_replicator.applications.d4pg.feeder import Feeder

        policy = d4pg.make_policy(3, low=[-2.0], high=[2.0])          # Pendulum-v1
        actors.start_ray()                                            # on 127.0.0.1
        pool = actors.make_actors("Pendulum-v1", 2, seed=0)
        replay = d4pg.ReplayBuffer(capacity=100_000, obs_dim=3, action_dim=1, seed=0)
        limiter = d4pg.RateLimiter(samples_per_insert=32, min_size_to_sample=1000)
        feeder = Feeder(pool, replay, limiter, policy.get_weights, batch_size=256)
        batch = next(feeder.batches())   # 256 transitions, once the actors have inserted 1,000
        feeder.drain()
        actors.stop_ray()
        ```
    """

    def __init__(self, pool, replay_buffer, limiter, weights_fn, *, batch_size: int,
                 steps_per_call: int = 50, env_step_limit: int | None = None,
                 weight_refresh_s: float = 0.5):
        self.ray = actors_lib.require("ray")
        self.pool = list(pool)
        self.replay = replay_buffer
        self.limiter = limiter
        self.weights_fn = weights_fn
        self.batch_size = batch_size
        self.steps_per_call = steps_per_call
        self.env_step_limit = env_step_limit
        self.weight_refresh_s = weight_refresh_s
        self.env_steps = 0
        self.episode_returns: list[float] = []
        self.actor_failures = 0
        self.steps_by_actor = [0] * len(self.pool)
        self._pending: dict = {}  # object ref -> actor index
        self._weights_ref = None
        self._weights_time = -np.inf
        self.lock = threading.Lock()  # held while the replay and the learner are read together

    def _weights(self):
        now = time.monotonic()
        if self._weights_ref is None or now - self._weights_time > self.weight_refresh_s:
            self._weights_ref = self.ray.put(self.weights_fn())
            self._weights_time = now
        return self._weights_ref

    def _submit(self, i: int) -> None:
        ref = self.pool[i].run.remote(self._weights(), self.steps_per_call)
        self._pending[ref] = i

    def _idle(self) -> list[int]:
        busy = set(self._pending.values())
        return [i for i in range(len(self.pool)) if i not in busy]

    def _harvest(self, timeout: float | None) -> None:
        if not self._pending:
            return
        done, _ = self.ray.wait(list(self._pending), num_returns=1, timeout=timeout)
        while done:
            for ref in done:
                i = self._pending.pop(ref)
                try:
                    transitions, returns, steps = self.ray.get(ref)
                except self.ray.exceptions.RayError:
                    # The actor died (Ray restarts it); its chunk is lost, its next call goes to
                    # the restarted process.
                    self.actor_failures += 1
                    continue
                self.replay.insert(transitions)
                self.limiter.record_insert(len(transitions))
                self.env_steps += steps
                self.steps_by_actor[i] += steps
                self.episode_returns += returns
            if not self._pending:
                break
            done, _ = self.ray.wait(list(self._pending), num_returns=1, timeout=0)

    def _feed(self) -> None:
        for i in self._idle():
            if self.env_step_limit is not None and self.env_steps + self.steps_per_call * (
                len(self._pending) + 1
            ) > self.env_step_limit + self.steps_per_call * len(self.pool):
                break
            if self.limiter.can_insert(self.steps_per_call) or not self.limiter.can_sample(
                self.batch_size
            ):
                self._submit(i)

    def step(self, wait: bool) -> None:
        """Inserts finished chunks and hands out new work (blocking for a result if `wait`)."""
        with self.lock:
            self._harvest(timeout=None if wait and self._pending else 0)
            self._feed()

    def next_batch(self) -> dict:
        """The next global batch (a dict of `Transitions` fields), once the limiter allows."""
        self.step(wait=False)
        while not self.limiter.can_sample(self.batch_size):
            if not self._pending:
                # The step budget stops new work: no insert will come. Keras may still prefetch
                # a batch or two after the last update; they come from the replay as it is.
                break
            self.step(wait=True)
        with self.lock:
            batch = self.replay.sample(self.batch_size)
            self.limiter.record_sample(self.batch_size)
        return batch._asdict()

    def batches(self):
        """A generator of global batches for `tf.data.Dataset.from_generator`."""
        while True:
            yield self.next_batch()

    def drain(self) -> None:
        """Waits for the calls in flight (so that no actor is mid-call at shutdown)."""
        with self.lock:
            if self._pending:
                self.ray.wait(list(self._pending), num_returns=len(self._pending), timeout=30)
            self._pending.clear()


def make_dataset(strategy, feeder: Feeder, obs_dim: int, action_dim: int):
    """The `tf.data` pipeline from the feeder's generator, distributed over the replicas."""
    b = feeder.batch_size
    signature = {
        "observation": tf.TensorSpec((b, obs_dim), tf.float32),
        "action": tf.TensorSpec((b, action_dim), tf.float32),
        "reward": tf.TensorSpec((b,), tf.float32),
        "discount": tf.TensorSpec((b,), tf.float32),
        "next_observation": tf.TensorSpec((b, obs_dim), tf.float32),
    }
    dataset = tf.data.Dataset.from_generator(feeder.batches, output_signature=signature)
    # The generator yields global batches; distribute_dataset splits each over the replicas.
    return strategy.distribute_dataset(dataset.unbatch(), global_batch_size=b,
                                       drop_remainder=True)
