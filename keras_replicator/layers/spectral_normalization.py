"""Spectral normalization (Miyato et al. 2018) that stays identical on every replica.

`SpectralNormalization` wraps a layer with a `kernel` (`Dense`, `Conv1D/2D/3D`,
`Conv2DTranspose`, ...) or `embeddings` (`Embedding`) and calls it with
`W / sigma(W)`, `sigma(W)` the largest singular value of the weight reshaped to a
matrix `[-1, last_dim]`, estimated by power iteration from a persistent vector
`u` (one step per training call, as in the paper and pfnet-research/sngan_projection).

The gradient flows through `sigma` (the reparametrisation of the paper). Keras's own
`keras.layers.SpectralNormalization` instead *overwrites* the wrapped kernel with
`W / sigma` on every training call, so its gradient ignores `sigma` and the stored
weights are the normalized ones: a different method.

Replicas: `u` is a non-trainable variable with aggregation `"only_first_replica"`.
Every replica computes the same update from the same (mirrored) kernel and the same
`u`, and the variable takes replica 0's value, so `u` is identical on every replica
by construction (bit for bit), with no collective. It is an ordinary layer weight:
saved and restored with the model (`model.save`, checkpoints, `BackupAndRestore`).
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from keras_replicator._validation import ArgumentError, check_int, check_number

__all__ = ["SpectralNormalization", "spectral_norm_sigma"]


def _l2_normalize(x, epsilon: float):
    return x / (ops.sqrt(ops.sum(ops.square(x))) + epsilon)


def spectral_norm_sigma(
    matrix: Any, u: Any, power_iterations: int = 1, epsilon: float = 1e-12
) -> tuple[Any, Any]:
    """One estimate of the largest singular value of `matrix` by power iteration.

    Args:
        matrix: a `[m, n]` tensor.
        u: the current `[1, n]` estimate of the leading right singular vector.
        power_iterations: how many iterations to run from `u`.
        epsilon: added to norms before dividing.

    Returns:
        `(sigma, new_u)`: the scalar estimate `v matrix u^T` (differentiable in
        `matrix`; `u` and `v` are held constant as in the paper) and the updated `u`.

    Example:
        ```python
        import numpy as np
        from keras_replicator.layers import spectral_norm_sigma

        w = np.random.randn(6, 4).astype("float32")
        u = np.random.randn(1, 4).astype("float32")
        sigma, u = spectral_norm_sigma(w, u, power_iterations=20)
        ```
    """
    u = ops.convert_to_tensor(u)
    v = None
    for _ in range(power_iterations):
        v = _l2_normalize(ops.matmul(u, ops.transpose(matrix)), epsilon)  # [1, m]
        u = _l2_normalize(ops.matmul(v, matrix), epsilon)  # [1, n]
    u = ops.stop_gradient(u)
    v = ops.stop_gradient(v)
    sigma = ops.sum(ops.matmul(v, matrix) * u)
    return sigma, u


@keras.saving.register_keras_serializable(package="keras_replicator")
class SpectralNormalization(keras.layers.Wrapper):
    """Calls the wrapped layer with its weight divided by its spectral norm.

    The wrapped layer's `kernel` (or `embeddings`) is the trainable weight; the
    layer adds the non-trainable power-iteration vector `u` of shape
    `[1, last_dim]`, updated once per training call (`power_iterations` steps)
    and kept identical on every replica (aggregation `"only_first_replica"`;
    every replica computes the same value). In inference the same iterations run
    from the stored `u`, which is not updated.

    Example:
        ```python
        import keras
        import keras_replicator as kr

        strategy = kr.ReplicatorStrategy()
        with strategy.scope():
            critic = keras.Sequential([
                keras.Input((32, 32, 3)),
                kr.layers.SpectralNormalization(keras.layers.Conv2D(64, 3)),
                keras.layers.GlobalAveragePooling2D(),
                kr.layers.SpectralNormalization(keras.layers.Dense(1)),
            ])
        ```

    Args:
        layer: a Keras layer with a `kernel` or an `embeddings` weight.
        power_iterations: power-iteration steps per training call (>= 1).
        epsilon: added to vector norms before dividing.
        **kwargs: base layer arguments (`name`, `dtype`, ...).
    """

    def __init__(
        self,
        layer: keras.layers.Layer,
        power_iterations: int = 1,
        epsilon: float = 1e-12,
        **kwargs: Any,
    ):
        if not isinstance(layer, keras.layers.Layer):
            raise ArgumentError(
                f"SpectralNormalization wraps a Keras layer, got {type(layer).__name__}: "
                f"{layer!r}."
            )
        self.power_iterations = check_int("power_iterations", power_iterations, minimum=1)
        self.epsilon = check_number("epsilon", epsilon, positive=True)
        super().__init__(layer, **kwargs)

    def _weight(self):
        for attr in ("kernel", "embeddings"):
            w = getattr(self.layer, attr, None)
            if isinstance(w, keras.Variable):
                return w
        raise ArgumentError(
            f"SpectralNormalization needs a layer with a `kernel` or `embeddings` weight; "
            f"{type(self.layer).__name__} {self.layer.name!r} has neither."
        )

    def build(self, input_shape):
        if not self.layer.built:
            self.layer.build(input_shape)
        weight = self._weight()
        self.u = self.add_weight(
            shape=(1, weight.shape[-1]),
            initializer=keras.initializers.RandomNormal(),
            trainable=False,
            aggregation="only_first_replica",
            name="u",
            dtype=weight.dtype,
        )
        self.built = True

    def normalized_weight(self):
        """`(W / sigma(W), new_u)`: one power-iteration run from the stored `u`.

        As in pfnet-research/sngan_projection, the same iterations run in
        training and in inference; only training stores the new `u`.
        """
        w = ops.convert_to_tensor(self._weight())
        matrix = ops.reshape(w, (-1, w.shape[-1]))
        sigma, new_u = spectral_norm_sigma(matrix, self.u, self.power_iterations, self.epsilon)
        return w / sigma, new_u

    def call(self, inputs, training=None):
        weight = self._weight()
        normalized, new_u = self.normalized_weight()
        if training:
            self.u.assign(new_u)
        with keras.StatelessScope(state_mapping=[(weight, normalized)]):
            return self.layer(inputs)

    def compute_output_shape(self, input_shape):
        return self.layer.compute_output_shape(input_shape)

    def get_config(self) -> dict:
        config = super().get_config()
        config.update(power_iterations=self.power_iterations, epsilon=self.epsilon)
        return config
