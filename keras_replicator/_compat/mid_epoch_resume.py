"""Resuming `fit` mid-epoch after a preemption backup: the epoch iterator fast-forwards once.

Patches `TFEpochIterator._enumerate_iterator` (keras.src.backend.tensorflow.trainer,
checked on Keras 3.15; installed with `keras_trainer`'s patches) and sets a private
attribute on the epoch iterator. Why: Keras 3.15's `BackupAndRestore` restores the
epoch only and restarts it from its first batch; after a backup written mid-epoch at a
preemption (`preemption`, `keras_checkpointing.save_mid_epoch`) the steps already done
would be done twice. `keras_trainer` records the running `fit`'s epoch iterator
(`current`); `BackupAndRestore.on_train_begin` (`keras_checkpointing`) calls
`resume_current_fit_at` with the restored epoch and step.

It also counts the iterators the epoch iterator makes of its dataset (an instance
attribute wrapping `_get_iterator`, private): each one draws the next seeds of every
reshuffling `Dataset.shuffle` in the pipeline (tf.data's seed generator, one draw per
iterator: `shuffle(seed=s)` orders its n-th iterator by the generator's n-th draw), so
the count when an epoch's iterator is made says which order that epoch reads. A backup
records it (`epoch_draw`); after a restart the first epoch's iterator is preceded by
throwaway iterators up to that count (`keras_replicator.resume.advance_shuffles`), so
that epoch e reads the uninterrupted run's order for epoch e, on any number of replicas.
Only our strategies' epoch iterators are counted, through a weak reference (a reference
cycle kept stock iterators alive until the collector's late drop, which joined their aged
tf.data autotuning threads: docs/design.md, "Mixing stock and ours").
"""

from __future__ import annotations

import threading
import weakref

import tensorflow as tf
from keras.src.trainers import epoch_iterator

from keras_replicator._compat import patching, tf_data
from keras_replicator._compat.patching import ours

# The training epoch iterator of the `fit` running in this thread: the last one made
# before the callbacks' on_train_begin (fit makes it first; evaluate's come later).
current = threading.local()


def fit_iterator():
    """A weak reference to the running `fit`'s epoch iterator: call from `on_train_begin`
    (later, `evaluate` and `fit`'s validation make iterators of their own). None: none known."""
    return getattr(current, "iterator", None)


def _epoch_iterator(reference=None):
    reference = reference if reference is not None else fit_iterator()
    return reference() if reference is not None else None


def epoch_draw(mid_epoch: bool, reference=None) -> int | None:
    """The iterator count (see the module's docstring) at which a resumed epoch must start.

    ``mid_epoch``: the running epoch's own (a backup that resumes inside it), else the
    next epoch's (a backup written at an epoch's end). ``reference``: `fit_iterator()`'s,
    kept from ``on_train_begin``. None: no `fit` known here.
    """
    iterator = _epoch_iterator(reference)
    if iterator is None:
        return None
    _count_iterators(iterator)
    return iterator.__dict__.get("_kr_epoch_draw", 0) if mid_epoch else iterator._kr_made


def distributed_dataset(reference=None):
    """The distributed dataset the `fit` of ``reference`` (default: the running one) trains on."""
    iterator = _epoch_iterator(reference)
    return None if iterator is None else getattr(iterator, "_distributed_dataset", None)


def _count_iterators(self) -> None:
    """Wraps the epoch iterator's `_get_iterator` (once) to count the iterators it makes."""
    if "_kr_made" in self.__dict__:
        return
    self._kr_made = 0
    # A weak reference and the class's function, not `self` and its bound method: the
    # instance attribute would otherwise make the epoch iterator a reference cycle, kept
    # (with its dataset iterator) until the cyclic collector runs; a stock strategy's
    # iterator then ages its tf.data autotuning threads, and the late drop joins them
    # (docs/design.md, "The stall at every epoch"): minutes at the process's exit.
    reference = weakref.ref(self)
    get_iterator = type(self)._get_iterator

    def counted_get_iterator():
        iterator = reference()
        iterator._kr_made += 1
        return get_iterator(iterator)

    self._get_iterator = counted_get_iterator


def _advance_to(self, draw: int | None) -> None:
    """Throwaway iterators until the next one is the `draw`-th (epoch orders as uninterrupted)."""
    if draw is None or self.steps_per_epoch:  # with steps_per_epoch the epochs are replayed
        return
    missing = int(draw) - self._kr_made
    if missing <= 0:
        return
    from keras_replicator import resume  # here: it imports _compat modules

    if resume.advance_shuffles(self._distributed_dataset, missing) is None:
        for _ in range(missing):  # a dataset keras_replicator did not build: Keras's own iterators
            iter(self._distributed_dataset)
    self._kr_made = int(draw)


def resume_current_fit_at(epoch: int, step: int, draw: int | None = None) -> bool:
    """Makes the running `fit` skip the data of `epoch`'s first `step` steps (and of the
    epochs before it when batches carry over between epochs, with ``steps_per_epoch``).

    Called from `BackupAndRestore.on_train_begin` (keras_checkpointing) after a backup
    was restored. ``draw``: the iterator count the backup recorded for `epoch`
    (`epoch_draw`); reshuffling pipelines then read that epoch's order. Returns False
    if no iterator is known.
    """
    iterator = _epoch_iterator()
    if iterator is None:
        return False
    iterator._kr_resume = (int(epoch), int(step), None if draw is None else int(draw))
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
    # Keras's items: (step, iterator) on Keras 3.8-3.10, (begin, end, iterator) on 3.11+.
    for _ in range(epoch if self.steps_per_epoch else 0):
        for *_, it in original(self):
            if not _consume(it, self.steps_per_execution):
                self._current_iterator = None
                break
    for item in original(self):
        begin, it = item[0], item[-1]
        if begin < step:
            if not _consume(it, self.steps_per_execution):
                self._current_iterator = None
                return
            continue
        yield item


def resume_from_mid_epoch(original):
    """`TFEpochIterator._enumerate_iterator` fast-forwards once after a mid-epoch restore.

    Why: Keras 3.15's `BackupAndRestore` restarts the interrupted epoch from its
    first batch; after a preemption backup written mid-epoch, the steps already
    done would be done twice. Acts only on an iterator `resume_current_fit_at` marked.
    """

    def _enumerate_iterator(self):
        if not ours(getattr(self, "_distribute_strategy", None)):  # stock strategies: Keras's own
            return original(self)
        _count_iterators(self)
        pending = self.__dict__.pop("_kr_resume", None)
        if pending is not None:
            _advance_to(self, pending[2])
        # The count at which this epoch's iterator is made (if it makes one: not when
        # steps_per_epoch carries an iterator over, then the epochs are replayed).
        self._kr_epoch_draw = self._kr_made
        if pending is None or not pending[1] and not self.steps_per_epoch:
            return original(self)
        return _fast_forward(self, original, *pending[:2])

    return _enumerate_iterator


def _finds_a_reshuffling_shuffle() -> str | None:
    """The shuffles `advance_shuffles` advances are found (by class name) in a pipeline holding one."""
    found = tf_data.reshuffling_shuffles(tf.data.Dataset.range(8).shuffle(8, seed=1).map(lambda x: x).batch(2))
    if len(found) == 1:
        return None
    return (f"a pipeline with one reshuffling shuffle shows {len(found)} (tf_data.reshuffling_shuffles "
            "finds them by class name): a resumed epoch would read another order")


def _shuffle_class_name() -> str:
    return type(tf.data.Dataset.range(1).shuffle(1)).__name__


# What counting iterators as shuffle draws relies on: each epoch's iterator is made by
# `_get_iterator` (counted), and the shuffles to advance are found.
GUARDS = (
    patching.calls("keras EpochIterator._enumerate_iterator (calls self._get_iterator)",
                   lambda: epoch_iterator.EpochIterator._enumerate_iterator, "_get_iterator"),
    patching.behaves("tensorflow's reshuffling Dataset.shuffle (found by its class name)",
                     _finds_a_reshuffling_shuffle, key=_shuffle_class_name),
)
