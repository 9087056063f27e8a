"""Resuming from a backup at the same example, on the same shape or another one.

A backup written during `fit` (``keras.callbacks.BackupAndRestore``, and the mid-epoch
one of a preemption) records, besides the epoch and the step within it, where the data
stood (`data_state`):

* **the epoch order.** tf.data's ``shuffle(seed=s)`` reshuffles every epoch by drawing
  new seeds from a generator seeded by ``s``, once per iterator made of the dataset, so
  epoch ``e`` reads the order of the n-th draw, n the iterators made before it (in
  Keras 3.15 `fit`: one for the model's build, then two per epoch). The backup keeps
  n; after a restart, throwaway iterators of each shuffle (`advance_shuffles`) bring its
  generator there before the first epoch's iterator is made, so every epoch reads the
  uninterrupted run's order. Nothing of a shuffle buffer is saved: one costs about 1 ms;
* **the global batch, the replicas, the workers and the input pipelines.** A global
  batch ``t`` is the same examples on any number of replicas when the position is
  global (`InputPosition.global_order`: one input pipeline, or data sharding), so a
  run resumed on another shape skips the same ``step`` global batches and every
  example is still read once per epoch. `plan` checks the new shape against them.

Used by `keras_replicator._compat.keras_checkpointing` (which reads and writes the
backup's files) and `keras_replicator.data` (which records each distributed dataset's
`InputPosition` and pipelines).

Example:
    ```python
    train = strategy.distribute_dataset(dataset, global_batch_size=64)
    kr.resume.input_position(train)  # InputPosition(global_batch=64, input_pipelines=1, global_order=True)
    ```
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence

import tensorflow as tf

from keras_replicator._compat import tf_data
from keras_replicator._validation import check_int
from keras_replicator.errors import ResumeError

__all__ = ["InputPosition", "Resumption", "advance_shuffles", "data_state", "input_position", "plan"]


@dataclasses.dataclass(frozen=True)
class InputPosition:
    """What a backup needs to know of a distributed dataset to resume at the same example.

    Example:
        ```python
        position = kr.resume.InputPosition(global_batch=64, input_pipelines=2, global_order=True)
        ```
    """

    #: Examples per step over all replicas (None: not known).
    global_batch: int | None
    #: Input pipelines (one per worker).
    input_pipelines: int
    #: Whether global batch ``t`` is the same examples whatever the number of pipelines:
    #: one pipeline, or data sharding (every pipeline reads all the data and keeps its
    #: slices). Not so with per-worker input: file sharding, an ``input_fn``'s own shards.
    global_order: bool


# The distributed datasets keras_replicator.data made: their position, their workers' datasets.
_pipelines: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _found(distributed_dataset):
    try:
        return _pipelines.get(distributed_dataset)
    except TypeError:  # not weakly referenceable: not one of ours
        return None


def record_pipelines(distributed_dataset, position: InputPosition, datasets: Sequence[tf.data.Dataset]) -> None:
    """Called by `keras_replicator.data` for each distributed dataset it makes.

    Example:
        ```python
        train = strategy.distribute_dataset(dataset, global_batch_size=64)  # records it
        kr.resume.input_position(train).input_pipelines  # 1
        ```
    """
    _pipelines[distributed_dataset] = (position, tuple(datasets))


def input_position(distributed_dataset) -> InputPosition | None:
    """The `InputPosition` of a distributed dataset `keras_replicator.data` made (else None).

    Example:
        ```python
        train = strategy.distribute_dataset(dataset, global_batch_size=64)
        kr.resume.input_position(train).global_batch  # 64
        ```
    """
    found = _found(distributed_dataset)
    return None if found is None else found[0]


def advance_shuffles(distributed_dataset, draws: int) -> int | None:
    """Moves every reshuffling ``shuffle`` of its pipelines ``draws`` epoch orders ahead.

    Makes ``draws`` iterators of each reshuffling ``shuffle`` this process's pipelines
    read from and drops them (no element is read). Returns how many shuffles it
    advanced (0: the pipelines hold none); None, and nothing done, for a dataset
    `keras_replicator.data` did not make.

    Example:
        ```python
        ds = tf.data.Dataset.range(8).shuffle(8, seed=7)
        train = strategy.distribute_dataset(ds, global_batch_size=4)
        kr.resume.advance_shuffles(train, 2)   # 1 shuffle: the next iterator reads a third epoch's order
        ```
    """
    found = _found(distributed_dataset)
    if found is None:
        return None
    check_int("draws", draws, minimum=0)
    # The shuffles themselves: an iterator of one draws from the generator the whole pipeline's
    # iterators draw from, and costs about 1 ms (one of the whole pipeline: tens of ms).
    shuffles = {id(s): s for dataset in found[1] for s in tf_data.reshuffling_shuffles(dataset)}
    for shuffle in shuffles.values():
        for _ in range(draws):
            iter(shuffle)
    return len(shuffles)


def data_state(epoch_draw: int | None, position: InputPosition | None, replicas: int, workers: int) -> dict:
    """The JSON-ready record of where the data stands, written with a backup.

    Example:
        ```python
        kr.resume.data_state(3, kr.resume.InputPosition(64, 2, True), replicas=4, workers=2)
        # {'epoch_draw': 3, 'replicas': 4, 'workers': 2, 'global_batch': 64,
        #  'input_pipelines': 2, 'global_order': True}
        ```
    """
    state = {"epoch_draw": epoch_draw, "replicas": int(replicas), "workers": int(workers)}
    if position is not None:
        state.update(dataclasses.asdict(position))
    return state


@dataclasses.dataclass(frozen=True)
class Resumption:
    """Where a restored run starts: `step` global batches into its epoch, at iterator `epoch_draw`.

    Example:
        ```python
        kr.resume.Resumption(step=5, epoch_draw=3).inexact  # None: exactly the uninterrupted run's examples
        ```
    """

    step: int
    epoch_draw: int | None
    #: Why the rest of the interrupted epoch is not exactly the uninterrupted run's (None: it is).
    inexact: str | None = None


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _indivisible(batch: int, replicas: int, saved_replicas) -> ResumeError:
    lower, upper = (batch // replicas) * replicas, (batch // replicas + 1) * replicas
    multiples = f"{lower} or {upper}" if lower else str(upper)
    return ResumeError(
        f"The backup was written on {saved_replicas} replicas with a global batch of {batch}; this run has "
        f"{replicas} replicas, which cannot share {batch} examples per step equally (the global batch is kept "
        f"when the replicas change: {batch}/{replicas} per replica). Choices: resume on a number of replicas that "
        f"divides {batch} ({_divisors(batch)}); or change the global batch to a multiple of {replicas} "
        f"({multiples}); or keep the effective batch with gradient accumulation, a smaller global batch per "
        f"step that {replicas} divides and kr.optimizers.CrossReplicaOptimizer(optimizer, "
        "accumulation_steps=k) with k x (global batch) the effective batch."
    )


def plan(saved: dict | None, step: int, *, replicas: int, workers: int, position: InputPosition | None) -> Resumption:
    """Checks this run's shape against a backup's `data_state`; where to resume in the epoch.

    Raises `ResumeError` (before any step) when the replicas changed and do not divide
    the global batch, or when the backup stopped ``step`` batches into an epoch and this
    run's global batch cannot start a step at that example.

    Example:
        ```python
        saved = kr.resume.data_state(3, kr.resume.InputPosition(64, 2, True), replicas=4, workers=2)
        here = kr.resume.InputPosition(global_batch=64, input_pipelines=1, global_order=True)
        kr.resume.plan(saved, 5, replicas=2, workers=1, position=here)
        # Resumption(step=5, epoch_draw=3, inexact=None)
        ```
    """
    saved = saved or {}
    batch = position.global_batch if position is not None else None
    saved_batch = saved.get("global_batch") or batch
    saved_replicas = saved.get("replicas", replicas)
    if saved_replicas != replicas and batch is not None and batch % replicas:
        raise _indivisible(batch, replicas, saved_replicas)
    if step and batch is not None and saved_batch != batch:
        examples = step * saved_batch
        if examples % batch:
            raise ResumeError(
                f"The backup stopped {step} steps of {saved_batch} examples ({examples} examples) into its "
                f"epoch; this run's global batch of {batch} cannot start a step there. Resume with a "
                f"global batch that divides {examples} (the backup's is {saved_batch}), or from an epoch's end."
            )
        step = examples // batch
    inexact = None
    saved_pipelines = saved.get("input_pipelines")
    if (step and position is not None and saved_pipelines is not None and saved_pipelines != position.input_pipelines
            and not (saved.get("global_order") and position.global_order)):
        inexact = (
            f"the backup's input was read per worker by {saved_pipelines} pipelines (file sharding, or an "
            f"input_fn's own shards) and this run's by {position.input_pipelines}: the rest of the interrupted "
            f"epoch skips {step} steps of each new pipeline, so some of its examples are read twice and others "
            "not at all (the next epochs are whole). Data sharding (shard_policy='data') keeps a global "
            "position on any number of workers."
        )
    return Resumption(step=step, epoch_draw=saved.get("epoch_draw"), inexact=inexact)
