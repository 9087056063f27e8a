"""The epoch a Keras `fit` starts at, set from a callback's `on_train_begin`.

Reads and writes `Trainer._initial_epoch` (keras.src.trainers.trainer; checked on Keras
3.15): `fit` reads it after `on_train_begin` (`initial_epoch = self._initial_epoch or
initial_epoch`, keras/src/backend/tensorflow/trainer.py), which is how Keras's own
`BackupAndRestore` resumes at the epoch after its backup. `keras_replicator.ray_train`'s
`ReportCheckpoint` resumes from Ray Train's checkpoint the same way. Keras has no public API
for it: `fit(initial_epoch=...)` is fixed before any callback runs.
"""

from __future__ import annotations

import keras


def initial_epoch(model: keras.Model) -> int | None:
    """The epoch `fit` will start at if a callback set one (`None`: `fit`'s argument)."""
    return getattr(model, "_initial_epoch", None)


def set_initial_epoch(model: keras.Model, epoch: int) -> None:
    """Makes the running `fit` start at `epoch` (call from `on_train_begin`)."""
    model._initial_epoch = int(epoch)
