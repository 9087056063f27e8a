"""Resuming `fit` mid-epoch after a preemption backup: the epoch iterator fast-forwards once.

Patches `TFEpochIterator._enumerate_iterator` (keras.src.backend.tensorflow.trainer,
checked on Keras 3.15; installed with `keras_trainer`'s patches) and sets a private
attribute on the epoch iterator. Why: Keras 3.15's `BackupAndRestore` restores the
epoch only and restarts it from its first batch; after a backup written mid-epoch at a
preemption (`preemption`, `keras_checkpointing.save_mid_epoch`) the steps already done
would be done twice. `keras_trainer` records the running `fit`'s epoch iterator
(`current`); `BackupAndRestore.on_train_begin` (`keras_checkpointing`) calls
`resume_current_fit_at` with the restored epoch and step.
"""

from __future__ import annotations

import threading

import tensorflow as tf

# The training epoch iterator of the `fit` running in this thread: the last one made
# before the callbacks' on_train_begin (fit makes it first; evaluate's come later).
current = threading.local()


def resume_current_fit_at(epoch: int, step: int) -> bool:
    """Makes the running `fit` skip the data of `epoch`'s first `step` steps (and of the
    epochs before it when batches carry over between epochs, with ``steps_per_epoch``).

    Called from `BackupAndRestore.on_train_begin` (keras_checkpointing) after a backup
    written mid-epoch at a preemption was restored. Returns False if no iterator is known.
    """
    iterator = getattr(current, "iterator", None)
    iterator = iterator() if iterator is not None else None
    if iterator is None:
        return False
    iterator._kr_resume = (int(epoch), int(step))
    return True


def _consume(iterator, batches: int) -> bool:
    """Takes `batches` batches from a distributed iterator; False once it ran out."""
    try:
        for _ in range(batches):
            next(iterator)
    except (StopIteration, tf.errors.OutOfRangeError):
        return False
    return True


def _fast_forward(self, original, epoch: int, step: int):
    """The first epoch's batches after `step` steps of `epoch`, as an uninterrupted fit.

    Without ``steps_per_epoch`` each epoch starts a new pass over the data, so only
    `step` steps' batches are skipped; with it Keras carries its iterator over from
    epoch to epoch, so the epochs before `epoch` are replayed too (their batches
    taken and dropped, Keras's own bookkeeping run). Deterministic input (no
    reshuffling, or seeded) gives the batches the uninterrupted run had.
    """
    for _ in range(epoch if self.steps_per_epoch else 0):
        for _, _, it in original(self):
            if not _consume(it, self.steps_per_execution):
                self._current_iterator = None
                break
    for begin, end, it in original(self):
        if begin < step:
            if not _consume(it, self.steps_per_execution):
                self._current_iterator = None
                return
            continue
        yield begin, end, it


def resume_from_mid_epoch(original):
    """`TFEpochIterator._enumerate_iterator` fast-forwards once after a mid-epoch restore.

    Why: Keras 3.15's `BackupAndRestore` restarts the interrupted epoch from its
    first batch; after a preemption backup written mid-epoch, the steps already
    done would be done twice. Acts only on an iterator `resume_current_fit_at` marked.
    """

    def _enumerate_iterator(self):
        resume = self.__dict__.pop("_kr_resume", None)
        if resume is None:
            return original(self)
        return _fast_forward(self, original, *resume)

    return _enumerate_iterator
