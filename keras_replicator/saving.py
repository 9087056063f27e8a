"""Saving a model once in a multi-worker job: the chief writes, the others write to a temporary place.

Every worker of a multi-worker job holds the same weights, and reading some of
them (metrics and other variables synchronised on read) runs a collective that
every worker must join; so every worker saves, and only the chief's file is
kept. This is the pattern of TensorFlow's multi-worker guide, as one call.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import keras
import tensorflow as tf

from keras_replicator._validation import ArgumentError


def _is_chief(model: keras.Model) -> bool:
    strategy = getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()
    if hasattr(strategy, "is_chief"):  # ReplicatorStrategy
        return bool(strategy.is_chief)
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.cluster_spec().as_dict():
        return True
    task_type, task_id = resolver.task_type, resolver.task_id
    if task_type == "chief":
        return True
    return task_type == "worker" and task_id == 0 and "chief" not in resolver.cluster_spec().jobs


def save_model(model: keras.Model, filepath: str, **kwargs: Any) -> bool:
    """``model.save(filepath)`` on the chief; the other workers save to a temporary path.

    In a multi-worker job every worker must call it (the save reads variables
    whose value needs all workers); only the chief's file is written at
    ``filepath``, so two workers never write the same file. On one machine it
    is ``model.save(filepath)``.

    Example:
        ```python
        import keras, numpy as np
        import keras_replicator as kr

        strategy = kr.ReplicatorStrategy()
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile("sgd", "mse")
        model.fit(np.ones((64, 4)), np.ones((64, 1)), epochs=1, verbose=0)
        kr.save_model(model, "final.keras")   # every worker calls it; the chief writes it
        ```

    Args:
        model: the trained model.
        filepath: where the chief writes it (a ``.keras`` or ``.weights.h5`` path,
            or any path ``model.save`` takes).
        **kwargs: passed to ``model.save`` (e.g. ``overwrite``).

    Returns:
        True on the worker that wrote ``filepath`` (the chief), False elsewhere.
    """
    if not isinstance(model, keras.Model):
        raise ArgumentError(f"model must be a keras.Model, got {type(model).__name__}.")
    if not isinstance(filepath, (str, os.PathLike)) or not os.fspath(filepath):
        raise ArgumentError(f"filepath must be a path, got {filepath!r}.")
    filepath = os.fspath(filepath)
    save = model.save_weights if filepath.endswith(".weights.h5") else model.save
    if _is_chief(model):
        save(filepath, **kwargs)
        return True
    scratch = tempfile.mkdtemp(prefix="keras_replicator_save_")
    try:
        save(os.path.join(scratch, os.path.basename(filepath)), **kwargs)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return False
