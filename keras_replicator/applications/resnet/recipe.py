"""The large-batch ResNet-50 recipe: optimizer, learning-rate schedule, loss, precision.

The recipe (`Recipe`) is the one of Goyal et al. (2017) with later
refinements (He et al., 2019, "Bag of Tricks"): SGD with Nesterov momentum
0.9, learning rate `0.1 * global_batch / 256` reached over 5 warm-up epochs,
then cosine (or step) decay, label smoothing 0.1, weight decay 1e-4 on kernels
only, 90 epochs. The learning rate is one schedule
(`keras_replicator.schedules.LinearScalingWarmup`) given to the optimizer, so it
follows `optimizer.iterations` and resumes with a checkpoint.

Example:
    ```python
    import keras_replicator as kr
    from keras_replicator.applications import imagenet
    from keras_replicator.applications.resnet import Recipe

    strategy = kr.ReplicatorStrategy()
    recipe = Recipe(global_batch_size=256 * strategy.num_replicas_in_sync)
    train = strategy.distribute_dataset(
        imagenet.input_fn("train"), global_batch_size=recipe.global_batch_size)
    ```
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import tensorflow as tf

from keras_replicator._validation import (
    ArgumentError,
    check_bool,
    check_choice,
    check_int,
    check_number,
)
from keras_replicator.applications.imagenet import NUM_TRAIN_EXAMPLES
from keras_replicator.schedules import LinearScalingWarmup

__all__ = ["LARGE_BATCH", "REFERENCE_TOP1", "Recipe", "mixed_precision_policy"]

# The reference numbers this recipe reproduces at full scale (top-1 on the
# validation set after 90 epochs).
REFERENCE_TOP1 = {
    "Goyal et al. (2017), ResNet-50, 90 epochs, batch 8k": 0.763,
    "TF-Replicator paper (2019), ResNet-50 on 32 TPUv3 cores": 0.753,
}


def mixed_precision_policy(strategy: tf.distribute.Strategy | None = None) -> str:
    """The mixed-precision policy for the strategy's devices.

    ``"mixed_float16"`` on GPUs, ``"mixed_bfloat16"`` on TPUs and CPUs (modern
    x86 CPUs run bfloat16 convolutions natively). Give it as ``dtype=`` to
    `keras_replicator.applications.resnet50`; `Recipe.compile` then
    adds loss scaling for float16.

    Example:
        ```python
        model = kr.applications.resnet50(dtype=mixed_precision_policy(strategy))
        ```
    """
    if strategy is None:
        strategy = tf.distribute.get_strategy()
    devices = getattr(strategy.extended, "worker_devices", ("/cpu:0",))
    types = {(tf.DeviceSpec.from_string(d).device_type or "CPU").upper() for d in devices}
    return "mixed_float16" if "GPU" in types else "mixed_bfloat16"


_SCHEDULES = ("cosine", "step")

#: At and above this global batch, `Recipe` halves the weight decay.
LARGE_BATCH = 16_384


def _uses_float16(model: keras.Model) -> bool:
    policies = [model.dtype_policy] + [layer.dtype_policy for layer in model.layers]
    return any(getattr(p, "name", None) == "mixed_float16" for p in policies)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """The large-batch ResNet-50 recipe (Goyal et al., 2017, with label smoothing and cosine decay).

    Everything but the model and the data: the optimizer (SGD, Nesterov
    momentum 0.9) with its learning-rate schedule (`base_learning_rate *
    global_batch / 256` after a linear warmup of 5 epochs from
    `base_learning_rate`, then cosine or step decay: one
    `keras_replicator.schedules.LinearScalingWarmup`, see
    `learning_rate_schedule`), the loss (cross-entropy with label smoothing
    0.1), the weight decay to build the model with (1e-4; 5e-5 from a global
    batch of `LARGE_BATCH`), the metrics and the callbacks (
    `keras_replicator.callbacks.Throughput` and checkpoints, which only the
    chief writes under a multi-worker `ReplicatorStrategy`).

    The schedule counts optimizer updates, so the epochs are converted to
    steps with `steps_per_epoch()`, i.e. `num_train_examples //
    global_batch_size`: give `num_train_examples` for a data set other than
    ImageNet's training split, and run `fit` with that many steps per epoch.

    Example:
        ```python
        import keras, numpy as np
        import keras_replicator as kr
        from keras_replicator.applications.resnet import Recipe

        strategy = kr.ReplicatorStrategy()
        # At full scale: kr.applications.resnet50 on imagenet.input_fn("train") with
        # Recipe(global_batch_size=1024). The same recipe on a small ResNet and 64 images:
        recipe = Recipe(global_batch_size=32, epochs=2, warmup_epochs=1, num_train_examples=64)
        with strategy.scope():
            model = kr.applications.resnet((1,), num_classes=10, input_shape=(32, 32, 3), width=8,
                                           stem="small", weight_decay=recipe.weight_decay)
            recipe.compile(model)
        x = np.random.rand(64, 32, 32, 3).astype("float32")
        y = keras.utils.to_categorical(np.arange(64) % 10, 10)        # one-hot labels
        model.fit(x, y, batch_size=recipe.global_batch_size, epochs=recipe.epochs,
                  steps_per_epoch=recipe.steps_per_epoch(),            # 2
                  callbacks=recipe.callbacks(backup_dir="backup"), verbose=0)
        ```

    Args:
        global_batch_size: examples per step over all replicas of all workers.
        epochs: epochs of training (90 at full scale).
        base_learning_rate: the rate for a batch of `reference_batch_size`.
        reference_batch_size: the batch `base_learning_rate` is for (256).
        warmup_epochs: epochs of linear warmup.
        schedule: `"cosine"` or `"step"` (x0.1 at epochs 30, 60 and 80).
        step_boundaries: the epochs of the step schedule.
        momentum: SGD momentum.
        nesterov: Nesterov momentum.
        label_smoothing: label smoothing of the cross-entropy.
        weight_decay: L2 decay on kernels; None for 1e-4, or 5e-5 at and
            above `LARGE_BATCH`.
        num_train_examples: examples in an epoch, for `steps_per_epoch`.
    """

    global_batch_size: int
    epochs: int = 90
    base_learning_rate: float = 0.1
    reference_batch_size: int = 256
    warmup_epochs: float = 5
    schedule: str = "cosine"
    step_boundaries: tuple[float, ...] = (30, 60, 80)
    momentum: float = 0.9
    nesterov: bool = True
    label_smoothing: float = 0.1
    weight_decay: float | None = None
    num_train_examples: int = NUM_TRAIN_EXAMPLES

    def __post_init__(self):
        for name in ("global_batch_size", "epochs", "reference_batch_size", "num_train_examples"):
            check_int(name, getattr(self, name), minimum=1)
        check_number("base_learning_rate", self.base_learning_rate, positive=True)
        if not 0 <= check_number("warmup_epochs", self.warmup_epochs) < self.epochs:
            raise ArgumentError(
                f"warmup_epochs must be in [0, epochs={self.epochs}), got {self.warmup_epochs!r}."
            )
        check_choice("schedule", self.schedule, _SCHEDULES)
        boundaries = tuple(self.step_boundaries)
        for i, b in enumerate(boundaries):
            check_number(f"step_boundaries[{i}]", b)
        if self.schedule == "step" and (
            not boundaries
            or boundaries[0] < self.warmup_epochs
            or any(a >= b for a, b in zip(boundaries, boundaries[1:]))
        ):
            raise ArgumentError(
                "step_boundaries must be increasing epochs, the first at least warmup_epochs="
                f"{self.warmup_epochs}, got {self.step_boundaries!r}."
            )
        if not 0 <= check_number("momentum", self.momentum) < 1:
            raise ArgumentError(f"momentum must be in [0, 1), got {self.momentum!r}.")
        check_bool("nesterov", self.nesterov)
        if not 0 <= check_number("label_smoothing", self.label_smoothing) < 1:
            raise ArgumentError(f"label_smoothing must be in [0, 1), got {self.label_smoothing!r}.")
        if self.weight_decay is None:
            wd = 5e-5 if self.global_batch_size >= LARGE_BATCH else 1e-4
            object.__setattr__(self, "weight_decay", wd)
        else:
            check_number("weight_decay", self.weight_decay, non_negative=True)
        object.__setattr__(self, "step_boundaries", boundaries)

    @property
    def peak_learning_rate(self) -> float:
        """``base_learning_rate * global_batch_size / reference_batch_size`` (the linear scaling rule)."""
        return self.base_learning_rate * self.global_batch_size / self.reference_batch_size

    def steps_per_epoch(self) -> int:
        """Training steps in one epoch: ``num_train_examples // global_batch_size`` (at least 1)."""
        return max(1, self.num_train_examples // self.global_batch_size)

    def learning_rate_schedule(self, steps_per_epoch: int | None = None) -> LinearScalingWarmup:
        """The learning rate of every update: linear warmup, then cosine or step decay.

        A `keras_replicator.schedules.LinearScalingWarmup` from
        `base_learning_rate` to `peak_learning_rate` over `warmup_epochs`, then
        cosine decay to 0 at the end of `epochs` (or x0.1 at each of
        `step_boundaries`), with epochs converted to updates at
        `steps_per_epoch` (default `steps_per_epoch()`). The optimizer
        evaluates it at its `iterations`.

        Example:
            ```python
            schedule = Recipe(global_batch_size=1024).learning_rate_schedule()
            rates = [float(schedule(s)) for s in range(0, 90 * 1251, 1251)]
            ```
        """
        steps = self.steps_per_epoch() if steps_per_epoch is None else check_int(
            "steps_per_epoch", steps_per_epoch, minimum=1
        )
        warmup_steps = int(round(self.warmup_epochs * steps))
        decay: dict[str, Any]
        if self.schedule == "cosine":
            decay = {"decay_steps": max(1, self.epochs * steps - warmup_steps)}
        else:
            decay = {"boundaries": [int(round(b * steps)) for b in self.step_boundaries]}
        return LinearScalingWarmup(
            self.base_learning_rate,
            self.global_batch_size,
            reference_batch_size=self.reference_batch_size,
            warmup_steps=warmup_steps,
            decay=self.schedule,
            **decay,
        )

    def optimizer(self, steps_per_epoch: int | None = None) -> keras.optimizers.Optimizer:
        """SGD with (Nesterov) momentum, driven by `learning_rate_schedule(steps_per_epoch)`."""
        return keras.optimizers.SGD(
            learning_rate=self.learning_rate_schedule(steps_per_epoch),
            momentum=self.momentum,
            nesterov=self.nesterov,
        )

    def loss(self) -> keras.losses.Loss:
        """Cross-entropy on logits and one-hot labels, with label smoothing."""
        return keras.losses.CategoricalCrossentropy(
            from_logits=True, label_smoothing=self.label_smoothing
        )

    def metrics(self) -> list[keras.metrics.Metric]:
        """Top-1 (``accuracy``) and top-5 (``top5_accuracy``) accuracy on one-hot labels."""
        return [
            keras.metrics.CategoricalAccuracy(name="accuracy"),
            keras.metrics.TopKCategoricalAccuracy(k=5, name="top5_accuracy"),
        ]

    def compile(
        self,
        model: keras.Model,
        *,
        steps_per_execution: int = 1,
        steps_per_epoch: int | None = None,
        **kwargs: Any,
    ) -> keras.Model:
        """Compiles ``model`` with the recipe's optimizer, loss and metrics (call under the strategy scope).

        Under a ``"mixed_float16"`` policy the optimizer is wrapped in
        ``keras.optimizers.LossScaleOptimizer`` (dynamic loss scaling).

        Example:
            ```python
            with strategy.scope():
                recipe.compile(model, steps_per_execution=8)
            ```

        Args:
            model: the model to compile.
            steps_per_execution: training steps per call into TensorFlow.
            steps_per_epoch: updates per epoch for the schedule; None for
                `steps_per_epoch()`.
            **kwargs: more ``model.compile`` arguments (e.g. ``jit_compile``).

        Returns:
            ``model``.
        """
        optimizer = self.optimizer(steps_per_epoch)
        if _uses_float16(model):
            # Keras only adds loss scaling by itself when the model's own policy is
            # mixed_float16; a functional model's layers carry the policy instead.
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        model.compile(
            optimizer=optimizer,
            loss=self.loss(),
            metrics=self.metrics(),
            steps_per_execution=steps_per_execution,
            **kwargs,
        )
        return model

    def callbacks(
        self,
        *,
        backup_dir: str | None = None,
        checkpoint_path: str | None = None,
        throughput: bool = True,
    ) -> list[keras.callbacks.Callback]:
        """The training callbacks: throughput and checkpoints (the schedule is the optimizer's).

        Under a multi-worker ``ReplicatorStrategy`` only the chief writes the
        checkpoint and backup files.

        Example:
            ```python
            callbacks = recipe.callbacks(backup_dir="run1/backup",
                                         checkpoint_path="run1/weights-{epoch}.weights.h5")
            [type(c).__name__ for c in callbacks]   # ['BackupAndRestore', 'Throughput', 'ModelCheckpoint']
            ```

        Args:
            backup_dir: if given, ``keras.callbacks.BackupAndRestore`` there, so
                a restarted job resumes from its last epoch.
            checkpoint_path: if given, ``keras.callbacks.ModelCheckpoint`` saving
                the weights there every epoch (a ``.weights.h5`` path, may
                contain ``{epoch}``).
            throughput: add `keras_replicator.callbacks.Throughput`.

        Returns:
            A list of callbacks for ``model.fit`` (append loggers after it:
            `Throughput` must run before them).
        """
        from keras_replicator.callbacks import Throughput

        callbacks: list[keras.callbacks.Callback] = []
        if backup_dir is not None:
            callbacks.append(keras.callbacks.BackupAndRestore(backup_dir))
        if throughput:
            callbacks.append(Throughput(global_batch_size=self.global_batch_size))
        if checkpoint_path is not None:
            callbacks.append(
                keras.callbacks.ModelCheckpoint(checkpoint_path, save_weights_only=True)
            )
        return callbacks
