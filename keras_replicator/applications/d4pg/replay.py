"""N-step transitions, the replay buffer and the samples-per-insert rate limiter.

Where the replay lives: **in the learner process**. The learner is the replay's only reader
and reads far more than the actors write (`samples_per_insert` = 32 means each transition is
sampled 32 times on average), so keeping the table beside the learner's `tf.data` pipeline
saves a serialisation and a network hop per batch. The actors' writes are the results of their
Ray calls (`actor.run.remote(...)` returns a chunk of N-step transitions), which the learner
inserts. Acme puts the table in a Reverb server instead so that several learners or machines
can share it; a Ray actor holding a `ReplayBuffer` would be the equivalent here.

The rate limiter follows Reverb's `SampleToInsertRatio`: after `min_size_to_sample` inserts,
sampling may run ahead of `samples_per_insert * inserts` by at most `error_buffer` samples and
inserting may run ahead by at most `error_buffer / samples_per_insert` inserts. The learner
waits for actors when it is ahead; actors get no new work while they are ahead.

Example:
    ```python
    import numpy as np
    from keras_replicator.applications import d4pg

    acc = d4pg.NStepAccumulator(n=5, discount=0.99)
    obs, action, next_obs = np.zeros(3), np.zeros(1), np.ones(3)
    items = acc.add(obs, action, 1.0, next_obs, terminated=True, truncated=False)  # episode ends
    replay = d4pg.ReplayBuffer(capacity=100_000, obs_dim=3, action_dim=1, seed=0)
    replay.insert(d4pg.replay.stack_transitions(items, obs_dim=3, action_dim=1))
    ```
"""

from __future__ import annotations

import collections
from typing import NamedTuple

import numpy as np

from keras_replicator._validation import ArgumentError, check_int, check_number


class Transitions(NamedTuple):
    """A batch of N-step transitions (arrays with a leading batch axis, float32)."""

    observation: np.ndarray
    action: np.ndarray
    reward: np.ndarray      # sum_{k<m} gamma^k r_{t+k}
    discount: np.ndarray    # gamma^m, or 0 when the episode terminated within the m steps
    next_observation: np.ndarray

    @staticmethod
    def concatenate(parts: list[Transitions]) -> Transitions:
        """One batch from several (empty parts allowed)."""
        return Transitions(*(np.concatenate(f, axis=0) for f in zip(*parts)))

    def __len__(self) -> int:  # noqa: D105
        return int(self.observation.shape[0])


def empty_transitions(obs_dim: int, action_dim: int) -> Transitions:
    """A batch of zero transitions of the right shapes."""
    return Transitions(
        np.zeros((0, obs_dim), np.float32),
        np.zeros((0, action_dim), np.float32),
        np.zeros((0,), np.float32),
        np.zeros((0,), np.float32),
        np.zeros((0, obs_dim), np.float32),
    )


class NStepAccumulator:
    """Turns one-step experience into N-step transitions (Acme's `NStepTransitionAdder`).

    For a step at time t it emits, once `n` further steps are known, the transition
    `(s_t, a_t, sum_{k<n} gamma^k r_{t+k}, gamma^n, s_{t+n})`. At an episode's end the
    pending steps are emitted with the rewards they have (m < n of them): discount `gamma^m`
    after a time-limit truncation (the value of `s_{t+m}` is bootstrapped), 0 after a
    terminal step.

    Example:
        ```python
        acc = NStepAccumulator(n=5, discount=0.99)
        for t in range(6):                       # the 6th step completes the first 5-step transition
            items = acc.add(np.full(3, t), [0.0], 1.0, np.full(3, t + 1), False, False)
        print(items[0][2:4])                     # reward 1 + .99 + ... + .99**4 = 4.90, discount .99**5
        ```
    """

    def __init__(self, n: int = 5, discount: float = 0.99):
        self.n = check_int("n", n, minimum=1)
        self.discount = check_number("discount", discount, non_negative=True)
        if self.discount > 1:
            raise ArgumentError(f"discount must be in [0, 1], got {discount!r}.")
        self._pending: collections.deque = collections.deque()

    def _emit(self, next_obs, terminated: bool) -> tuple:
        obs, action, _ = self._pending[0]
        reward, scale = 0.0, 1.0
        for _, _, r in self._pending:
            reward += scale * r
            scale *= self.discount
        discount = 0.0 if terminated else scale
        self._pending.popleft()
        return obs, action, reward, discount, next_obs

    def add(self, obs, action, reward: float, next_obs, terminated: bool, truncated: bool) -> list:
        """Records one step; returns the transitions it completes, as tuples."""
        self._pending.append((np.asarray(obs, np.float32), np.asarray(action, np.float32),
                              float(reward)))
        out = []
        if terminated or truncated:
            while self._pending:
                out.append(self._emit(np.asarray(next_obs, np.float32), bool(terminated)))
        elif len(self._pending) == self.n:
            out.append(self._emit(np.asarray(next_obs, np.float32), False))
        return out

    def reset(self) -> None:
        """Drops pending steps (an episode cut without an end, e.g. an actor restart)."""
        self._pending.clear()


def stack_transitions(items: list, obs_dim: int, action_dim: int) -> Transitions:
    """`Transitions` from the tuples of `NStepAccumulator.add`."""
    if not items:
        return empty_transitions(obs_dim, action_dim)
    obs, act, rew, disc, nxt = zip(*items)
    return Transitions(
        np.stack(obs).astype(np.float32).reshape(-1, obs_dim),
        np.stack(act).astype(np.float32).reshape(-1, action_dim),
        np.asarray(rew, np.float32),
        np.asarray(disc, np.float32),
        np.stack(nxt).astype(np.float32).reshape(-1, obs_dim),
    )


class ReplayBuffer:
    """A uniform FIFO replay of N-step transitions (NumPy ring buffer).

    Example:
        ```python
        replay = ReplayBuffer(capacity=1_000, obs_dim=3, action_dim=1, seed=0)
        transitions = Transitions(np.zeros((10, 3), "float32"), np.zeros((10, 1), "float32"),
                                  np.ones(10, "float32"), np.full(10, 0.99, "float32"),
                                  np.ones((10, 3), "float32"))
        replay.insert(transitions)
        batch = replay.sample(256)               # drawn uniformly, with replacement
        ```
    """

    def __init__(self, capacity: int, obs_dim: int, action_dim: int, seed: int | None = None):
        self.capacity = check_int("capacity", capacity, minimum=1)
        self.obs_dim = check_int("obs_dim", obs_dim, minimum=1)
        self.action_dim = check_int("action_dim", action_dim, minimum=1)
        self._data = Transitions(
            np.zeros((capacity, obs_dim), np.float32),
            np.zeros((capacity, action_dim), np.float32),
            np.zeros((capacity,), np.float32),
            np.zeros((capacity,), np.float32),
            np.zeros((capacity, obs_dim), np.float32),
        )
        self._next = 0
        self.size = 0
        self.inserted = 0
        self._rng = np.random.default_rng(seed)

    def insert(self, transitions: Transitions) -> None:
        """Appends transitions, overwriting the oldest once full."""
        n = len(transitions)
        for i in range(n):  # a chunk is small; a loop keeps the wrap-around simple
            for field, value in zip(self._data, transitions):
                field[self._next] = value[i]
            self._next = (self._next + 1) % self.capacity
        self.size = min(self.size + n, self.capacity)
        self.inserted += n

    def sample(self, batch_size: int) -> Transitions:
        """`batch_size` transitions drawn uniformly with replacement."""
        if self.size == 0:
            raise ValueError("cannot sample from an empty replay.")
        idx = self._rng.integers(0, self.size, size=batch_size)
        return Transitions(*(field[idx] for field in self._data))

    def state(self) -> dict:
        """Arrays to save (`np.savez`) and restore with `load_state`."""
        return {
            **{f"data_{k}": v[: self.size] for k, v in zip(Transitions._fields, self._data)},
            "next": np.asarray(self._next), "inserted": np.asarray(self.inserted),
        }

    def load_state(self, state) -> None:
        """Restores what `state` returned."""
        size = len(state["data_observation"])
        if size > self.capacity:
            raise ValueError(f"saved replay holds {size} > capacity {self.capacity} items.")
        for k, field in zip(Transitions._fields, self._data):
            field[:size] = state[f"data_{k}"]
        self.size = size
        self._next = int(state["next"]) % self.capacity
        self.inserted = int(state["inserted"])


class RateLimiter:
    """Reverb's `SampleToInsertRatio`: keeps samples close to `samples_per_insert * inserts`.

    Counts are in transitions (a batch of 256 is 256 samples).

    Example:
        ```python
        limiter = RateLimiter(samples_per_insert=32, min_size_to_sample=1000)
        limiter.record_insert(1000)
        limiter.can_sample(256)                  # True: 1000 inserts allow 32 samples each
        ```
    """

    def __init__(self, samples_per_insert: float = 32.0, min_size_to_sample: int = 1000,
                 error_buffer: float | None = None):
        self.samples_per_insert = check_number(
            "samples_per_insert", samples_per_insert, positive=True
        )
        self.min_size_to_sample = check_int("min_size_to_sample", min_size_to_sample, minimum=1)
        # Acme: error_buffer = min_replay_size * 0.1 * samples_per_insert (tolerance rate 0.1),
        # at least one batch's worth so that a batch can always be drawn.
        self.error_buffer = check_number(
            "error_buffer",
            error_buffer if error_buffer is not None
            else max(0.1 * min_size_to_sample * self.samples_per_insert, 1.0),
            positive=True,
        )
        self.inserts = 0
        self.samples = 0

    def _diff(self) -> float:
        """How far samples lag behind the target (positive: sampling may proceed)."""
        return (self.inserts - self.min_size_to_sample) * self.samples_per_insert - self.samples

    def can_sample(self, n: int) -> bool:
        """Whether `n` more samples keep within the tolerance."""
        return self.inserts >= self.min_size_to_sample and self._diff() - n >= -self.error_buffer

    def can_insert(self, n: int) -> bool:
        """Whether `n` more inserts keep within the tolerance (always, before sampling starts)."""
        if self.inserts + n <= self.min_size_to_sample:
            return True
        return self._diff() + n * self.samples_per_insert <= self.error_buffer

    def record_sample(self, n: int) -> None:
        self.samples += n

    def record_insert(self, n: int) -> None:
        self.inserts += n
