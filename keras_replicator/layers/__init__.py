"""Layers for replicated training: one module per kind of layer.

* `batch_normalization`: `GlobalBatchNormalization` and
  `ConditionalGlobalBatchNormalization`, wiring up the kernels of
  `batch_norm_ops` (statistics exchange, closed-form gradient, fused paths).
* `batch_norm_conversion`: `convert_to_global_batch_norm`.
* `spectral_normalization`: `SpectralNormalization` (power-iteration state
  identical on every replica) and `spectral_norm_sigma`.

Example:
    ```python
    import keras
    import keras_replicator as kr

    strategy = kr.ReplicatorStrategy()
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((8,)),
            keras.layers.Dense(16),
            kr.layers.GlobalBatchNormalization(),
        ])
    ```
"""

from keras_replicator.layers.batch_norm_conversion import convert_to_global_batch_norm
from keras_replicator.layers.batch_normalization import (
    ConditionalGlobalBatchNormalization,
    GlobalBatchNormalization,
)
from keras_replicator.layers.spectral_normalization import (
    SpectralNormalization,
    spectral_norm_sigma,
)

__all__ = [
    "ConditionalGlobalBatchNormalization",
    "GlobalBatchNormalization",
    "SpectralNormalization",
    "convert_to_global_batch_norm",
    "spectral_norm_sigma",
]
