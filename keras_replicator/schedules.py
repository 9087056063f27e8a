"""Learning-rate schedules for large-batch replicated training.

A schedule is a `keras.optimizers.schedules.LearningRateSchedule`: the
optimizer evaluates it at its own `optimizer.iterations` on every update, inside
the training step. The rate therefore depends only on the number of updates
applied, which a checkpoint saves with the model: a run resumed from a
checkpoint, on the same or another number of replicas, continues the schedule
where it stopped. Nothing is measured during training: the global batch and the
lengths are given in updates (steps), up front.

* `LinearScalingWarmup`: the linear scaling rule with gradual warmup of Goyal
  et al. (2017), "Accurate, Large Minibatch SGD", optionally followed by cosine
  or step decay.

**Gradient accumulation.** With `kr.CrossReplicaOptimizer(..., accumulation_steps=k)`,
`optimizer.iterations` counts applied updates, one every `k` micro-batches. A
schedule's steps are then updates, and the batch of one update is
`global_batch_size * k`: give that as the schedule's `global_batch_size`, and
the warmup and decay lengths in updates.

Example:
    ```python
    import keras
    import keras_replicator as kr

    schedule = kr.schedules.LinearScalingWarmup(
        0.1, global_batch_size=1024, warmup_steps=500, decay="cosine", decay_steps=8500)
    optimizer = keras.optimizers.SGD(schedule, momentum=0.9)
    print(float(schedule(0)), float(schedule(500)), float(schedule(9000)))   # 0.1 0.4 0.0
    ```
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from keras_replicator._validation import ArgumentError, check_choice, check_int, check_number

__all__ = ["LinearScalingWarmup"]

_DECAYS = (None, "cosine", "step")


@keras.saving.register_keras_serializable(package="keras_replicator")
class LinearScalingWarmup(keras.optimizers.schedules.LearningRateSchedule):
    """Linear learning-rate scaling with gradual warmup (Goyal et al., 2017), then a decay.

    The peak rate is `base_learning_rate * global_batch_size / reference_batch_size`
    (the linear scaling rule). The rate starts at `base_learning_rate` and grows
    linearly, update by update, to the peak over `warmup_steps` updates:
    `base + (peak - base) * step / warmup_steps`. A warmup only ever raises the
    rate: when `global_batch_size <= reference_batch_size` the peak is at most
    `base_learning_rate` and applies from the first update (held through the
    warmup steps, so a decay still starts after `warmup_steps`).

    After the warmup, with `decay=None` the rate stays at the peak; with
    `"cosine"` it follows `peak * ((1 - alpha) * (1 + cos(pi * t)) / 2 + alpha)`,
    `t` going from 0 at the end of the warmup to 1 after `decay_steps` more
    updates (Keras's `CosineDecay` with `warmup_target` and `warmup_steps`,
    which this schedule uses); with `"step"` it is multiplied by `factor` at
    each of `boundaries` (update counts from the start of training).

    Steps are the optimizer's `iterations`: updates applied. With
    `kr.CrossReplicaOptimizer(..., accumulation_steps=k)` one update takes `k`
    micro-batches, so `global_batch_size` is the global batch of one micro-step
    times `k`, and every length is in updates.

    Example:
        ```python
        import keras
        import keras_replicator as kr

        steps_per_epoch = 1_281_167 // 1024
        schedule = kr.schedules.LinearScalingWarmup(
            0.1, global_batch_size=1024, warmup_steps=5 * steps_per_epoch,
            decay="step", boundaries=[e * steps_per_epoch for e in (30, 60, 80)])
        with strategy.scope():
            model.compile(keras.optimizers.SGD(schedule, momentum=0.9), "mse")
        print(float(schedule(0)), float(schedule(5 * steps_per_epoch)))   # 0.1 0.4
        ```

    Args:
        base_learning_rate: the rate tuned for `reference_batch_size` examples
            per update; the warmup starts there.
        global_batch_size: examples per update over all replicas of all workers
            (times `accumulation_steps` with gradient accumulation).
        reference_batch_size: the batch `base_learning_rate` was tuned for.
        warmup_steps: updates of linear warmup; `0` starts at the peak.
        decay: `None` (constant after the warmup), `"cosine"` or `"step"`.
        decay_steps: `"cosine"` only: updates from the end of the warmup to the
            end of the decay (the rate then stays at `alpha * peak`).
        alpha: `"cosine"` only: the final rate as a fraction of the peak.
        boundaries: `"step"` only: increasing update counts, at least
            `warmup_steps`, at which the rate is multiplied by `factor`.
        factor: `"step"` only: the multiplier at each boundary, in (0, 1].
        name: the name of the schedule's operations.

    Raises:
        ValueError: an argument is missing, of the wrong type or out of range.
    """

    def __init__(
        self,
        base_learning_rate: float,
        global_batch_size: int,
        *,
        reference_batch_size: int = 256,
        warmup_steps: int = 0,
        decay: str | None = None,
        decay_steps: int | None = None,
        alpha: float = 0.0,
        boundaries: Sequence[int] = (),
        factor: float = 0.1,
        name: str = "LinearScalingWarmup",
    ):
        super().__init__()
        self.base_learning_rate = check_number(
            "base_learning_rate", base_learning_rate, positive=True
        )
        self.global_batch_size = check_int("global_batch_size", global_batch_size, minimum=1)
        self.reference_batch_size = check_int(
            "reference_batch_size", reference_batch_size, minimum=1
        )
        self.warmup_steps = check_int("warmup_steps", warmup_steps, minimum=0)
        self.decay = check_choice("decay", decay, _DECAYS)
        self.decay_steps = check_int("decay_steps", decay_steps, minimum=1, optional=True)
        self.alpha = check_number("alpha", alpha, non_negative=True)
        self.factor = check_number("factor", factor, positive=True)
        if isinstance(boundaries, (str, bytes)) or not isinstance(boundaries, Sequence):
            raise ArgumentError(f"boundaries must be a sequence of integers, got {boundaries!r}.")
        self.boundaries = [
            check_int(f"boundaries[{i}]", b, minimum=self.warmup_steps)
            for i, b in enumerate(boundaries)
        ]
        self.name = name
        if self.alpha > 1:
            raise ArgumentError(f"alpha must be in [0, 1], got {alpha!r}.")
        if self.factor > 1:
            raise ArgumentError(f"factor must be in (0, 1], got {factor!r}.")
        if (self.decay == "cosine") != (self.decay_steps is not None):
            raise ArgumentError(
                "decay_steps is required with decay='cosine' and only used with it; got "
                f"decay={decay!r}, decay_steps={decay_steps!r}."
            )
        if self.decay == "step":
            if not self.boundaries:
                raise ArgumentError("decay='step' needs boundaries (update counts), got none.")
            if any(a >= b for a, b in zip(self.boundaries, self.boundaries[1:])):
                raise ArgumentError(f"boundaries must be increasing, got {list(boundaries)!r}.")
        elif self.boundaries:
            raise ArgumentError(
                f"boundaries are only used with decay='step'; got decay={decay!r}, "
                f"boundaries={list(boundaries)!r}."
            )
        # Never warm *down*: a global batch at most the reference starts at its peak and
        # holds it for the warmup (the decay still starts after warmup_steps).
        self._start = min(self.base_learning_rate, self.peak_learning_rate)
        self._cosine = None
        if self.decay == "cosine":
            self._cosine = keras.optimizers.schedules.CosineDecay(
                self._start,
                self.decay_steps,
                alpha=self.alpha,
                name=name,
                warmup_target=self.peak_learning_rate,
                warmup_steps=self.warmup_steps,
            )

    @property
    def peak_learning_rate(self) -> float:
        """`base_learning_rate * global_batch_size / reference_batch_size`."""
        return self.base_learning_rate * self.global_batch_size / self.reference_batch_size

    def __call__(self, step: Any) -> tf.Tensor:
        """The learning rate of update `step` (0-based; the optimizer's `iterations`)."""
        if self._cosine is not None:
            return self._cosine(step)
        with tf.name_scope(self.name):
            step = tf.cast(step, tf.float32)
            peak = tf.constant(self.peak_learning_rate, tf.float32)
            after = peak
            if self.decay == "step":
                passed = tf.add_n(
                    [tf.cast(step >= b, tf.float32) for b in self.boundaries]
                )
                after = peak * tf.pow(tf.constant(self.factor, tf.float32), passed)
            if self.warmup_steps == 0:
                return after
            start = tf.constant(self._start, tf.float32)
            ramp = tf.constant(float(self.warmup_steps), tf.float32)
            warm = start + (peak - start) * tf.minimum(step, ramp) / ramp
            return tf.where(step < ramp, warm, after)

    def get_config(self) -> dict:
        return {
            "base_learning_rate": self.base_learning_rate,
            "global_batch_size": self.global_batch_size,
            "reference_batch_size": self.reference_batch_size,
            "warmup_steps": self.warmup_steps,
            "decay": self.decay,
            "decay_steps": self.decay_steps,
            "alpha": self.alpha,
            "boundaries": list(self.boundaries),
            "factor": self.factor,
            "name": self.name,
        }
