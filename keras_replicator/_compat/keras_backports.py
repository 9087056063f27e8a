"""What keras_replicator needs from Keras 3.9 and 3.10, on Keras 3.8 and 3.9 (feature-detected).

* `variable(synchronization=...)`: `keras.Variable(synchronization=...)` is from
  Keras 3.10; Keras 3.8 and 3.9 create the TensorFlow variable without one
  (`keras.src.backend.tensorflow.core.Variable._initialize` passes `aggregation`
  only). Where Keras takes the keyword it is passed; otherwise it is added to the
  `tf.Variable` Keras creates, through a `tf.variable_creator_scope` around the
  creation: the same `tf.Variable` either way (Keras 3.10+ only maps the string to
  `tf.VariableSynchronization` and passes it on).
* `PATCHES`: Keras 3.8's `data_adapters.is_tf_dataset` (what `fit` accepts as a
  dataset) knows `DistributedDataset` but not `DistributedDatasetsFromFunction`,
  which `strategy.distribute_dataset` returns; Keras 3.9 added it to the same
  list, nothing else. On a Keras without it, an installed patch recognises one
  made by keras_replicator's strategies (`patching.ours`), as Keras 3.9 does; on
  Keras 3.9+ there is nothing to patch.
* `PATCHES`: Keras 3.10 made every metric variable `synchronization="on_read"`
  (`Metric.add_variable`: each replica accumulates its own, read as their sum);
  Keras 3.8 and 3.9 make them mirrored with `aggregation="sum"`, which
  keras_replicator's steps do not read as Keras 3.10+ does (measured: a metric
  counting examples counted them several times). Under our strategies the
  installed patch makes them on-read there too, as Keras 3.10 does.

Checked on Keras 3.8-3.15 (the keyword in `keras.Variable.__init__`, the name in
`is_tf_dataset`'s code, the keyword in `Metric.add_variable`'s code).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import keras
import tensorflow as tf
from keras.src.metrics import metric as keras_metric
from keras.src.trainers import data_adapters

from keras_replicator._compat import patching
from keras_replicator._compat.patching import ScopedPatch, ours

_SYNCHRONIZATIONS = {
    "auto": tf.VariableSynchronization.AUTO,
    "none": tf.VariableSynchronization.NONE,
    "on_read": tf.VariableSynchronization.ON_READ,
    "on_write": tf.VariableSynchronization.ON_WRITE,
}


@functools.cache
def takes_synchronization() -> bool:
    """Whether this Keras's `keras.Variable` takes `synchronization` (Keras 3.10+)."""
    return "synchronization" in inspect.signature(keras.Variable.__init__).parameters


def variable(*, synchronization: str, **kwargs: Any) -> keras.Variable:
    """`keras.Variable(synchronization=synchronization, **kwargs)` on any supported Keras."""
    if takes_synchronization():
        return keras.Variable(synchronization=synchronization, **kwargs)

    def creator(next_creator, **options):
        options["synchronization"] = _SYNCHRONIZATIONS[synchronization]
        return next_creator(**options)

    with tf.variable_creator_scope(creator):
        return keras.Variable(**kwargs)


def knows_datasets_from_function() -> bool:
    """Whether this Keras's `fit` takes a `DistributedDatasetsFromFunction` (Keras 3.9+)."""
    return "DistributedDatasetsFromFunction" in patching.code_names(data_adapters.is_tf_dataset)


def _ours_from_function(x: Any) -> bool:
    return (type(x).__name__ == "DistributedDatasetsFromFunction"
            and ours(getattr(x, "_strategy", None)))


def _also_datasets_from_function(original):
    @functools.wraps(original)
    def is_tf_dataset(x):
        return original(x) or _ours_from_function(x)

    return is_tf_dataset


def metrics_on_read() -> bool:
    """Whether this Keras makes metric variables on-read itself (Keras 3.10+)."""
    return "synchronization" in patching.code_names(keras_metric.Metric.add_variable)


def _on_read_under_ours(original):
    @functools.wraps(original)
    def add_variable(self, *args, **kwargs):
        if not (tf.distribute.has_strategy() and ours(tf.distribute.get_strategy())):
            return original(self, *args, **kwargs)

        def creator(next_creator, **options):
            options["synchronization"] = tf.VariableSynchronization.ON_READ
            return next_creator(**options)

        with tf.variable_creator_scope(creator):
            return original(self, *args, **kwargs)

    return add_variable


# Installed by keras_replicator._compat.install(), undone by uninstall(); none on Keras 3.10+.
PATCHES = (
    *(() if knows_datasets_from_function() else (
        ScopedPatch(data_adapters, "is_tf_dataset", _also_datasets_from_function),)),
    *(() if metrics_on_read() else (
        ScopedPatch(keras_metric.Metric, "add_variable", _on_read_under_ours),)),
)
