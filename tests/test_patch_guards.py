"""Every guarded patch refuses when what it relies on changes (`_compat.patching` guards).

Each test replaces what a guard protects by a modified copy (Keras's function
recompiled from its source with one change), and sees the patch refuse, naming the
patch, the symbol and the versions, before anything is patched.
"""

from __future__ import annotations

import inspect
import textwrap

import keras
import pytest
import tensorflow as tf
from keras.src.backend.tensorflow import random as tf_random
from keras.src.backend.tensorflow import trainer as tf_trainer
from keras.src.backend.tensorflow.optimizer import TFOptimizer
from keras.src.layers import layer as keras_layer
from keras.src.random import seed_generator
from keras.src.trainers import compile_utils, epoch_iterator

import keras_replicator as kr
from keras_replicator import versions
from keras_replicator._compat import (
    effects_before_fetch,
    exhausted_step,
    keras_batch_norm,
    keras_fsdp,
    keras_losses,
    keras_optimizer,
    keras_seed_generator,
    keras_sharded_optimizer,
    keras_trainer,
    keras_xla,
    patching,
    short_batches,
)

pytestmark = [pytest.mark.devices(1), pytest.mark.core]


def modified(function, old: str, new: str):
    """`function` recompiled from its source with `old` replaced by `new` (every occurrence)."""
    source = textwrap.dedent(inspect.getsource(function))
    assert old in source, f"{function.__qualname__} no longer holds {old!r}"
    namespace = dict(function.__globals__)
    exec(compile(source.replace(old, new), f"<modified {function.__qualname__}>", "exec"), namespace)
    return namespace[function.__name__]


def _patch(patches, owner, name) -> patching.ScopedPatch:
    (patch,) = [p for p in patches if p.owner is owner and p.name == name]
    return patch


def _refused(patch: patching.ScopedPatch, *words: str) -> None:
    with pytest.raises(versions.IncompatiblePatchError) as error:
        patch.check()
    message = str(error.value)
    for word in (patch.name, f"keras {keras.__version__}", *words):
        assert word in message, message


def test_every_guard_passes_on_the_installed_versions():
    guarded = [p for p in _every_patch() if p.guards]
    assert len(guarded) >= 7
    for patch in guarded:
        assert patch.check()


def _every_patch():
    from keras_replicator import _compat

    sets = [*_compat.installed_patches(), _compat._strategy_scope(), _compat.keras_api_patches()]
    return [patch for patches in sets for patch in patches.patches]


def test_keras_xla_refuses_a_changed_keras_train_step(monkeypatch):
    patch = _patch(keras_xla.PATCHES, tf_trainer.TensorFlowTrainer, "_make_function")
    changed = modified(tf_trainer.TensorFlowTrainer.train_step, "training=True", "training=False")
    monkeypatch.setattr(tf_trainer.TensorFlowTrainer, "train_step", changed)
    _refused(patch, "TensorFlowTrainer.train_step", "source")


@pytest.fixture
def update_step_without_the_all_reduce(monkeypatch):
    changed = modified(TFOptimizer._backend_update_step,
                       "self._all_reduce_sum_gradients(grads_and_vars)", "grads_and_vars")
    monkeypatch.setattr(TFOptimizer, "_backend_update_step", changed)


def test_fsdp_and_sharded_state_refuse_an_update_step_that_skips_the_all_reduce(
        update_step_without_the_all_reduce):
    _refused(_patch(keras_fsdp.PATCHES, TFOptimizer, "_all_reduce_sum_gradients"),
             "no longer calls _all_reduce_sum_gradients")
    _refused(_patch(keras_sharded_optimizer.PATCHES, TFOptimizer, "_backend_update_step"),
             "no longer calls _all_reduce_sum_gradients")


def test_cross_replica_optimizer_refuses_an_update_step_that_skips_the_all_reduce(
        update_step_without_the_all_reduce):
    with pytest.raises(versions.IncompatiblePatchError, match="CrossReplicaOptimizer"):
        keras_optimizer.skip_optimizer_gradient_all_reduce(keras.optimizers.SGD())


def test_sharded_state_refuses_an_apply_that_bypasses_the_update_step(monkeypatch):
    changed = modified(TFOptimizer._backend_apply_gradients, "_backend_update_step", "_update_step")
    monkeypatch.setattr(TFOptimizer, "_backend_apply_gradients", changed)
    _refused(_patch(keras_sharded_optimizer.PATCHES, TFOptimizer, "_backend_update_step"),
             "_backend_apply_gradients")


def test_exhausted_step_refuses_a_strict_inlined_step(monkeypatch):
    """A TensorFlow whose inlined step no longer runs its input-free ops on an exhausted
    iterator (the probe's step made strict, `_noinline`) is refused by both modules."""
    assert exhausted_step._inlined_step_runs_input_free_effects() is None
    monkeypatch.setattr(exhausted_step, "_PROBE_STEP_ATTRIBUTES", {"_noinline": True})
    _refused(exhausted_step.PATCHES[0], "exhausted iterator", "input-free")
    with pytest.raises(versions.IncompatiblePatchError, match="effects_before_fetch"):
        effects_before_fetch.replica_calls(None, [], [], lambda t: True)


def test_mid_epoch_resume_refuses_an_epoch_iterator_that_makes_iterators_elsewhere(monkeypatch):
    changed = modified(epoch_iterator.EpochIterator._enumerate_iterator, "self._get_iterator()",
                       "self.data_adapter.get_tf_dataset()")
    monkeypatch.setattr(epoch_iterator.EpochIterator, "_enumerate_iterator", changed)
    _refused(_patch(keras_trainer.PATCHES, tf_trainer.TFEpochIterator, "_enumerate_iterator"),
             "_get_iterator")


def test_mid_epoch_resume_refuses_when_the_shuffles_are_not_found():
    """tf.data renaming its shuffle dataset: the shuffles a resume advances would go unfound."""
    shuffle_class = type(tf.data.Dataset.range(1).shuffle(1))
    name = shuffle_class.__name__
    shuffle_class.__name__ = "_ShuffleDatasetV4"  # (monkeypatch cannot undo it on this type)
    try:
        _refused(_patch(keras_trainer.PATCHES, tf_trainer.TFEpochIterator, "_enumerate_iterator"),
                 "shows 0")
    finally:
        shuffle_class.__name__ = name


def test_resume_reports_how_many_shuffles_it_advanced():
    strategy = kr.ReplicatorStrategy()
    ds = tf.data.Dataset.range(8).shuffle(8, seed=7)
    assert kr.resume.advance_shuffles(strategy.distribute_dataset(ds, global_batch_size=4), 2) == 1
    plain = tf.data.Dataset.range(8)
    assert kr.resume.advance_shuffles(strategy.distribute_dataset(plain, global_batch_size=4), 2) == 0
    stock = tf.distribute.OneDeviceStrategy("/cpu:0")
    assert kr.resume.advance_shuffles(stock.experimental_distribute_dataset(ds.batch(4)), 2) is None


def test_batch_norm_refuses_a_build_that_makes_its_statistics_otherwise(monkeypatch):
    changed = modified(keras.layers.BatchNormalization.build, "self.add_weight(", "self.add_variable(")
    monkeypatch.setattr(keras.layers.BatchNormalization, "build", changed)
    _refused(keras_batch_norm.PATCH, "BatchNormalization.build", "add_weight")


def test_batch_norm_row_weights_refuse_a_call_that_updates_its_statistics_otherwise(monkeypatch):
    changed = modified(keras.layers.BatchNormalization.call, ".assign(", ".assign_value(")
    monkeypatch.setattr(keras.layers.BatchNormalization, "call", changed)
    _refused(keras_batch_norm.ROW_WEIGHTED_ASSIGN, "BatchNormalization.call", "assign")


def test_short_batches_refuse_compile_metrics_that_loop_otherwise(monkeypatch):
    changed = modified(compile_utils.CompileMetrics.update_state, "self._flat_weighted_metrics", "self._weighted")
    monkeypatch.setattr(compile_utils.CompileMetrics, "update_state", changed)
    (patch,) = [p for p in short_batches.PATCHES if p.owner is compile_utils.CompileMetrics]
    _refused(patch, "CompileMetrics.update_state", "_flat_weighted_metrics")


def test_seed_generator_refuses_draws_that_bypass_next(monkeypatch):
    changed = modified(seed_generator.draw_seed, ".next(", ".draw(")
    monkeypatch.setattr(seed_generator, "draw_seed", changed)
    _refused(keras_seed_generator.PATCH, "draw_seed", "SeedGenerator.next")


def test_seed_generator_refuses_a_dropout_that_does_not_draw_its_seed(monkeypatch):
    changed = modified(tf_random.dropout, "draw_seed(seed)", "seed")
    monkeypatch.setattr(tf_random, "dropout", changed)
    _refused(keras_seed_generator.PATCH, "random.dropout", "draw_seed")


def _layer_call_with(old: str, new: str):
    """`Layer.__call__` recompiled with `old` replaced by `new` (its `super()` made explicit)."""
    source = textwrap.dedent(inspect.getsource(inspect.unwrap(keras_layer.Layer.__call__)))
    assert old in source
    source = source.replace("super()", "super(Layer, self)").replace(old, new)
    namespace = dict(keras_layer.__dict__)
    exec(compile(source, "<modified Layer.__call__>", "exec"), namespace)
    return namespace["__call__"]


def test_losses_refuse_an_activity_term_neither_summed_nor_divided_by_the_batch(monkeypatch):
    patch = _patch(keras_losses.PATCHES, keras_layer.Layer, "add_loss")
    doubled = _layer_call_with("self.add_loss(", "self.add_loss(2.0 * ")
    without_add_loss = _layer_call_with("self.add_loss(", "self._losses.append(")
    monkeypatch.setattr(keras_layer.Layer, "__call__", doubled)
    keras_losses.activity_divided_by_batch.cache_clear()
    try:
        with pytest.raises(versions.IncompatiblePatchError, match="neither the sum"):
            keras_losses.activity_divided_by_batch()
        monkeypatch.setattr(keras_layer.Layer, "__call__", without_add_loss)
        _refused(patch, "Layer.__call__", "no longer calls add_loss")
    finally:
        keras_losses.activity_divided_by_batch.cache_clear()


def test_a_refused_patch_set_patches_nothing():
    class Owner:
        @staticmethod
        def step():
            return "stock"

        @staticmethod
        def other():
            return "stock"

    guard = patching.calls("Owner.step (calls helper)", lambda: Owner.step, "helper")
    patches = patching.Patches([
        patching.ScopedPatch(Owner, "other", lambda original: lambda: "patched"),
        patching.ScopedPatch(Owner, "step", lambda original: lambda: "patched", guards=[guard]),
    ])
    with pytest.raises(versions.IncompatiblePatchError, match="no longer calls helper"):
        patches.install()
    assert (Owner.step(), Owner.other()) == ("stock", "stock") and not patches.applied


def test_an_optional_patch_of_an_absent_attribute_does_nothing():
    class Owner:
        pass

    patch = patching.ScopedPatch(Owner, "absent", lambda original: 1, optional=True)
    patch.apply()
    assert not hasattr(Owner, "absent") and not patch.applied
    required = patching.ScopedPatch(Owner, "absent", lambda original: 1)
    with pytest.raises(versions.IncompatiblePatchError, match="absent is missing"):
        required.apply()
