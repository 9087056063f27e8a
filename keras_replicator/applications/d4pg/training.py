"""The D4PG training loop: Ray actors fill the replay, `model.fit` trains the replicated learner.

`train` wires the pieces: a local Ray instance on 127.0.0.1 (or `ray_address`), `actors`
Ray actors, a `ReplayBuffer` and `RateLimiter` in this process, and a `tf.data` pipeline
(`Dataset.from_generator`, distributed by `strategy.distribute_dataset`) whose generator is the
`Feeder`: before each global batch it inserts whatever the actors have returned, gives idle
actors new work (with the latest policy weights) while the limiter allows inserts, and waits for
the actors while the limiter says the learner is ahead. `model.fit` runs one "epoch" per
evaluation period; a callback evaluates the deterministic policy, writes `returns.csv`,
`policy.keras`, `learning_curve.png` and a checkpoint, from which a new run in the same
directory resumes.

Example:
    ```python
    from keras_replicator.applications.d4pg import training

    training.train("Pendulum-v1", "runs/pendulum", actors=2, replicas=2, env_steps=20_000)
    ```
"""

from __future__ import annotations

import csv
import os
import threading
import time

import keras
import numpy as np
import tensorflow as tf

from keras_replicator._validation import check_int, check_number
from keras_replicator.applications.d4pg import actors as actors_lib
from keras_replicator.applications.d4pg import environments, networks, replay
from keras_replicator.applications.d4pg.learner import D4PGLearner

CSV_FIELDS = ["env_steps", "wall_time_s", "updates", "eval_return", "eval_return_std"]


class Feeder:
    """Drives the actors and yields global batches from the replay under the rate limiter.

    Example:
        ```python
        feeder = Feeder(pool, replay, limiter, weights_fn, batch_size=256)
        batch = next(feeder.batches())
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


def _plot(rows: list[dict], path: str, title: str) -> None:
    # A Figure without pyplot: no backend is chosen or changed (a notebook keeps its own).
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5))
    ax = fig.add_subplot()
    ax.plot([r["env_steps"] for r in rows], [r["eval_return"] for r in rows], marker="o")
    ax.set_xlabel("environment steps")
    ax.set_ylabel("evaluation return (mean of episodes)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _read_rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def train(
    env_id: str,
    out_dir: str,
    *,
    actors: int = 2,
    replicas: int | None = None,
    env_steps: int = 20_000,
    samples_per_insert: float = 32.0,
    batch_size: int = 256,
    seed: int = 0,
    ray_address: str | None = None,
    eval_every: int = 2_000,
    eval_episodes: int = 10,
    min_replay_size: int = 1_000,
    steps_per_call: int = 50,
    n_step: int = 5,
    discount: float = 0.99,
    v_min: float = -150.0,
    v_max: float = 150.0,
    learning_rate: float | None = None,
    target_update_period: int = 100,
    policy_layers=networks.POLICY_LAYERS,
    critic_layers=networks.CRITIC_LAYERS,
    verbose: bool = True,
    keep_ray: bool = False,
) -> list[dict]:
    """Trains D4PG on `env_id`, writing results to `out_dir` (resumes from a checkpoint there).

    `learning_rate=None` takes the task's (`environments.LEARNING_RATES`: 1e-3 for Pendulum-v1)
    or Acme's 1e-4. Returns the rows of `returns.csv` (env_steps, wall_time_s, updates, eval_return,
    eval_return_std). Every argument is checked before Ray or TensorFlow does any work.

    Example:
        ```python
        rows = train("Pendulum-v1", "runs/pendulum", env_steps=20_000)
        print(rows[-1]["eval_return"])
        ```
    """
    actors = check_int("actors", actors, minimum=1)
    replicas = check_int("replicas", replicas, minimum=1, optional=True)
    env_steps = check_int("env_steps", env_steps, minimum=1)
    samples_per_insert = check_number("samples_per_insert", samples_per_insert, positive=True)
    batch_size = check_int("batch_size", batch_size, minimum=1)
    seed = check_int("seed", seed, minimum=0)
    eval_every = check_int("eval_every", eval_every, minimum=1)
    eval_episodes = check_int("eval_episodes", eval_episodes, minimum=1)
    min_replay_size = check_int("min_replay_size", min_replay_size, minimum=1)
    steps_per_call = check_int("steps_per_call", steps_per_call, minimum=1)
    if env_steps <= min_replay_size:
        raise ValueError(f"env_steps ({env_steps}) must exceed min_replay_size "
                         f"({min_replay_size}): training starts once the replay holds that many.")
    if not isinstance(out_dir, (str, os.PathLike)):
        raise ValueError(f"out_dir must be a path, got {out_dir!r}.")
    learning_rate = check_number("learning_rate", learning_rate, positive=True, optional=True)
    spec = environments.env_spec(env_id)   # unknown ids and discrete actions fail here
    if learning_rate is None:
        learning_rate = environments.LEARNING_RATES.get(env_id,
                                                        environments.DEFAULT_LEARNING_RATE)
    import keras_replicator as kr

    devices = kr.local_devices()
    replicas = replicas or len(devices)
    if replicas > len(devices):
        raise ValueError(
            f"replicas={replicas} but only {len(devices)} devices exist; on a CPU-only machine "
            f"call keras_replicator.simulate_devices({replicas}) before TensorFlow starts."
        )
    if batch_size % replicas:
        raise ValueError(f"batch_size {batch_size} must be divisible by replicas {replicas}.")
    os.makedirs(out_dir, exist_ok=True)
    csv_path = os.path.join(out_dir, "returns.csv")
    ckpt_path = os.path.join(out_dir, "checkpoint.npz")

    keras.utils.set_random_seed(seed)
    strategy = kr.ReplicatorStrategy(devices[:replicas])
    with strategy.scope():
        learner = D4PGLearner.create(
            spec.obs_dim, spec.low, spec.high, v_min=v_min, v_max=v_max,
            policy_layers=policy_layers, critic_layers=critic_layers,
            target_update_period=target_update_period,
        )
        learner.compile(learning_rate=learning_rate)
    buffer = replay.ReplayBuffer(1_000_000, spec.obs_dim, spec.action_dim, seed=seed)
    limiter = replay.RateLimiter(samples_per_insert, min_replay_size)
    rows = _read_rows(csv_path)
    done_steps, wall_offset = 0, 0.0
    if os.path.exists(ckpt_path):
        with np.load(ckpt_path) as saved:
            state = dict(saved)
        learner.load_state({k[len("learner/"):]: v for k, v in state.items()
                            if k.startswith("learner/")})
        buffer.load_state({k[len("replay/"):]: v for k, v in state.items()
                           if k.startswith("replay/")})
        done_steps = int(state["env_steps"])
        wall_offset = float(state["wall_time_s"])
        limiter.inserts = int(state["limiter_inserts"])
        limiter.samples = int(state["limiter_samples"])
        rows = [r for r in rows if r["env_steps"] <= done_steps]
        if verbose:
            print(f"resuming from {ckpt_path}: {done_steps} environment steps done", flush=True)
    if done_steps >= env_steps:
        return rows

    actors_lib.start_ray(ray_address, num_cpus=None)
    start = time.monotonic()
    try:
        pool = actors_lib.make_actors(env_id, actors, seed=seed, n_step=n_step,
                                      discount=discount, reward_scale=spec.reward_scale)
        feeder = Feeder(pool, buffer, limiter, learner.policy.get_weights,
                        batch_size=batch_size, steps_per_call=steps_per_call,
                        env_step_limit=env_steps - done_steps)
        feeder.env_steps = 0
        dataset = make_dataset(strategy, feeder, spec.obs_dim, spec.action_dim)
        low, high = np.asarray(spec.low), np.asarray(spec.high)
        next_eval = [done_steps + eval_every - done_steps % eval_every]

        def evaluate_and_save(force: bool = False):
            steps = done_steps + feeder.env_steps
            if not force and steps < next_eval[0]:
                return
            weights = learner.policy.get_weights()
            returns = environments.evaluate(
                env_id, lambda o: networks.policy_forward_numpy(weights, o, low, high),
                episodes=eval_episodes,
            )
            row = {"env_steps": steps, "wall_time_s": wall_offset + time.monotonic() - start,
                   "updates": int(learner.updates.numpy()),
                   "eval_return": float(np.mean(returns)),
                   "eval_return_std": float(np.std(returns))}
            rows.append(row)
            with open(csv_path, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
                writer.writeheader()
                writer.writerows(rows)
            learner.policy.save(os.path.join(out_dir, "policy.keras"))
            _plot(rows, os.path.join(out_dir, "learning_curve.png"), f"D4PG on {env_id}")
            with feeder.lock:
                state = {f"learner/{k}": v for k, v in learner.state().items()}
                state.update({f"replay/{k}": v for k, v in buffer.state().items()})
                state.update(env_steps=steps, wall_time_s=row["wall_time_s"],
                             limiter_inserts=limiter.inserts, limiter_samples=limiter.samples)
            np.savez(ckpt_path + ".tmp.npz", **state)
            os.replace(ckpt_path + ".tmp.npz", ckpt_path)
            while next_eval[0] <= steps:
                next_eval[0] += eval_every
            if verbose:
                recent = feeder.episode_returns[-10:]
                print(
                    f"env steps {steps:>8d}  updates {row['updates']:>7d}  "
                    f"eval return {row['eval_return']:9.1f} +- {row['eval_return_std']:6.1f}  "
                    f"train return {np.mean(recent) if recent else float('nan'):9.1f}  "
                    f"wall {row['wall_time_s']:7.1f} s  actor restarts {feeder.actor_failures}",
                    flush=True,
                )

        class Progress(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                evaluate_and_save()
                if done_steps + feeder.env_steps >= env_steps:
                    self.model.stop_training = True

        # One update per batch; the callback checks the step budget after every batch.
        learner.fit(dataset, epochs=1, steps_per_epoch=2**31 - 1, verbose=0,
                    callbacks=[Progress()])
        if done_steps + feeder.env_steps > (rows[-1]["env_steps"] if rows else -1):
            evaluate_and_save(force=True)
        feeder.drain()
    finally:
        if not keep_ray:
            actors_lib.stop_ray()
    return rows
