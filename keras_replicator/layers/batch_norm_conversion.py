"""`convert_to_global_batch_norm`: a model's Keras ``BatchNormalization`` layers made global.

Clones a Functional or Sequential model with each Keras ``BatchNormalization``
replaced by a `GlobalBatchNormalization` of the same configuration, weights and
moving statistics included (PyTorch's ``SyncBatchNorm.convert_sync_batchnorm``).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_replicator._validation import ArgumentError, check_int
from keras_replicator.layers.batch_normalization import GlobalBatchNormalization

__all__ = ["convert_to_global_batch_norm"]


# --- conversion -----------------------------------------------------------------

# The keras.layers.BatchNormalization arguments GlobalBatchNormalization takes over.
_CONVERTED_ARGS = (
    "name",
    "trainable",
    "dtype",
    "axis",
    "momentum",
    "epsilon",
    "center",
    "scale",
    "beta_initializer",
    "gamma_initializer",
    "moving_mean_initializer",
    "moving_variance_initializer",
    "beta_regularizer",
    "gamma_regularizer",
    "beta_constraint",
    "gamma_constraint",
)


def _is_plain_batch_norm(layer) -> bool:
    return isinstance(layer, keras.layers.BatchNormalization)


def _to_global(layer: keras.layers.BatchNormalization, group_size: int | None):
    config = layer.get_config()
    if config.get("renorm"):
        raise ArgumentError(
            f"Layer {layer.name!r} uses batch renormalization (renorm=True), which "
            "GlobalBatchNormalization does not implement; it cannot be converted."
        )
    kwargs = {key: config[key] for key in _CONVERTED_ARGS if key in config}
    return GlobalBatchNormalization(group_size=group_size, **kwargs)


def _variable_strategy(model: keras.Model):
    """The tf.distribute strategy that created ``model``'s variables, if any."""
    for weight in model.weights:
        value = getattr(weight, "value", weight)
        if isinstance(value, tf.distribute.DistributedValues):
            return getattr(value, "distribute_strategy", None)
    return None


def convert_to_global_batch_norm(
    model: keras.Model, *, group_size: int | None = None
) -> keras.Model:
    """A copy of ``model`` with every Keras ``BatchNormalization`` made global.

    Clones a Functional or Sequential model (nested Functional and Sequential
    models too) with each ``keras.layers.BatchNormalization`` replaced by a
    `GlobalBatchNormalization` of the same configuration, and copies
    every weight, moving statistics included, so the new model computes the
    same function. The original model is not modified. The copy is not
    compiled. This is PyTorch's ``SyncBatchNorm.convert_sync_batchnorm``.

    The copy's variables are created under the current strategy scope, or else
    under the strategy that created ``model``'s variables.

    Example:
        ```python
        import keras
        import keras_replicator as kr

        kr.simulate_devices(4)
        strategy = kr.ReplicatorStrategy()
        with strategy.scope():
            model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
            model = kr.layers.convert_to_global_batch_norm(model)
            model.compile("sgd", "sparse_categorical_crossentropy")
        ```

    Args:
        model: a Functional or Sequential Keras model.
        group_size: passed to every new layer (see
            `GlobalBatchNormalization`); ``None`` normalizes over all
            replicas.

    Returns:
        The converted model.

    Raises:
        TypeError: ``model`` is not a Functional or Sequential model (a
            subclassed model cannot be cloned; build it with
            `GlobalBatchNormalization` directly).
        ValueError: a layer uses ``renorm=True``, or ``group_size`` is invalid.
    """
    if not isinstance(model, keras.Model):
        raise ArgumentError(f"convert_to_global_batch_norm takes a Keras model, got {model!r}.")
    functional = not isinstance(model, keras.Sequential) and bool(getattr(model, "inputs", None))
    if not (isinstance(model, keras.Sequential) or functional):
        raise ArgumentError(
            f"convert_to_global_batch_norm works on Functional and Sequential models; "
            f"{type(model).__name__!r} is a subclassed model, which Keras cannot clone. "
            "Use kr.layers.GlobalBatchNormalization in its definition instead."
        )
    if group_size is not None:
        check_int("group_size", group_size, minimum=1)
    cloned_original = {}

    def clone(layer):
        if _is_plain_batch_norm(layer):
            new = _to_global(layer, group_size)
        else:
            new = layer.__class__.from_config(layer.get_config())
        cloned_original[id(new)] = layer
        return new

    strategy = None if tf.distribute.has_strategy() else _variable_strategy(model)
    if strategy is not None:
        with strategy.scope():
            converted = keras.models.clone_model(model, clone_function=clone, recursive=True)
    else:
        converted = keras.models.clone_model(model, clone_function=clone, recursive=True)
    old, new = model.get_weights(), converted.weights
    if len(old) != len(new):
        raise ValueError(
            f"The converted model has {len(new)} weights where the original has {len(old)}; "
            "is a layer built lazily? Build the model (call it once) before converting."
        )
    for weight, value in zip(new, old):
        if tuple(weight.shape) != value.shape:
            raise ValueError(
                f"Weight {weight.path!r} has shape {tuple(weight.shape)} in the converted model "
                f"and {value.shape} in the original."
            )
    converted.set_weights(old)
    return converted
