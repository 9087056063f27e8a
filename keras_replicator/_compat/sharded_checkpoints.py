"""Checkpoints of a sharded model in the unsharded format (`model_parallel.whole_state`).

Patches (installed; checked on Keras 3.15, TensorFlow 2.21), each acting only once a
layout made a shard (`sharding.created_any`) and only on lists holding shards or
their slots:

* `TFOptimizer.save_own_variables` / `load_own_variables` (Keras's `BaseOptimizer`,
  by position over `_variables`): while they run, `_variables` lists each group of
  a sharded variable's slots as one whole view (`whole_state.whole_views`), so a
  `.keras` / `.weights.h5` file (`model.save`, `save_weights`, `ModelCheckpoint`,
  `BackupAndRestore`) holds AdamW's m and v whole, as one device's optimizer has them,
  and loading gives each shard of the loading mesh its slice.
* `tf.train.Checkpoint`: a Keras 3 model on TensorFlow is checkpointed through its
  layers' attributes (`model/_functional/_operations/1/_kernel`) and its optimizer's
  lists (`optimizer/_variables/2`, `_trainable_variables`, `_momentums`, ...).
  `TFLayer._trackable_children` adds each `ShardedVariable` attribute as a
  `WholeVariable`, and `TFOptimizer._trackable_children` gives each list as a
  `WholeList` (the whole views at the one-device positions): TensorFlow's
  `Trackable._serialize_to_tensors` / `_restore_from_tensors` (the hooks its own
  `ShardedVariable` uses) write the whole tensor under the one-device key and restore
  it by splitting. Restore-on-create (`Checkpoint.restore` before the optimizer is
  built, Keras builds it at the first step): `TFOptimizer._handle_deferred_dependencies`
  (called when Keras assigns a slot list) restores into the `WholeList`, then restores
  the children waiting in the other `WholeList`s of that optimizer whose slots all exist
  (`restore_waiting`, called again once `fit` built the model and its optimizer:
  `_compat/keras_layouts.py`).

A checkpoint value whose shape is not the restoring variable's is a `LayoutError`
naming the variable, raised before the value is assigned.
"""

from __future__ import annotations

import weakref

import tensorflow as tf
from keras.src.backend.tensorflow.layer import TFLayer
from keras.src.backend.tensorflow.optimizer import TFOptimizer
from tensorflow.python.trackable import base as trackable_base

from keras_replicator._compat.model_parallel_hooks import mp
from keras_replicator._compat.patching import ScopedPatch
from keras_replicator.errors import LayoutError

_CHECKPOINT = trackable_base.SaveType.CHECKPOINT
# optimizer -> its slot views (`whole_views`' cache) and its WholeLists, by attribute name.
_views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lists: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class WholeVariable(trackable_base.Trackable):
    """A whole view (`ShardedVariable`, or a group of its slots) as one checkpointed variable."""

    def __init__(self, view):
        self._view = view

    def _serialize_to_tensors(self):
        with tf.device("/cpu:0"):
            return {trackable_base.VARIABLE_VALUE_KEY: tf.identity(tf.convert_to_tensor(self._view.value))}

    def _restore_from_tensors(self, restored_tensors):
        value = restored_tensors[trackable_base.VARIABLE_VALUE_KEY]
        check_shape(self._view, value.shape)
        self._view.assign(value)
        return tf.no_op()


def check_shape(view, shape) -> None:
    """Raises `LayoutError` when a checkpoint's value of `shape` does not fit `view`."""
    if tuple(shape) != tuple(view.shape):
        raise LayoutError(
            f"the checkpoint holds {view.path!r} with shape {tuple(shape)}, but this model's is "
            f"{tuple(view.shape)} (a checkpoint is whole, whatever mesh wrote it: the model differs)."
        )


def _trackable(item):
    """The checkpointed object of one of `whole_views`' items (`None`: not checkpointed)."""
    if isinstance(item, mp.ShardedVariable):
        trackable = item.__dict__.get("_kr_trackable")
        if trackable is None:
            trackable = item.__dict__["_kr_trackable"] = WholeVariable(item)
        return trackable
    return item if isinstance(item, trackable_base.Trackable) else None


def _holds_shards(items) -> bool:
    return any(mp.sharding.owner(v) is not None or mp.whole_state.slot_reference(v) is not None
               for v in items if v is not None)


class WholeList(trackable_base.Trackable):
    """An optimizer's list attribute as a checkpoint sees it: whole views in place of shards."""

    def __init__(self, optimizer, name: str):
        self._optimizer = weakref.ref(optimizer)
        self._name = name

    def _elements(self) -> list:
        optimizer = self._optimizer()
        items = list(getattr(optimizer, self._name, None) or []) if optimizer is not None else []
        return mp.whole_state.whole_views(items, _views.setdefault(optimizer, {}))

    def _trackable_children(self, save_type=_CHECKPOINT, **kwargs):
        children = {}
        for i, item in enumerate(self._elements()):
            trackable = None if item is mp.whole_state.INCOMPLETE else _trackable(item)
            if trackable is not None:
                children[str(i)] = trackable
        return children

    def _lookup_dependency(self, name, cached_dependencies=None):
        children = self._trackable_children() if cached_dependencies is None else cached_dependencies
        return children.get(name)

    def restore_waiting(self) -> None:
        """Restores the children a checkpoint deferred until they exist (those that do now)."""
        waiting = self._deferred_dependencies
        if not waiting:
            return
        children = self._trackable_children()
        for name in [n for n in waiting if n in children]:
            self._handle_deferred_dependencies(name, children[name])


def restore_waiting(optimizer) -> None:
    """Restores what a checkpoint deferred in `optimizer`'s lists and now exists (after a build)."""
    for waiting in list(_lists.get(optimizer, {}).values()) if optimizer is not None else ():
        waiting.restore_waiting()


def _whole_list(optimizer, name: str) -> WholeList:
    lists = _lists.setdefault(optimizer, {})
    if name not in lists:
        lists[name] = WholeList(optimizer, name)
    return lists[name]


def _optimizer_children(original):
    def _trackable_children(self, save_type=_CHECKPOINT, **kwargs):
        children = original(self, save_type, **kwargs)
        if save_type != _CHECKPOINT or not mp.sharding.created_any.is_set():
            return children
        for name, child in list(children.items()):
            # Unbuilt: its lists may get shards' slots later (restore-on-create waits in the WholeList).
            if isinstance(child, list) and (not self.built or _holds_shards(child)):
                children[name] = _whole_list(self, name)
        return children

    return _trackable_children


def _optimizer_deferred(original):
    def _handle_deferred_dependencies(self, name, trackable):
        if mp.sharding.created_any.is_set() and isinstance(trackable, list) and _holds_shards(trackable):
            trackable = _whole_list(self, name)
        original(self, name, trackable)
        # Keras assigns a slot list once its slots exist: the lists' waiting children can be restored.
        restore_waiting(self)

    return _handle_deferred_dependencies


def _layer_children(original):
    def _trackable_children(self, save_type=_CHECKPOINT, **kwargs):
        children = original(self, save_type, **kwargs)
        if save_type != _CHECKPOINT or not mp.sharding.sharded_variables(self):
            return children
        for name, value in vars(self).items():
            if isinstance(value, mp.ShardedVariable) and not name.startswith("_kr_"):
                children[name] = _trackable(value)
        return children

    return _trackable_children


def _whole_slots(original):
    def method(self, store):
        # While Keras saves or loads the optimizer by position, each group of a sharded
        # variable's slots is one whole view: the file keeps the one-device format.
        # Swapped in __dict__: an attribute assignment would also replace the optimizer's
        # TensorFlow dependency `_variables` (what tf.train.Checkpoint saves) with the views.
        before = self.__dict__["_variables"]
        if not mp.sharding.created_any.is_set() or not _holds_shards(before):
            return original(self, store)
        self.__dict__["_variables"] = mp.whole_state.whole_views(before, _views.setdefault(self, {}))
        try:
            return original(self, store)
        finally:
            self.__dict__["_variables"] = before

    return method


PATCHES = (
    ScopedPatch(TFOptimizer, "save_own_variables", _whole_slots),
    ScopedPatch(TFOptimizer, "load_own_variables", _whole_slots),
    ScopedPatch(TFOptimizer, "_trackable_children", _optimizer_children),
    ScopedPatch(TFOptimizer, "_handle_deferred_dependencies", _optimizer_deferred),
    ScopedPatch(TFLayer, "_trackable_children", _layer_children),
)
