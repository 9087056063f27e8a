"""``CrossReplicaOptimizer``: the optimizer wrapper of TF-Replicator and Horovod, for Keras 3.

Keras 3's TensorFlow optimizers already sum gradients across replicas before each
update. ``CrossReplicaOptimizer`` takes over that all-reduce, so it can do more
with it:

* **accumulation**: the gradients of ``k`` consecutive micro-batches are summed
  locally on each replica and all-reduced once, on the ``k``-th step; the wrapped
  optimizer then applies one update. ``k`` steps at batch ``B / k`` update the
  weights as one step at batch ``B``. Iterations and learning-rate schedules
  count applied updates.
* **compression**: gradients travel as ``float16`` or ``bfloat16`` and are cast
  back after the all-reduce (half the bytes on the wire).
* **clipping**: ``clip_global_norm`` is applied to the all-reduced gradient, so
  every replica clips by the same factor.
* **skipping non-finite steps**: decided on the all-reduced gradient, so every
  replica skips alike; skipped steps are counted in ``skipped_steps``.

The wrapped optimizer does everything else (its update rule, weight decay, its
own clipping, loss scaling) on the all-reduced gradient, and no longer reduces
across replicas itself.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from keras_replicator import _compat
from keras_replicator._compat import keras_optimizer, replica_trace
from keras_replicator._validation import ArgumentError, check_bool, check_choice, check_number
from keras_replicator.collectives import all_reduce
from keras_replicator.optimizers.gradient_transforms import (
    COMPRESSIONS,
    GradientAccumulator,
    NonFiniteSkip,
    all_finite,
    clip_by_global_norm,
    compress,
    decompress,
)


@keras.saving.register_keras_serializable(package="keras_replicator")
class CrossReplicaOptimizer(keras.optimizers.Optimizer):
    """Wraps a Keras optimizer to all-reduce gradients once per update.

    Use it wherever a Keras optimizer goes (``model.compile``, custom loops that
    call ``optimizer.apply``). Build it under the strategy's ``scope()``, like the
    model. Under a single device it behaves like the wrapped optimizer with the
    same options.

    Example:
        ```python
        import keras, numpy as np
        import keras_replicator as kr

        kr.simulate_devices(2)
        strategy = kr.ReplicatorStrategy()
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            opt = kr.optimizers.CrossReplicaOptimizer(
                keras.optimizers.SGD(0.1, momentum=0.9),
                accumulation_steps=2,          # 2 micro-batches of 8 = one batch of 16
                compression="bfloat16",
                clip_global_norm=1.0,
                skip_nonfinite=True,
            )
            model.compile(opt, "mse")
        model.fit(np.ones((64, 4)), np.ones((64, 1)), batch_size=8, verbose=0)
        print(int(opt.iterations.numpy()), int(opt.micro_steps.numpy()))   # 4 updates, 8 batches
        ```

    Mixed precision: wrap the ``LossScaleOptimizer``, not the other way round, and
    tell ``compile`` not to add another one:

    ```python
    with strategy.scope():
        opt = kr.optimizers.CrossReplicaOptimizer(
            keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3)))
        model.compile(opt, "mse", auto_scale_loss=False)
    ```

    The loss scale optimizer then sees the all-reduced gradient, so every replica
    makes the same finite/non-finite decision, and ``clip_global_norm`` is applied
    to the unscaled gradient.

    Args:
        optimizer: the Keras optimizer to wrap (an instance, or a name such as
            ``"adam"``). It belongs to the wrapper afterwards: it no longer
            reduces gradients across replicas by itself, so do not use it on
            its own.
        accumulation_steps: number of micro-batches whose gradients are summed
            locally before one all-reduce and one update. The update uses the
            mean of the ``k`` micro-batch gradients, so ``k`` steps at batch
            ``B / k`` equal one step at ``B`` (with equal micro-batch sizes).
        compression: ``None``, ``"float16"`` or ``"bfloat16"``: the dtype the
            gradients are all-reduced in. ``float16`` keeps more mantissa but
            overflows above 65504; ``bfloat16`` keeps the float32 range.
        clip_global_norm: if set, the all-reduced gradient is rescaled so that
            its global norm is at most this value.
        skip_nonfinite: if ``True``, an update whose all-reduced gradient has a
            NaN or Inf is skipped on every replica (weights, slots and the
            iteration count stay as they were) and counted in
            ``skipped_steps``. With an inner ``LossScaleOptimizer`` the step is
            counted and left to it (it skips and lowers its scale).
        name: the optimizer's name.
    """

    # It all-reduces gradients itself: a LossScaleOptimizer around it is refused
    # (keras_replicator._compat.keras_optimizer.reduces_gradients).
    reduces_gradients = True

    def __init__(
        self,
        optimizer: keras.optimizers.Optimizer | str,
        *,
        accumulation_steps: int = 1,
        compression: str | None = None,
        clip_global_norm: float | None = None,
        skip_nonfinite: bool = False,
        name: str | None = None,
        **kwargs,
    ):
        if kwargs:
            raise ArgumentError(
                f"CrossReplicaOptimizer does not take {sorted(kwargs)}; set such options "
                "(learning_rate, weight_decay, clipnorm, ...) on the wrapped optimizer."
            )
        if isinstance(optimizer, str):
            optimizer = keras.optimizers.get(optimizer)
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise ArgumentError(
                "optimizer must be a keras.optimizers.Optimizer such as "
                f"keras.optimizers.SGD(0.1), got {optimizer!r}."
            )
        if isinstance(optimizer, CrossReplicaOptimizer):
            raise ArgumentError("optimizer is already a CrossReplicaOptimizer; do not wrap it twice.")
        inner = optimizer
        while inner is not None:
            if getattr(inner, "gradient_accumulation_steps", None):
                raise ArgumentError(
                    f"The wrapped optimizer {inner.name!r} has gradient_accumulation_steps="
                    f"{inner.gradient_accumulation_steps}; use "
                    "CrossReplicaOptimizer(accumulation_steps=...) instead (it all-reduces once "
                    "per update and keeps replicas identical)."
                )
            inner = getattr(inner, "inner_optimizer", None)
        accumulator = GradientAccumulator(accumulation_steps)
        if compression is not None:
            check_choice("compression", compression, (None, *COMPRESSIONS))
        clip_global_norm = check_number(
            "clip_global_norm", clip_global_norm, positive=True, optional=True
        )
        skip_nonfinite = check_bool("skip_nonfinite", skip_nonfinite)

        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = optimizer
        self.accumulation_steps = accumulator.steps
        self._accumulator = accumulator
        self._non_finite = NonFiniteSkip() if skip_nonfinite else None
        self.compression = compression
        self.clip_global_norm = clip_global_norm
        self.skip_nonfinite = skip_nonfinite
        self._strategy = tf.distribute.get_strategy()
        keras_optimizer.skip_optimizer_gradient_all_reduce(optimizer)
        # Among them, the refusal of a LossScaleOptimizer around this one (keras_optimizer).
        _compat.install()

    # --- state -----------------------------------------------------------------

    def build(self, var_list: Sequence) -> None:
        """Creates the wrapper's variables and builds the wrapped optimizer.

        Called by Keras (``fit`` builds the optimizer before the first step).

        Example:
            ```python
            with strategy.scope():
                opt.build(model.trainable_variables)   # fit does it before the first step
            ```
        """
        if self.built:
            return
        if tf.distribute.has_strategy() and tf.distribute.get_strategy() is not self._strategy:
            raise ValueError(
                "This CrossReplicaOptimizer was created outside the scope of the strategy its "
                "model uses; create it (and the optimizer it wraps) under strategy.scope(), "
                "where the model is built and compiled."
            )
        # Variables must be created under the strategy the optimizer was made for.
        scope = contextlib.nullcontext() if tf.distribute.has_strategy() else self._strategy.scope()
        with scope:
            super().build(var_list)
            self.inner_optimizer.build(var_list)
            # Always made (not only with skip_nonfinite), so checkpoints have one layout.
            skip = self._non_finite or NonFiniteSkip()
            skip.build(self.add_variable)
            self._skipped_steps = skip.skipped_steps
            if self.accumulation_steps > 1:
                with keras.name_scope(self.name, caller=self):
                    self._accumulator.build(var_list, track=self._track_variable)

    @property
    def variables(self) -> list:
        """The wrapper's variables followed by the wrapped optimizer's."""
        return self._variables + self.inner_optimizer.variables

    @property
    def learning_rate(self):
        """The wrapped optimizer's learning rate (settable)."""
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        """Number of updates applied (the wrapped optimizer's iteration count).

        Learning-rate schedules of the wrapped optimizer follow this count. With
        accumulation it advances once every ``accumulation_steps`` micro-batches.
        """
        return self.inner_optimizer.iterations

    @property
    def micro_steps(self):
        """Number of gradient batches received (``apply`` calls), as a variable."""
        return self._iterations

    @property
    def accumulators(self) -> list:
        """The per-replica gradient sums of the update in progress (empty without accumulation)."""
        return list(self._accumulator.accumulators)

    @property
    def skipped_steps(self):
        """Number of updates skipped for a non-finite all-reduced gradient, as a variable."""
        if not self.built:
            raise ValueError("The optimizer is not built yet; skipped_steps exists after build().")
        return self._skipped_steps

    def scale_loss(self, loss):
        """Scales the loss as the wrapped optimizer does (``LossScaleOptimizer``)."""
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        """Lets the wrapped optimizer finalise the weights (e.g. its EMA)."""
        self.inner_optimizer.finalize_variable_values(var_list)

    # --- the update --------------------------------------------------------------

    def apply(self, grads, trainable_variables=None):
        """All-reduces ``grads`` (every ``accumulation_steps`` calls) and applies them.

        Call it once per micro-batch on every replica, in a replica context (as
        Keras's ``train_step`` does).

        Example:
            ```python
            import tensorflow as tf

            with strategy.scope():
                optimizer = kr.optimizers.CrossReplicaOptimizer(keras.optimizers.SGD(0.1))
                optimizer.build(model.trainable_variables)
            x, y = np.ones((16, 4), "float32"), np.ones((16, 1), "float32")
            batches = strategy.experimental_distribute_dataset(
                tf.data.Dataset.from_tensor_slices((x, y)).batch(16))   # 8 examples per replica

            @tf.function
            def train_step(x, y):
                def replica_step(x, y):
                    with tf.GradientTape() as tape:
                        per_example = keras.losses.mean_squared_error(y, model(x))
                        loss = tf.nn.compute_average_loss(per_example, global_batch_size=16)
                    grads = tape.gradient(loss, model.trainable_variables)
                    optimizer.apply(grads, model.trainable_variables)   # all-reduced (summed), applied
                strategy.run(replica_step, args=(x, y))

            for x_batch, y_batch in batches:
                train_step(x_batch, y_batch)
            ```
        """
        grads = list(grads)
        if not grads:
            return
        if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
            raise ValueError(
                "CrossReplicaOptimizer.apply() must be called in a replica context, e.g. "
                "inside strategy.run() or a Keras train_step."
            )
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "When passing grads without variables, the optimizer must be built: "
                    "call optimizer.build(trainable_variables) first."
                )
            trainable_variables = self._trainable_variables
        else:
            trainable_variables = list(trainable_variables)
            if not self.built:
                with keras.name_scope(self.name, caller=self):
                    self.build(trainable_variables)
            self._check_variables_are_known(trainable_variables)
        if len(grads) != len(trainable_variables):
            raise ArgumentError(
                f"Got {len(grads)} gradients for {len(trainable_variables)} variables."
            )

        with keras.name_scope(self.name, caller=self):
            k = self.accumulation_steps
            if k > 1 or self.skip_nonfinite:
                source = None
                if k > 1:
                    indices = [self._get_variable_index(v) for v in trainable_variables]
                    source = (indices, [g is not None for g in grads])
                    self._accumulator.add(grads, indices)
                    grads = None
                if replica_trace.tracing_once():
                    # One trace for all replicas: the decision's inputs are the same on
                    # every replica, so each takes it alike, without a merge_call.
                    self._decide_and_apply(grads, trainable_variables, source)
                    return
                # Python values go by closure: merge_call regroups its args per replica.
                merge_fn = functools.partial(
                    self._cross_replica_apply, trainable_variables=trainable_variables, source=source
                )
                tf.distribute.get_replica_context().merge_call(merge_fn, args=(grads,))
            else:
                # No decision to take: reduce and apply in the replica context.
                reduced = self._replica_reduce(grads, None)
                self.inner_optimizer.apply(reduced, trainable_variables)
                self._iterations.assign_add(1)

    def _cross_replica_apply(self, strategy, grads, trainable_variables, source):
        """Decides, once for all replicas, whether this step reduces and applies.

        Runs in the cross-replica context (a ``merge_call`` of a step traced per
        replica): a ``tf.cond`` whose branches all-reduce must be taken there, so
        that every replica takes the same branch.
        """
        self._decide_and_apply(grads, trainable_variables, source, strategy=strategy)

    def _decide_and_apply(self, grads, trainable_variables, source, strategy=None):
        """Reduces and applies if this step completes an update and (optionally) is finite.

        With ``strategy`` (the cross-replica context), each replica's part runs
        through ``call_for_each_replica``; without (a step traced once), in this
        replica, whose inputs to every decision equal every other replica's.
        """
        if strategy is None:
            def each(fn, *args):
                return fn(*args)

            def first(value):
                return value
        else:
            def each(fn, *args):
                return strategy.extended.call_for_each_replica(fn, args=args)

            def first(value):
                return strategy.experimental_local_results(value)[0]

        def reduce_and_apply():
            reduced = each(self._replica_reduce, grads, source)
            if not self.skip_nonfinite:
                each(self.inner_optimizer.apply, reduced, trainable_variables)
                return
            # The reduced gradient is the same on every replica (and worker), so
            # replica 0's verdict is everyone's.
            finite = first(each(all_finite, reduced))

            def apply_reduced():
                each(self.inner_optimizer.apply, reduced, trainable_variables)

            if self._loss_scale_optimizer() is not None:
                # The LossScaleOptimizer must see the step to lower its scale.
                self._non_finite.count(finite)
                apply_reduced()
            else:
                self._non_finite.apply_if_finite(finite, apply_reduced)

        if self.accumulation_steps > 1:
            tf.cond(self._accumulator.is_update_step(self._iterations), reduce_and_apply, lambda: None)
        else:
            reduce_and_apply()
        self._iterations.assign_add(1)

    def _replica_reduce(self, grads, source):
        """All-reduces this replica's gradients (or accumulated sums); runs per replica."""
        if source is not None:
            grads = self._accumulator.take(*source)
        positions = [i for i, g in enumerate(grads) if g is not None]
        values = [grads[i] for i in positions]
        dtypes = [g.dtype for g in values]
        values = compress(values, self.compression)
        values = all_reduce(values, "sum") if values else values
        values = decompress(values, dtypes)
        if self.clip_global_norm is not None and values:
            clip = tf.cast(self.clip_global_norm, tf.float32) * self._gradient_scale()
            values = clip_by_global_norm(values, clip)
        out = [None] * len(grads)
        for i, g in zip(positions, values):
            out[i] = g
        return out

    def _loss_scale_optimizer(self):
        inner = self.inner_optimizer
        while inner is not None:
            if isinstance(inner, keras.optimizers.LossScaleOptimizer):
                return inner
            inner = getattr(inner, "inner_optimizer", None)
        return None

    def _gradient_scale(self) -> tf.Tensor:
        """The factor the gradients we see are scaled by (loss scaling), float32."""
        lso = self._loss_scale_optimizer()
        if lso is not None:
            return tf.cast(tf.convert_to_tensor(lso.dynamic_scale), tf.float32)
        factor = getattr(self.inner_optimizer, "loss_scale_factor", None)
        return tf.constant(1.0 if factor is None else float(factor), tf.float32)

    # --- serialisation -----------------------------------------------------------

    def get_config(self) -> dict:
        """The wrapper's options and the wrapped optimizer's config.

        Example:
            ```python
            same = kr.optimizers.CrossReplicaOptimizer.from_config(opt.get_config())
            ```
        """
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "accumulation_steps": self.accumulation_steps,
            "compression": self.compression,
            "clip_global_norm": self.clip_global_norm,
            "skip_nonfinite": self.skip_nonfinite,
        }

    @classmethod
    def from_config(cls, config: dict, custom_objects=None) -> CrossReplicaOptimizer:
        """Rebuilds the wrapper (and the wrapped optimizer) from ``get_config()``."""
        config = dict(config)
        optimizer = keras.saving.deserialize_keras_object(
            config.pop("optimizer"), custom_objects=custom_objects
        )
        return cls(optimizer, **config)


def wrap_optimizer(optimizer: keras.optimizers.Optimizer | str, **kwargs: Any) -> CrossReplicaOptimizer:
    """TF-Replicator's name for `CrossReplicaOptimizer`: ``wrap_optimizer(opt, **kw)``.

    Example:
        ```python
        opt = kr.wrap_optimizer(keras.optimizers.Adam(1e-3), accumulation_steps=4)
        ```

    Args:
        optimizer: the Keras optimizer to wrap.
        **kwargs: the keyword arguments of `CrossReplicaOptimizer`.
    """
    return CrossReplicaOptimizer(optimizer, **kwargs)

