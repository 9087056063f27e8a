"""The exceptions keras_replicator raises for users to catch.

A bad argument raises `ArgumentError`, which is both a `ValueError` and a
`TypeError`, so code that catches either keeps working. The others are the
conditions a program may want to handle on their own: a broken cluster
description, a cluster that did not come up or lost a worker, devices configured
too late, replicas that diverged.

Example:
    ```python
    import keras_replicator as kr

    try:
        kr.simulate_devices(4)
    except kr.errors.DeviceConfigurationError as e:
        print("TensorFlow had already started:", e)
    ```
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from keras_replicator._validation import ArgumentError
from keras_replicator.versions import (
    IncompatiblePatchError,
    UnsupportedVersionError,
    UntestedVersionWarning,
)

__all__ = [
    "ArgumentError",
    "ClusterConfigError",
    "ClusterStartupError",
    "DeviceConfigurationError",
    "IncompatiblePatchError",
    "LayoutError",
    "LayoutWarning",
    "ParameterServerLostError",
    "ReplicaDivergenceError",
    "ResumeError",
    "UnsupportedVersionError",
    "UntestedVersionWarning",
    "WorkerLostError",
]


class DeviceConfigurationError(RuntimeError):
    """Raised when devices can no longer be configured (TensorFlow already started)."""


class ClusterConfigError(ValueError):
    """The cluster description (`TF_CONFIG`, Slurm, a resolver) is malformed."""


class ClusterStartupError(RuntimeError):
    """The workers of a multi-worker job could not connect to each other in time."""


class WorkerLostError(tf.errors.UnavailableError):
    """A worker of a multi-worker job stopped responding; training stopped.

    A subclass of `tf.errors.UnavailableError`, so handlers of TensorFlow's
    own error keep working. `lost_workers` names the workers that were lost,
    e.g. `["worker 1 (/job:worker/task:1 at 10.0.0.2:2222)"]`.

    Example:
        ```python
        try:
            model.fit(data, epochs=10, callbacks=[keras.callbacks.BackupAndRestore("/shared/backup")])
        except kr.WorkerLostError as e:
            print("lost:", e.lost_workers)   # restart the job: it resumes from the backup
            raise
        ```
    """

    def __init__(self, message: str, lost_workers: Sequence[str] = ()):
        super().__init__(None, None, message)
        self.lost_workers = list(lost_workers)

    def __reduce__(self):
        return type(self), (self.message, self.lost_workers)


class ParameterServerLostError(tf.errors.UnavailableError):
    """A parameter server of an asynchronous job stopped responding; training stopped.

    Raised on the chief by `model.fit` (and `evaluate`, `predict`, `save`) under
    `AsyncReplicatorStrategy`. The variables it held are gone, so the job
    cannot go on: restart every task; `keras.callbacks.BackupAndRestore`
    resumes from the last saved epoch. A subclass of
    `tf.errors.UnavailableError`; `lost_parameter_servers` names the lost
    tasks, e.g. `["ps 0 (/job:ps/task:0 at 10.0.0.3:2222)"]`.

    Example:
        ```python
        try:
            model.fit(train, epochs=10, steps_per_epoch=100,
                      callbacks=[keras.callbacks.BackupAndRestore("/shared/backup")])
        except kr.errors.ParameterServerLostError as e:
            print("lost:", e.lost_parameter_servers)   # restart the job to resume
            raise
        ```
    """

    def __init__(self, message: str, lost_parameter_servers: Sequence[str] = ()):
        super().__init__(None, None, message)
        self.lost_parameter_servers = list(lost_parameter_servers)

    def __reduce__(self):
        return type(self), (self.message, self.lost_parameter_servers)


class ReplicaDivergenceError(RuntimeError):
    """Raised by `ReplicaConsistencyCheck` when the replicas' copies of a variable differ."""


class ResumeError(ValueError):
    """A backup cannot be restored as it is on this run's shape (replicas, global batch).

    Raised by ``keras.callbacks.BackupAndRestore`` when `fit` starts, before any step:
    the new replica count does not divide the global batch, or the backup stopped
    inside an epoch at an example this run's global batch cannot start a step at.
    The message names the choices.
    """


class LayoutError(ValueError):
    """A `keras.distribution.LayoutMap` that cannot be applied as written.

    Raised before any step, naming the variable and the rule: a variable that
    matches two rules, a layout whose rank is not the variable's, a sharded
    dimension its mesh axis does not divide, an axis the mesh does not have; and,
    with `ReplicatorStrategy(strict_layouts=True)`, a rule that matches no
    variable (else a `LayoutWarning`).
    """


class LayoutWarning(UserWarning):
    """A `keras.distribution.LayoutMap` rule matched no variable of the model; training goes on.

    Keras's semantics (a rule that matches nothing lays nothing out): the warning
    names the rules and the variables no rule matched, which stay whole on every
    device. `ReplicatorStrategy(strict_layouts=True)` raises `LayoutError` instead,
    the way to catch a renamed layer; `warnings.simplefilter("ignore", LayoutWarning)`
    silences it.
    """
