"""The unsharded checkpoint format: a sharded model's variables and optimizer slots seen whole.

A variable a layout splits is k shard variables (`ShardedVariable`), each perhaps
also split over the replicas (`fsdp.ReplicaShardedVariable`); Keras's optimizer
makes its slots (AdamW's m and v) per shard, so its variable list has k slots
where the same model on one device has one. A checkpoint keeps the one-device
format: `whole_views` lists each sharded variable once, and each group of its
shards' slots as one whole view (a `ShardedVariable` over the slots, with the
variable's split), at the place of shard 0's, so the list has the one-device
optimizer's length and order. A view's `numpy()` is the whole tensor and its
`assign(whole)` gives each shard (and each replica's copy) its slice of the
mesh it is on: a checkpoint written on one mesh loads on any other.

`_compat/sharded_checkpoints.py` shows these lists to Keras's optimizer saving
(`.keras`, `.weights.h5`, `ModelCheckpoint`, `BackupAndRestore`) and to
`tf.train.Checkpoint`.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from keras_replicator.model_parallel.fsdp import ReplicaShardedVariable
from keras_replicator.model_parallel.sharded_variable import ShardedVariable
from keras_replicator.model_parallel.sharding import owner

__all__ = ["INCOMPLETE", "record_slot", "slot_reference", "whole_views"]

# id(slot) -> (weak reference to it, weak reference to the shard it was made for).
_references: dict[int, tuple[weakref.ref, weakref.ref]] = {}

INCOMPLETE = object()
"""In `whole_views`' result: a group of slots some of whose shards have none yet (being built)."""


def record_slot(slot, reference) -> None:
    """Records that the optimizer made `slot` for `reference` (a shard, or any variable)."""
    if owner(reference) is not None:
        _references[id(slot)] = (weakref.ref(slot), weakref.ref(reference))


def slot_reference(slot):
    """The shard the optimizer made `slot` for (`record_slot`), else `None`."""
    entry = _references.get(id(slot))
    if entry is None or entry[0]() is not slot:
        return None
    return entry[1]()


def _slot_view(whole: ShardedVariable, slots: list):
    """The k `slots` of `whole`'s shards as one variable split as `whole` is."""
    path = slots[0].path.replace("_shard0", "", 1)
    if isinstance(whole, ReplicaShardedVariable):
        return ReplicaShardedVariable(slots, whole.axis, whole.data_axis, path, whole.placement)
    return ShardedVariable(slots, whole.axis, path, whole.placement)


def whole_views(variables: Sequence, cache: dict) -> list:
    """`variables` with each sharded variable's shards, and each group of slots of its shards,
    replaced by one whole view at the place of shard 0's (or `INCOMPLETE`).

    `variables` is a model's or an optimizer's list (Keras variables, `None`s kept);
    `cache` keeps one view per group of slots across calls (a checkpoint binds to it).
    The n-th slot of shard j groups with the n-th slot of every other shard of the
    same variable: an optimizer makes each variable's slots in the same order.
    """
    out, groups, counts = [], {}, {}
    for variable in variables:
        owned = owner(variable) if variable is not None else None
        if owned is not None:  # a model variable's shard: the whole variable, once
            if owned[1] == 0:
                out.append(owned[0])
            continue
        reference = slot_reference(variable) if variable is not None else None
        owned = owner(reference) if reference is not None else None
        if owned is None:
            out.append(variable)
            continue
        whole, j = owned
        n = counts[id(whole), j] = counts.get((id(whole), j), -1) + 1
        group = groups.setdefault((id(whole), n), (whole, [None] * len(whole.shards)))
        group[1][j] = variable
        if j == 0:
            out.append(group)
    return [_resolve(item, cache) if isinstance(item, tuple) else item for item in out]


def _resolve(group: tuple, cache: dict):
    whole, slots = group
    if any(slot is None for slot in slots):
        return INCOMPLETE
    key = tuple(id(slot) for slot in slots)
    view = cache.get(key)
    if view is None or any(a is not b for a, b in zip(view.shards, slots)):
        view = cache[key] = _slot_view(whole, slots)
    return view
