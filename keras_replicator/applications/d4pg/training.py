"""The D4PG training loop: Ray actors fill the replay, `model.fit` trains the replicated learner.

`run(config)` wires the pieces `builder` makes from a `D4PGConfig`: a local Ray instance on
127.0.0.1 (or `ray_address`), the Ray actors, a `ReplayBuffer` and `RateLimiter` in this
process, and a `tf.data` pipeline whose generator is the `Feeder` (`feeder.py`). `model.fit`
runs one "epoch" per evaluation period; a callback (`Evaluation`) evaluates the deterministic
policy, writes `returns.csv`, `policy.keras`, `learning_curve.png` and a checkpoint, from which
a new run in the same directory resumes. `train(env_id, out_dir, **fields)` is `run` of the
configuration those fields make.

Example:
    ```python
    from keras_replicator.applications.d4pg import training

    training.train("Pendulum-v1", "runs/pendulum", actors=2, replicas=2, env_steps=20_000)
    ```
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import keras
import numpy as np

from keras_replicator.applications import _runs
from keras_replicator.applications.d4pg import actors as actors_lib
from keras_replicator.applications.d4pg import builder, environments, networks
from keras_replicator.applications.d4pg.config import D4PGConfig
from keras_replicator.applications.d4pg.feeder import Feeder, make_dataset

__all__ = ["CSV_FIELDS", "D4PGConfig", "Evaluation", "Feeder", "make_dataset",
           "read_final_evaluation", "run", "train"]

CSV_FIELDS = ["env_steps", "wall_time_s", "updates", "eval_return", "eval_return_std"]
FINAL_EVALUATION = "final_evaluation.json"


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


# --- the checkpoint: learner, replay and limiter, written atomically --------------------


def load_checkpoint(path: str, learner, buffer, limiter) -> tuple[int, float] | None:
    """Restores a run's state from ``path``; returns ``(env_steps, wall_time_s)`` (None: no checkpoint)."""
    state = _runs.read_npz(path)
    if state is None:
        return None
    learner.load_state({k[len("learner/"):]: v for k, v in state.items() if k.startswith("learner/")})
    buffer.load_state({k[len("replay/"):]: v for k, v in state.items() if k.startswith("replay/")})
    limiter.inserts = int(state["limiter_inserts"])
    limiter.samples = int(state["limiter_samples"])
    return int(state["env_steps"]), float(state["wall_time_s"])


def _checkpoint_state(learner, buffer, limiter, env_steps: int, wall_time_s: float) -> dict:
    state = {f"learner/{k}": v for k, v in learner.state().items()}
    state.update({f"replay/{k}": v for k, v in buffer.state().items()})
    state.update(env_steps=env_steps, wall_time_s=wall_time_s,
                 limiter_inserts=limiter.inserts, limiter_samples=limiter.samples)
    return state


class Evaluation(keras.callbacks.Callback):
    """Every ``eval_every`` environment steps: evaluates, writes the outputs and the checkpoint.

    Also stops ``fit`` once the run's environment steps reach ``config.env_steps``. Its
    state (`rows`, `next_eval`) is its own; `done_steps` and `wall_offset` are what the
    checkpoint this invocation resumed from held.

    Example:
        ```python
        evaluation = Evaluation(config, learner, feeder, buffer, limiter, rows=[], done_steps=0)
        learner.fit(dataset, epochs=1, steps_per_epoch=2**31 - 1, shuffle=False,
                    callbacks=[evaluation])
        ```
    """

    def __init__(self, config: D4PGConfig, learner, feeder: Feeder, buffer, limiter, *,
                 rows: list[dict], done_steps: int, wall_offset: float = 0.0,
                 start: float | None = None):
        super().__init__()
        self.config, self.learner, self.feeder = config, learner, feeder
        self.buffer, self.limiter = buffer, limiter
        self.rows, self.done_steps, self.wall_offset = rows, done_steps, wall_offset
        self.next_eval = done_steps + config.eval_every - done_steps % config.eval_every
        self.start = time.monotonic() if start is None else start  # wall time counts from here
        spec = environments.env_spec(config.env_id)
        self.low, self.high = np.asarray(spec.low), np.asarray(spec.high)

    @property
    def env_steps(self) -> int:
        """The run's environment steps so far (over resumes)."""
        return self.done_steps + self.feeder.env_steps

    def on_train_batch_end(self, batch, logs=None):
        if self.env_steps >= self.next_eval:
            self.evaluate_and_save()
        if self.env_steps >= self.config.env_steps:
            self.model.stop_training = True

    def _returns(self, episodes: int, seed: int) -> list[float]:
        weights = self.learner.policy.get_weights()
        return environments.evaluate(
            self.config.env_id,
            lambda o: networks.policy_forward_numpy(weights, o, self.low, self.high),
            episodes=episodes, seed=seed,
        )

    def evaluate_held_out(self) -> dict:
        """The final evaluation of the saved policy on the held-out starts (`final_evaluation.json`).

        Its ``final_eval_episodes`` episodes start from ``reset(seed=final_eval_seed + i)``,
        seeds that neither the curve's evaluations nor the actors use (`builder.check_config`).
        """
        config, steps = self.config, self.env_steps
        returns = self._returns(config.final_eval_episodes, config.final_eval_seed)
        updates = int(self.learner.updates.numpy())
        result = {
            "env_id": config.env_id, "seed": config.seed, "env_steps": steps, "updates": updates,
            "updates_per_env_step": updates / max(steps, 1),
            "wall_time_s": self.wall_offset + time.monotonic() - self.start,
            "episodes": len(returns),
            "reset_seeds": [config.final_eval_seed, config.final_eval_seed + len(returns) - 1],
            "mean": float(np.mean(returns)), "std": float(np.std(returns)),
            "worst": float(np.min(returns)), "best": float(np.max(returns)),
            "load_average": list(os.getloadavg()), "returns": [float(r) for r in returns],
        }
        # The evaluated policy is the saved one: written together.
        self.learner.policy.save(os.path.join(config.out_dir, "policy.keras"))
        _runs.write_json(os.path.join(config.out_dir, FINAL_EVALUATION), result, indent=1)
        if config.verbose:
            print(f"held-out evaluation ({len(returns)} episodes, reset seeds "
                  f"{result['reset_seeds'][0]}..{result['reset_seeds'][1]}): mean "
                  f"{result['mean']:.1f} +- {result['std']:.1f}, worst {result['worst']:.1f}; "
                  f"{updates} updates, {result['updates_per_env_step']:.3f} per environment step",
                  flush=True)
        return result

    def evaluate_and_save(self) -> dict:
        """One evaluation row, appended to `rows` and written with the policy and checkpoint."""
        config, steps = self.config, self.env_steps
        returns = self._returns(config.eval_episodes, environments.CURVE_EVAL_SEED)
        row = {"env_steps": steps, "wall_time_s": self.wall_offset + time.monotonic() - self.start,
               "updates": int(self.learner.updates.numpy()),
               "eval_return": float(np.mean(returns)),
               "eval_return_std": float(np.std(returns))}
        self.rows.append(row)
        self._write(row)
        while self.next_eval <= steps:
            self.next_eval += config.eval_every
        if config.verbose:
            recent = self.feeder.episode_returns[-10:]
            print(
                f"env steps {steps:>8d}  updates {row['updates']:>7d}  "
                f"eval return {row['eval_return']:9.1f} +- {row['eval_return_std']:6.1f}  "
                f"train return {np.mean(recent) if recent else float('nan'):9.1f}  "
                f"wall {row['wall_time_s']:7.1f} s  actor restarts {self.feeder.actor_failures}",
                flush=True,
            )
        return row

    def _write(self, row: dict) -> None:
        out = self.config.out_dir
        _runs.write_csv_rows(os.path.join(out, "returns.csv"), self.rows, CSV_FIELDS)
        self.learner.policy.save(os.path.join(out, "policy.keras"))
        _plot(self.rows, os.path.join(out, "learning_curve.png"), f"D4PG on {self.config.env_id}")
        with self.feeder.lock:
            state = _checkpoint_state(self.learner, self.buffer, self.limiter,
                                      row["env_steps"], row["wall_time_s"])
        _runs.write_npz(os.path.join(out, "checkpoint.npz"), state)


def _fit(strategy, learner, feeder: Feeder, evaluation: Evaluation, env_id: str) -> None:
    """`learner.fit` on the feeder's `tf.data` pipeline, the pipeline's iterators closed after.

    `fit`'s iterator over the `from_generator` dataset lives on in reference cycles until a
    garbage collection; if that is the interpreter's exit, tf.data's finalizer of the generator
    runs without Python ("Error occurred when finalizing GeneratorDataset iterator:
    FAILED_PRECONDITION: Python interpreter state is not initialized"). So the dataset is
    dropped and collected here, while the interpreter is whole.
    """
    spec = environments.env_spec(env_id)
    dataset = make_dataset(strategy, feeder, spec.obs_dim, spec.action_dim)
    try:
        # One update per batch; the callback checks the step budget after every batch.
        # shuffle=False: the replay samples the batches (Keras would ignore it, with a warning).
        learner.fit(dataset, epochs=1, steps_per_epoch=2**31 - 1, verbose=0, shuffle=False,
                    callbacks=[evaluation])
    finally:
        del dataset
        gc.collect()


def run(config: D4PGConfig) -> list[dict]:
    """Trains D4PG as ``config`` says, writing to ``config.out_dir`` (resuming from a checkpoint there).

    Returns the rows of `returns.csv` (env_steps, wall_time_s, updates, eval_return,
    eval_return_std). The configuration is checked before Ray or TensorFlow does any work.

    Example:
        ```python
        rows = run(D4PGConfig("Pendulum-v1", "runs/pendulum", env_steps=20_000))
        print(rows[-1]["eval_return"])
        ```
    """
    config = builder.check_config(config)
    os.makedirs(config.out_dir, exist_ok=True)
    keras.utils.set_random_seed(config.seed)
    strategy = builder.make_strategy(config)
    learner = builder.make_learner(config, strategy)
    buffer, limiter = builder.make_replay(config)
    rows = _runs.read_csv_rows(os.path.join(config.out_dir, "returns.csv"))
    ckpt_path = os.path.join(config.out_dir, "checkpoint.npz")
    resumed = load_checkpoint(ckpt_path, learner, buffer, limiter)
    done_steps, wall_offset = resumed or (0, 0.0)
    if resumed is not None:
        rows = [r for r in rows if r["env_steps"] <= done_steps]
        if config.verbose:
            print(f"resuming from {ckpt_path}: {done_steps} environment steps done", flush=True)
    if done_steps >= config.env_steps:
        return rows

    actors_lib.start_ray(config.ray_address, num_cpus=None)
    start = time.monotonic()
    try:
        feeder = builder.make_feeder(config, builder.make_actors(config), buffer, limiter, learner,
                                     done_steps)
        evaluation = Evaluation(config, learner, feeder, buffer, limiter, rows=rows,
                                done_steps=done_steps, wall_offset=wall_offset, start=start)
        _fit(strategy, learner, feeder, evaluation, config.env_id)
        if evaluation.env_steps > (rows[-1]["env_steps"] if rows else -1):
            evaluation.evaluate_and_save()
        evaluation.evaluate_held_out()
        feeder.drain()
    finally:
        if not config.keep_ray:
            actors_lib.stop_ray()
    return rows


def read_final_evaluation(out_dir: str) -> dict | None:
    """The held-out evaluation a run wrote (`final_evaluation.json`), None if there is none.

    Keys: mean, std, worst, best, episodes, reset_seeds (first and last), returns, env_steps,
    updates, updates_per_env_step, wall_time_s, load_average (at its end), seed, env_id.

    Example:
        ```python
        final = read_final_evaluation("runs/pendulum")   # None until a run has finished
        if final is not None:
            print(final["mean"], final["worst"], final["episodes"])
        ```
    """
    return _runs.read_json(os.path.join(out_dir, FINAL_EVALUATION))


def train(env_id: str, out_dir: str, **fields: Any) -> list[dict]:
    """Trains D4PG on `env_id`, writing results to `out_dir`: `run` of ``D4PGConfig(env_id, out_dir, **fields)``.

    `learning_rate=None` takes the task's (`environments.LEARNING_RATES`: 1e-3 for Pendulum-v1)
    or Acme's 1e-4. Returns the rows of `returns.csv` (env_steps, wall_time_s, updates, eval_return,
    eval_return_std). Every argument is checked before Ray or TensorFlow does any work.

    Example:
        ```python
        rows = train("Pendulum-v1", "runs/pendulum", env_steps=20_000)
        print(rows[-1]["eval_return"])
        ```
    """
    return run(D4PGConfig(env_id, out_dir, **fields))
