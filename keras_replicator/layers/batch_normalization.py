"""Cross-replica batch normalization layers that are numerically right.

* `GlobalBatchNormalization` normalizes with the statistics of the
  global batch (every replica of every worker), or of groups of ``group_size``
  consecutive replicas, as TF-Replicator, BigGAN and compare_gan do.
* `ConditionalGlobalBatchNormalization` is its class-conditional variant
  (per-class ``gamma``/``beta``, as in SN-GAN and BigGAN generators).

The layers hold the weights and the moving statistics and wire up the kernels
of `keras_replicator.layers.batch_norm_ops` (how the statistics are exchanged
and combined, the closed-form gradient, the fused paths);
`convert_to_global_batch_norm` lives in
`keras_replicator.layers.batch_norm_conversion`.

On float32 inputs with mean 1e4 and standard deviation 1 the outputs stay
within 1e-2 of a float64 reference, where Keras's
``BatchNormalization(synchronized=True)`` (``E[x^2] - E[x]^2`` over three
all-reduces) is off by about 100: the statistics are combined with the
parallel-variance formula, never through ``E[x^2]``.

Plain Keras ``BatchNormalization`` under ``ReplicatorStrategy`` keeps per-replica
(local) batch statistics, as the user asked for, but its moving statistics are
kept identical on every replica: they are created with ``aggregation="mean"``,
so each update is averaged across replicas (see ``docs/batch_norm.md``).
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from keras_replicator import collectives
from keras_replicator._compat import short_batches
from keras_replicator._validation import ArgumentError, check_bool, check_int, check_number
from keras_replicator.layers.batch_norm_ops import (
    _affine_normalize,
    _global_moments,
    _plain_affine_normalize,
    _stats_dtype,
    _train_normalize,
)

__all__ = [
    "ConditionalGlobalBatchNormalization",
    "GlobalBatchNormalization",
]


@keras.saving.register_keras_serializable(package="keras_replicator")
class GlobalBatchNormalization(keras.layers.Layer):
    """Batch normalization over the global batch of all replicas (or groups of them).

    A drop-in replacement for ``keras.layers.BatchNormalization`` (its
    arguments less ``synchronized`` and the ``renorm`` ones, plus
    ``group_size``; weights in the same order and with the same names) whose
    training-mode statistics are those of the whole batch across replicas and
    workers, exchanged in one collective per call and combined with the
    parallel-variance formula, so they are right even for inputs whose mean is
    large against their spread. At inference (``training=False``, or
    ``trainable=False``, as in Keras) it uses the moving statistics, which are
    identical on every replica. With no strategy (one device) it is ordinary
    batch normalization.

    Example:
        ```python
        import keras
        import keras_replicator as kr

        kr.simulate_devices(4)
        strategy = kr.ReplicatorStrategy()
        with strategy.scope():
            model = keras.Sequential([
                keras.Input((32, 32, 3)),
                keras.layers.Conv2D(16, 3, use_bias=False),
                kr.layers.GlobalBatchNormalization(),          # all 4 replicas
                keras.layers.ReLU(),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(10),
            ])
        ```

    Args:
        axis: the features axis (an integer; e.g. ``1`` after a
            ``channels_first`` convolution). Not the batch axis.
        momentum: momentum of the moving averages, in ``[0, 1]``:
            ``moving = moving * momentum + batch_statistic * (1 - momentum)``.
        epsilon: small positive float added to the variance.
        center: if ``True``, add the learned offset ``beta``.
        scale: if ``True``, multiply by the learned scale ``gamma``.
        group_size: normalize over groups of ``group_size`` consecutive
            replicas (replicas ``0..g-1``, ``g..2g-1``, ...) instead of all
            replicas, as grouped batch norm in BigGAN. Must divide the number
            of replicas. ``None``: all replicas. On a single replica (no
            strategy) the layer normalizes over the local batch whatever the
            group size. The moving statistics follow the count-weighted average
            of the group statistics, identical on every replica.
        beta_initializer: initializer of ``beta``.
        gamma_initializer: initializer of ``gamma``.
        moving_mean_initializer: initializer of the moving mean.
        moving_variance_initializer: initializer of the moving variance.
        beta_regularizer: optional regularizer of ``beta``.
        gamma_regularizer: optional regularizer of ``gamma``.
        beta_constraint: optional constraint of ``beta``.
        gamma_constraint: optional constraint of ``gamma``.
        **kwargs: base layer arguments (``name``, ``dtype``, ``trainable``).

    Call arguments:
        inputs: a tensor of any rank >= 2.
        training: ``True`` normalizes with the (global or group) batch
            statistics and updates the moving statistics; otherwise the moving
            statistics are used.
        mask: optional boolean tensor of the shape of ``inputs`` without the
            features axis; masked-out positions do not count in the statistics.
    """

    # Its forward pass all-reduces: under jit_compile it runs outside XLA (the layers
    # around it are compiled one by one; see keras_replicator._compat.keras_xla).
    _keras_replicator_cross_replica_call = True

    def __init__(
        self,
        axis: int = -1,
        momentum: float = 0.99,
        epsilon: float = 1e-3,
        center: bool = True,
        scale: bool = True,
        group_size: int | None = None,
        beta_initializer: Any = "zeros",
        gamma_initializer: Any = "ones",
        moving_mean_initializer: Any = "zeros",
        moving_variance_initializer: Any = "ones",
        beta_regularizer: Any = None,
        gamma_regularizer: Any = None,
        beta_constraint: Any = None,
        gamma_constraint: Any = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.axis = check_int("axis", axis)
        self.momentum = check_number("momentum", momentum)
        if not 0.0 <= self.momentum <= 1.0:
            raise ArgumentError(f"momentum must be in [0, 1], got {momentum!r}.")
        self.epsilon = check_number("epsilon", epsilon, positive=True)
        self.center, self.scale = check_bool("center", center), check_bool("scale", scale)
        if group_size is not None:
            check_int("group_size", group_size, minimum=1)
            if tf.distribute.has_strategy():  # known now: fail before any work
                num_replicas = tf.distribute.get_strategy().num_replicas_in_sync
                if num_replicas > 1:  # one replica normalizes whatever the group size
                    collectives.check_group_size(group_size, num_replicas)
        self.group_size = group_size
        self.beta_initializer = keras.initializers.get(beta_initializer)
        self.gamma_initializer = keras.initializers.get(gamma_initializer)
        self.moving_mean_initializer = keras.initializers.get(moving_mean_initializer)
        self.moving_variance_initializer = keras.initializers.get(moving_variance_initializer)
        self.beta_regularizer = keras.regularizers.get(beta_regularizer)
        self.gamma_regularizer = keras.regularizers.get(gamma_regularizer)
        self.beta_constraint = keras.constraints.get(beta_constraint)
        self.gamma_constraint = keras.constraints.get(gamma_constraint)
        self.supports_masking = True
        self.gamma = self.beta = self.moving_mean = self.moving_variance = None

    # --- building -------------------------------------------------------------

    def _resolve_axis(self, input_shape) -> int:
        rank = len(input_shape)
        if rank < 2:
            raise ArgumentError(
                f"{type(self).__name__} needs inputs of rank >= 2 (batch, ..., features), "
                f"got shape {tuple(input_shape)}."
            )
        if not -rank <= self.axis < rank:
            raise ArgumentError(
                f"axis={self.axis} is out of range for inputs of rank {rank} "
                f"(shape {tuple(input_shape)})."
            )
        axis = self.axis % rank
        if axis == 0:
            raise ArgumentError("axis=0 is the batch axis; give the features axis (e.g. -1).")
        if input_shape[axis] is None:
            raise ArgumentError(
                f"The features axis {self.axis} of the inputs must have a known size, "
                f"got shape {tuple(input_shape)}."
            )
        return axis

    def _add_affine_weights(self, shape: tuple[int, ...]) -> None:
        if self.scale:
            self.gamma = self.add_weight(
                shape=shape,
                name="gamma",
                initializer=self.gamma_initializer,
                regularizer=self.gamma_regularizer,
                constraint=self.gamma_constraint,
                trainable=True,
                autocast=False,
            )
        if self.center:
            self.beta = self.add_weight(
                shape=shape,
                name="beta",
                initializer=self.beta_initializer,
                regularizer=self.beta_regularizer,
                constraint=self.beta_constraint,
                trainable=True,
                autocast=False,
            )

    def _add_moving_statistics(self, channels: int) -> None:
        self.moving_mean = self.add_weight(
            shape=(channels,),
            name="moving_mean",
            initializer=self.moving_mean_initializer,
            trainable=False,
            autocast=False,
        )
        self.moving_variance = self.add_weight(
            shape=(channels,),
            name="moving_variance",
            initializer=self.moving_variance_initializer,
            trainable=False,
            autocast=False,
        )

    def build(self, input_shape):
        self._axis = self._resolve_axis(input_shape)
        channels = int(input_shape[self._axis])
        self._add_affine_weights((channels,))
        self._add_moving_statistics(channels)
        self.input_spec = keras.layers.InputSpec(
            ndim=len(input_shape), axes={self._axis: channels}
        )

    def compute_output_shape(self, input_shape):
        return input_shape

    # --- the maths ------------------------------------------------------------

    def _normalize(self, inputs, training, mask, gamma, beta) -> tf.Tensor:
        """``gamma * (x - mean) / sqrt(variance + epsilon) + beta`` in the statistics dtype.

        Uses (and updates) the global batch statistics in training mode, the
        moving statistics otherwise. ``gamma`` and ``beta`` are per-channel
        weights, or ``None`` for none.
        """
        x = tf.convert_to_tensor(inputs)
        dtype = _stats_dtype(x.dtype)
        x = tf.cast(x, dtype)
        if mask is not None:
            mask = tf.convert_to_tensor(mask)
            if mask.shape.rank != x.shape.rank - 1:
                raise ArgumentError(
                    "The mask must have the shape of the inputs without the features axis; got "
                    f"mask.shape={mask.shape}, inputs.shape={x.shape}."
                )
        channels = x.shape[self._axis]
        gamma = tf.ones([channels], dtype) if gamma is None else tf.cast(gamma, dtype)
        beta = tf.zeros([channels], dtype) if beta is None else tf.cast(beta, dtype)
        training = training and self.trainable
        if training and mask is None:
            mask = short_batches.padding_mask(x, self._axis)  # a padding replica's row counts nothing
        if training and mask is None:
            outputs, new_mean, new_variance = _train_normalize(
                x, gamma, beta, self._axis, self.group_size, self.epsilon
            )
            self._update_moving_statistics(new_mean, new_variance)
            return outputs
        if training:  # masked: statistics of the unmasked positions only, differentiated
            mean, variance, new_mean, new_variance = _global_moments(
                x, self._axis, mask, self.group_size
            )
            self._update_moving_statistics(new_mean, new_variance)
            return _plain_affine_normalize(x, mean, variance, gamma, beta, self._axis, self.epsilon)
        # Inference: the moving statistics are constants, so the fused kernel serves.
        mean = tf.cast(self.moving_mean, dtype)
        variance = tf.cast(self.moving_variance, dtype)
        return _affine_normalize(x, mean, variance, gamma, beta, self._axis, self.epsilon)

    def _update_moving_statistics(self, mean, variance):
        momentum = self.momentum
        for var, value in ((self.moving_mean, mean), (self.moving_variance, variance)):
            current = tf.cast(var, value.dtype)
            var.assign(tf.cast(current * momentum + value * (1.0 - momentum), var.dtype))

    def call(self, inputs, training=None, mask=None):
        outputs = self._normalize(inputs, training, mask, self.gamma, self.beta)
        return tf.cast(outputs, self.compute_dtype)

    # --- serialization --------------------------------------------------------

    def get_config(self) -> dict:
        config = super().get_config()
        config.update(
            {
                "axis": self.axis,
                "momentum": self.momentum,
                "epsilon": self.epsilon,
                "center": self.center,
                "scale": self.scale,
                "group_size": self.group_size,
                "beta_initializer": keras.initializers.serialize(self.beta_initializer),
                "gamma_initializer": keras.initializers.serialize(self.gamma_initializer),
                "moving_mean_initializer": keras.initializers.serialize(
                    self.moving_mean_initializer
                ),
                "moving_variance_initializer": keras.initializers.serialize(
                    self.moving_variance_initializer
                ),
                "beta_regularizer": keras.regularizers.serialize(self.beta_regularizer),
                "gamma_regularizer": keras.regularizers.serialize(self.gamma_regularizer),
                "beta_constraint": keras.constraints.serialize(self.beta_constraint),
                "gamma_constraint": keras.constraints.serialize(self.gamma_constraint),
            }
        )
        return config


@keras.saving.register_keras_serializable(package="keras_replicator")
class ConditionalGlobalBatchNormalization(GlobalBatchNormalization):
    """Class-conditional global batch normalization (SN-GAN / BigGAN generators).

    Normalizes exactly as `GlobalBatchNormalization` (same global or
    grouped statistics, same moving statistics), then applies a per-class
    scale and offset: ``gamma`` and ``beta`` are ``[num_classes, features]``
    tables (class embeddings) and example ``i`` uses row ``class_ids[i]``.

    Call it on a pair ``[x, class_ids]``: ``x`` the features, ``class_ids`` an
    integer tensor of shape ``(batch,)`` or ``(batch, 1)`` with values in
    ``[0, num_classes)``.

    Example:
        ```python
        import keras
        import keras_replicator as kr

        noise = keras.Input((8, 8, 64))
        labels = keras.Input((), dtype="int32")
        h = kr.layers.ConditionalGlobalBatchNormalization(num_classes=10)([noise, labels])
        generator_block = keras.Model([noise, labels], keras.layers.ReLU()(h))
        ```

    Args:
        num_classes: the number of classes (rows of ``gamma`` and ``beta``).
        axis: the features axis; not the batch axis.
        momentum: see `GlobalBatchNormalization`.
        epsilon: see `GlobalBatchNormalization`.
        center: if ``True``, add the per-class offset ``beta``.
        scale: if ``True``, multiply by the per-class scale ``gamma``.
        group_size: see `GlobalBatchNormalization`.
        **kwargs: the initializer, regularizer and constraint arguments of
            `GlobalBatchNormalization` (applied to the whole
            ``[num_classes, features]`` tables) and base layer arguments.

    Call arguments:
        inputs: ``[x, class_ids]``.
        training: as for `GlobalBatchNormalization`.
        mask: optional; a mask of ``x`` (or ``[mask_of_x, None]``).
    """

    def __init__(
        self,
        num_classes: int,
        axis: int = -1,
        momentum: float = 0.99,
        epsilon: float = 1e-3,
        center: bool = True,
        scale: bool = True,
        group_size: int | None = None,
        **kwargs: Any,
    ):
        num_classes = check_int("num_classes", num_classes, minimum=1)
        super().__init__(
            axis=axis,
            momentum=momentum,
            epsilon=epsilon,
            center=center,
            scale=scale,
            group_size=group_size,
            **kwargs,
        )
        self.num_classes = num_classes

    @staticmethod
    def _split(inputs, what: str):
        if not isinstance(inputs, (list, tuple)) or len(inputs) != 2:
            raise ArgumentError(
                "ConditionalGlobalBatchNormalization is called on a pair [x, class_ids]; "
                f"got {what} {inputs!r}."
            )
        return inputs[0], inputs[1]

    @classmethod
    def _split_shapes(cls, input_shape):
        shapes = cls._split(input_shape, "input shape")
        if not all(isinstance(s, (list, tuple, tf.TensorShape)) for s in shapes):
            raise ArgumentError(
                "ConditionalGlobalBatchNormalization is called on a pair [x, class_ids]; "
                f"got one input of shape {tuple(input_shape)}."
            )
        return tuple(shapes[0]), tuple(shapes[1])

    def build(self, input_shape):
        x_shape, ids_shape = self._split_shapes(input_shape)
        self._axis = self._resolve_axis(x_shape)
        if not (len(ids_shape) == 1 or (len(ids_shape) == 2 and ids_shape[1] == 1)):
            raise ArgumentError(
                f"class_ids must have shape (batch,) or (batch, 1), got {ids_shape}."
            )
        channels = int(x_shape[self._axis])
        self._add_affine_weights((self.num_classes, channels))
        self._add_moving_statistics(channels)

    def compute_output_shape(self, input_shape):
        return self._split_shapes(input_shape)[0]

    def compute_mask(self, inputs, mask=None):
        if isinstance(mask, (list, tuple)):
            return mask[0]
        return mask

    def call(self, inputs, training=None, mask=None):
        x, class_ids = self._split(inputs, "inputs")
        if isinstance(mask, (list, tuple)):
            mask = mask[0]
        outputs = self._normalize(x, training, mask, None, None)  # per-class affine below
        x = outputs
        ids = tf.reshape(tf.cast(class_ids, tf.int32), [-1])
        shape = [-1] + [1] * (x.shape.rank - 1)
        shape[self._axis] = outputs.shape[self._axis]
        if self.scale:
            outputs = outputs * tf.reshape(tf.gather(tf.cast(self.gamma, x.dtype), ids), shape)
        if self.center:
            outputs = outputs + tf.reshape(tf.gather(tf.cast(self.beta, x.dtype), ids), shape)
        return tf.cast(outputs, self.compute_dtype)

    def get_config(self) -> dict:
        config = super().get_config()
        config["num_classes"] = self.num_classes
        return config
