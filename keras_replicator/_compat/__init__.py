"""Every use of private TensorFlow and Keras APIs in keras_replicator, one module per thing.

Nothing outside this package imports `tensorflow.python`, `keras.src` or reads a
private attribute of a TensorFlow or Keras object. A TensorFlow or Keras upgrade
is checked here: `tests/test_structure.py` fails, naming the module, when an
installed version is outside the range a module was checked on. "Checked on" is
the range the core subset of the suite ran on (`make test-versions`,
`keras_replicator.versions.PAIRS`; the full suite on the newest pair), and each
patch's guards check what it patches on whatever is installed.

| module | what it touches | how | checked on |
|---|---|---|---|
| `collective_launcher` | `CollectiveReplicaLauncher` in `CollectiveAllReduce`; that object's `_all_reduce`; its launchers' key counters | subclass swapped in, `_all_reduce` wrapped, per ops object; the counters set equal before each step | TF 2.16-2.21 |
| `coordination` | the runtime context, the coordination service, peer health | private `Context` methods | TF 2.16-2.21 |
| `engines` | `MirroredExtended`, `CollectiveAllReduceExtended` | subclasses overriding private methods | TF 2.16-2.21 |
| `distributed_values` | `PerReplica`, `Mirrored`, destination devices | constructors | TF 2.16-2.21 |
| `all_reduce_gradient` | `ReplicaContext.all_reduce` | scoped patch (strategy scope) | TF 2.16-2.21 |
| `multi_device_iterator` | per-replica input iterators (`_create_device_dataset`, `OwnedMultiDeviceIterator`, distributed datasets' `__iter__`) | installed patch, ours only: no autotuning thread to join at every epoch | TF 2.16-2.21 |
| `host_iterator` | the distributed iterator of one worker (`_SingleWorkerOwnedDatasetIterator`: how it reads, its type spec's components) | installed patch, ours only, CPU replicas of one worker: one host iterator instead of a pipeline per device | TF 2.16-2.21 |
| `tf_data` | tf.data's Python dataset objects, `_AutoShardDataset` | reads attributes | TF 2.16-2.21 |
| `keras_trainer` | Keras's TensorFlow trainer and epoch iterator (incl. skipping to a mid-epoch restore) | installed patch, ours only | Keras 3.8-3.15 |
| `keras_losses` | `TensorFlowTrainer.train_step` / `test_step` (the default steps), `Trainer._compute_loss` / `compute_loss` (the base methods), `TensorFlowTrainer._aggregate_additional_loss`, `keras.src.losses.loss.reduce_values` / `unscale_loss_for_distribution`, `Layer.add_loss` (its calls from `Layer.__call__`: activity regularizers) | installed patch, ours only: every loss term one device's value on the replica's rows, the total's gradient multiplied by the replica's share of the batch (a scalar loss function, a loss object in `add_loss`, per-sample `add_loss`, `mean_with_sample_weight`, unequal shares; an activity term a sum over the rows where Keras does not divide it by the batch, feature-detected: Keras 3.8-3.14) | Keras 3.8-3.15 |
| `keras_checkpointing` | `ModelCheckpoint`, `BackupAndRestore` (chief-only writes; each backup a new folder committed by a pointer written last, the newest whole one restored: `keras_replicator.backup_commits`; a mid-epoch backup's step; every backup's data position, checked against the new shape on restore: `keras_replicator.resume`), `Model.save` / `save_weights` (a temporary file renamed over the target: `keras_replicator.atomic_files`) | installed patch, ours only (committed backups: `AsyncReplicatorStrategy` too) | Keras 3.8-3.15 |
| `mid_epoch_resume` | `TFEpochIterator._enumerate_iterator`, `_get_iterator` (counted per instance), private marks on the epoch iterator | installed patch, ours only: the first epoch after a restore reads the uninterrupted run's order (reshuffling seeds advanced) and skips the steps already done | Keras 3.8-3.15 |
| `preemption` | the coordination service's key-value store and barriers, its SIGTERM notice key | private `Context` methods; a SIGTERM handler while `fit` runs (one process) | TF 2.16-2.21 |
| `keras_initial_epoch` | `Trainer._initial_epoch` (the epoch `fit` starts at) | read and set from a callback's `on_train_begin`, as `BackupAndRestore` does | Keras 3.8-3.15 |
| `keras_xla` | `TensorFlowTrainer._make_function`, `Trainer._resolve_auto_jit_compile`, Keras variables' `_direct_assign` | permanent patches, ours only: XLA per replica, cross-replica work outside it | Keras 3.8-3.15 |
| `keras_batch_norm` | `BatchNormalization.add_weight`, `KerasVariable.assign` (its moving statistics only) | scoped patch (strategy scope) | Keras 3.8-3.15 |
| `keras_seed_generator` | `SeedGenerator.next`: the seed of every Keras random op (dropout, `Random*` layers, noise), folded with the replica index so replicas draw independently | scoped patch (strategy scope), ours only | Keras 3.8-3.15 |
| `parameter_server` | Keras's trainer loop through a `ClusterCoordinator`, Keras variables' updates, sharded reads, random draws folded with the worker index (via `keras_seed_generator`) | implementations the trainer wrapper calls; scoped patch (atomic updates while a step is traced), installed patch (sharded reads, with a partitioner) | TF 2.16-2.21, Keras 3.8-3.15 |
| `keras_optimizer` | `TFOptimizer._all_reduce_sum_gradients`, `LossScaleOptimizer.__init__` | per-instance override; installed check | Keras 3.8-3.15 |
| `keras_sharded_optimizer` | `TFOptimizer.build`, `add_variable_from_reference`, `add_variable`, `_apply_weight_decay`, `_backend_update_step`; a mirrored variable's local copy | installed patch, ours with `shard_optimizer_state=True` only: slots on their owner replica, the owner's update, an all-gather | Keras 3.8-3.15, TF 2.16-2.21 |
| `replica_trace` | `mirrored_run` (its replica context; per-replica tracing stays the fallback), `MirroredExtended._use_merge_call` / `_get_cross_device_ops` (via `engines`), `values.apply_aggregation_replica_context`, `Graph._apply_device_functions`, `ConcreteFunction._call_flat` with swapped captures, the `_disable_acd` and `_noinline` function attributes, `context.function_call_options` (the calls' Grappler settings, via `replica_call_options`), the moving statistics' aggregation (via `deferred_statistics`) | scoped patches while the one trace runs; the engines call it for `strategy.run`: the replica step traced once, called per device | TF 2.16-2.21 |
| `tape_gradient_device` | `backprop._gradient_function` (registered with the C++ tape) | installed patch, ours with `devices_per_replica > 1` only: an op's gradient built on the op's device, not in the replica's device scope | TF 2.16-2.21 |
| `exhausted_step` | a traced step's `FuncGraph` (ops' inputs and control inputs, `control_outputs`, `_functions`), `Graph._create_op_internal`, `handle_data_util`; `TensorFlowTrainer.make_train_function` | installed patch, ours only, `steps_per_execution=1`: the train function's step traced once records its input-free side effects (a copy of those ops per replica), which run when a call finds the iterator exhausted, as one device's inlined step runs them | Keras 3.8-3.15, TF 2.16-2.21 |
| `effects_before_fetch` | a traced step's `FuncGraph` (as `exhausted_step`, and `structured_outputs`), `ConcreteFunction._call_flat`, `FuncGraph.captures`, `Operation._add_control_inputs`, the `_noinline` function attribute | when `strategy.run`'s inputs come from an iterator's fetch ops in the caller's graph (a custom loop): the step traced once split in two, its input-free side effects called per replica before the fetch (control inputs of the fetch ops), the rest with the inputs, as one device's inlined step runs them on an exhausted iterator | TF 2.16-2.21 |
| `replica_invariance` | `FuncGraph.captures`, ops' `op_def.is_stateful` | reads a traced step's graph: an `ONLY_FIRST_REPLICA` update every replica already holds is not broadcast | TF 2.16-2.21 |
| `replica_call_options` | `context.function_call_options` (its `config_proto`) while a step traced once makes its per-device calls, and while Keras calls its train or test function holding them (`TensorFlowTrainer._make_function`, stacked on `keras_xla`'s patch) | set and restored around the calls: one round of Grappler's passes, no memory optimiser on CPUs, unless the user set them; the meta optimizer off for functions `grappler_once` optimised; installed patch, ours only, CPU devices: the eager call of the function holding the calls, once its every step was traced once (`replica_trace` records it), with Grappler's pruning, common-subgraph and dependency passes alone, one round (the calls traced into its graph keep the thread's settings) | TF 2.16-2.21, Keras 3.8-3.15 |
| `deferred_statistics` | `BaseResourceVariable._read_variable_op` / `sparse_read`, `_UnreadVariable._read_variable_op`; a mirrored variable's `_get_on_device_or_primary` | scoped patches while the one trace runs: mean-aggregated moving statistics (Keras's `assign`, via `keras_batch_norm`) written locally, all-reduced in one packed collective at the step's end or before a later read; a read in a nested graph retraces without deferring | TF 2.16-2.21 |
| `reduce_between_calls` | `MirroredExtended._replica_ctx_all_reduce` (wrapped by `engines` while tracing once), a `ConcreteFunction`'s graph (ops' inputs and control inputs, `structured_outputs`, `_functions`) and `_call_flat` | no patch: an all-reduce of 1 MB or more in the one trace's own graph is a cut; on one machine's CPUs the trace is copied into stages (ops copied as `exhausted_step` copies them) and the caller reduces each cut between them with the engine's cross-device ops | TF 2.16-2.21 |
| `grappler_once` | `tf_optimizer.OptimizeGraph` on a virtual cluster (`grappler.cluster.Cluster(devices=...)`), `importer.import_graph_def`, a `ConcreteFunction`'s graph (`inputs`, `outputs`, `control_outputs`), the `_noinline` and `_disable_acd` function attributes | no patch: on one machine's CPUs the function every replica calls (the trace, or each of its stages) optimised by Grappler once, offline, with the calls' settings; its calls made with the meta optimizer off (via `replica_call_options`) | TF 2.16-2.21 |
| `keras_remat` | the TensorFlow backend's `remat` (`keras.remat`, `keras.RematScope`); `AutocastScope`, `get_autocast_scope` (a variable's stored value; the forward's autocast for the recomputation) | installed patch (Keras-API set, on `import keras_replicator`), every caller: the call's float tensors passed positionally to `tf.recompute_grad`, the rest in a closure (graph-mode custom gradients refuse keywords, keras#21207); a built layer's variables read once before the forward, forward and recomputation under `keras.StatelessScope` with those values, the forward's assignments applied once, the recomputation under the forward's autocast (a read again in the gradient could follow the optimizer's update: Grappler's dependency optimizer drops its ordering edge) | Keras 3.8-3.15, TF 2.16-2.21 |
| `keras_distribution` | `keras.distribution.set_distribution` and `distribute_tensor` (where Keras defines and binds them); `ModelParallel._layout_map` | installed patch (Keras-API set, on `import keras_replicator`): a `DataParallel` or `ModelParallel` enters the thread's scope of a `ReplicatorStrategy` over its devices or its layouts, what cannot run is an error (`keras_replicator.keras_distribution`); `distribute_tensor` (which the TensorFlow backend lacks: KerasHub's `generate`) returns its tensor in our scope | Keras 3.8-3.15 |
| `keras_layouts` | `Layer.add_weight` (the variable's path from Keras's name scope), `Dense`/`EinsumDense`/`Embedding`/`MultiHeadAttention.call` (MHA's `_compute_attention_mask`, `_compute_attention`, `_use_gate`, Keras masks), the layers' `_kernel`/`_embeddings`, `_trainable_variables`/`_non_trainable_variables` while `get_weights`, `set_weights`, `save_own_variables`, `load_own_variables`, `_check_load_own_variables` run; `TFOptimizer.add_variable_from_reference` (a shard's slots under its placement); `Trainer.compile`, `TensorFlowTrainer._maybe_symbolic_build` (the unmatched-rule check) | scoped patch (`add_weight`: strategy scope or `ModelSharding.scope()`), installed patches acting only on layers holding a `ShardedVariable`: a `LayoutMap`'s shards, the parallel layer rules, unsharded saving | Keras 3.8-3.15 |
| `keras_fsdp` | `TFOptimizer._all_reduce_sum_gradients` | installed patch, acting only on variables split over the replicas (`model_parallel.fsdp`): their gradient, already reduce-scattered by `all_gather`'s, is not summed again | Keras 3.8-3.15 |
| `sharded_checkpoints` | `TFOptimizer.save_own_variables`, `load_own_variables` (its `_variables`), `TFOptimizer._trackable_children`, `_handle_deferred_dependencies`, `TFLayer._trackable_children`; TensorFlow's `Trackable` (`_serialize_to_tensors`, `_restore_from_tensors`, `_deferred_dependencies`) | installed patch, acting only on lists and layers holding shards or their slots: Keras files and `tf.train.Checkpoint` hold each sharded variable and slot whole, at the one-device place (`model_parallel.whole_state`), restored onto any mesh by splitting | Keras 3.8-3.15, TF 2.16-2.21 |
| `keras_backports` | `keras.Variable`'s `synchronization` keyword (Keras 3.10+), the `tf.Variable` Keras creates; `data_adapters.is_tf_dataset` (a `DistributedDatasetsFromFunction` as `fit`'s input, Keras 3.9+); `Metric.add_variable` (on-read metric variables, Keras 3.10+) | feature-detected: the keyword where Keras takes it, else a `tf.variable_creator_scope` adding it (Keras 3.8, 3.9); installed patches, ours only, where Keras lacks the feature (3.8: both; 3.9: the metrics) | Keras 3.8-3.15 |
| `onednn` | `_pywrap_util_port.IsMklEnabled` | read: whether TensorFlow's oneDNN CPU kernels are on (the benchmarks record it) | TF 2.16-2.21 |
| `tf_logging` | where TensorFlow's distribution modules log from (their path) | a filter on TensorFlow's public logger: their INFO lines hidden until the user raises the verbosity | TF 2.16-2.21 |
| `short_batches` | `BaseOptimizer.scale_loss`, `LossScaleOptimizer.scale_loss`, `reduction_metrics.Mean`/`Sum.update_state`; the elements of datasets Keras's epoch iterator distributes | installed patches acting only inside a step run from a `PaddedBatch` (`ReplicatorStrategy.run`): a replica's loss weighted by its real rows, a padding replica's metric updates weigh 0 | Keras 3.8-3.15 |

One mechanism, two lifetimes (`patching`): every patch is a `patching.ScopedPatch`
object (nothing is patched when a module is imported), grouped in a
`patching.Patches` set that applies them together and restores every attribute
exactly. Scoped sets are applied while any of their scopes is entered
(re-entrant, thread-safe): the strategy-scope patches while any keras_replicator
strategy's `scope()` is entered (`strategy.run` enters it too), undone when the
outermost exits, as Sonnet's `replicator.py` scopes its patches. Installed sets
patch entry points that Keras calls outside any strategy scope (`fit`,
callbacks): `install()` applies them (idempotent; a strategy or a
`CrossReplicaOptimizer` calls it when made) and `uninstall()` undoes them. They
act only for keras_replicator's strategies (`patching.ours`) and leave others to
Keras's behaviour.

The one exception to "nothing is patched when a module is imported": the
Keras-API set (`keras_api_patches()`: `keras_remat`, `keras_distribution`) is
installed by `import keras_replicator` itself (`install_keras_api()`), because
what it patches is Keras's own public API, which fails (`keras.RematScope` in
graph mode) or is silently ignored (`keras.distribution.set_distribution`) on
TensorFlow without it, and a user calls it without making a strategy. It changes
nothing for code that does not call those functions; `uninstall_keras_api()`
undoes it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
from collections.abc import Iterator

# The versions each module was checked on, inclusive: (package, lowest, highest).
CHECKED: dict[str, tuple[str, str, str]] = {
    "collective_launcher": ("tensorflow", "2.16", "2.21"),
    "coordination": ("tensorflow", "2.16", "2.21"),
    "engines": ("tensorflow", "2.16", "2.21"),
    "distributed_values": ("tensorflow", "2.16", "2.21"),
    "all_reduce_gradient": ("tensorflow", "2.16", "2.21"),
    "multi_device_iterator": ("tensorflow", "2.16", "2.21"),
    "host_iterator": ("tensorflow", "2.16", "2.21"),
    "tf_data": ("tensorflow", "2.16", "2.21"),
    "keras_trainer": ("keras", "3.8", "3.15"),
    "keras_losses": ("keras", "3.8", "3.15"),
    "keras_checkpointing": ("keras", "3.8", "3.15"),
    "keras_xla": ("keras", "3.8", "3.15"),
    "preemption": ("tensorflow", "2.16", "2.21"),
    "mid_epoch_resume": ("keras", "3.8", "3.15"),
    "keras_batch_norm": ("keras", "3.8", "3.15"),
    "keras_seed_generator": ("keras", "3.8", "3.15"),
    "keras_initial_epoch": ("keras", "3.8", "3.15"),
    "keras_optimizer": ("keras", "3.8", "3.15"),
    "keras_sharded_optimizer": ("keras", "3.8", "3.15"),
    "parameter_server": ("keras", "3.8", "3.15"),
    "keras_layouts": ("keras", "3.8", "3.15"),
    "keras_fsdp": ("keras", "3.8", "3.15"),
    "sharded_checkpoints": ("tensorflow", "2.16", "2.21"),
    "tf_logging": ("tensorflow", "2.16", "2.21"),
    "onednn": ("tensorflow", "2.16", "2.21"),
    "keras_backports": ("keras", "3.8", "3.15"),
    "replica_trace": ("tensorflow", "2.16", "2.21"),
    "replica_invariance": ("tensorflow", "2.16", "2.21"),
    "replica_call_options": ("tensorflow", "2.16", "2.21"),
    "deferred_statistics": ("tensorflow", "2.16", "2.21"),
    "reduce_between_calls": ("tensorflow", "2.16", "2.21"),
    "grappler_once": ("tensorflow", "2.16", "2.21"),
    "keras_remat": ("keras", "3.8", "3.15"),
    "keras_distribution": ("keras", "3.8", "3.15"),
    "tape_gradient_device": ("tensorflow", "2.16", "2.21"),
    "exhausted_step": ("keras", "3.8", "3.15"),
    "effects_before_fetch": ("tensorflow", "2.16", "2.21"),
    "short_batches": ("keras", "3.8", "3.15"),
}


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _installed(package: str) -> str:
    for name in (package, f"{package}-cpu"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    module = importlib.import_module(package)
    return module.__version__


def unchecked_versions() -> list[str]:
    """One line per module whose checked range excludes the installed version."""
    problems = []
    for module, (package, low, high) in CHECKED.items():
        version = _installed(package)
        if not _minor(low) <= _minor(version) <= _minor(high):
            problems.append(
                f"keras_replicator._compat.{module} was checked on {package} {low}-{high}, "
                f"but {package} {version} is installed: re-check what it patches (its docstring "
                "says what and why), run the suite, then widen its range in _compat.CHECKED."
            )
    return problems


def installed_patches() -> list:
    """The sets of patches `install()` may install, in order (each a `patching.Patches`)."""
    return [_permanent(), _sharded_reads()]


@functools.cache
def _permanent():
    from keras_replicator._compat import (
        exhausted_step,
        host_iterator,
        keras_backports,
        keras_checkpointing,
        keras_fsdp,
        keras_layouts,
        keras_losses,
        keras_optimizer,
        keras_sharded_optimizer,
        keras_trainer,
        keras_xla,
        multi_device_iterator,
        patching,
        replica_call_options,
        sharded_checkpoints,
        short_batches,
        tape_gradient_device,
    )

    return patching.Patches([
        # Keras 3.8: fit takes a DistributedDatasetsFromFunction of ours, as Keras 3.9+.
        *keras_backports.PATCHES,
        *keras_trainer.PATCHES,
        # Every loss form Keras accepts: one device's terms, the total's gradient per replica share.
        *keras_losses.PATCHES,
        *keras_xla.PATCHES,
        # The eager call of a train or test function holding a step traced once: lean Grappler.
        *replica_call_options.PATCHES,
        *keras_checkpointing.PATCHES,
        *keras_optimizer.PATCHES,
        # Optimizer state sharded over the replicas (shard_optimizer_state=True).
        *keras_sharded_optimizer.PATCHES,
        # Per-replica input iterators without tf.data autotuning threads, whose join
        # stalled every new epoch by up to 20 s.
        *multi_device_iterator.PATCHES,
        # One host iterator for the CPU replicas of one worker: no per-device pipelines.
        *host_iterator.PATCHES,
        # A replica over several devices: each gradient built on its forward op's device.
        *tape_gradient_device.PATCHES,
        # LayoutMap shards: the parallel layer rules and the unsharded saving.
        *keras_layouts.PATCHES,
        # FSDP: gradients already reduce-scattered by all_gather's gradient are not summed again.
        *keras_fsdp.PATCHES,
        # The step traced once: what one device's step does on an exhausted iterator.
        *exhausted_step.PATCHES,
        # Sharded variables and their slots checkpointed whole (Keras files, tf.train.Checkpoint).
        *sharded_checkpoints.PATCHES,
        # Batches with fewer rows than replicas: padding rows weigh nothing.
        *short_batches.PATCHES,
    ])


@functools.cache
def _sharded_reads():
    from keras_replicator._compat import parameter_server

    return parameter_server.SHARDED_READS


def install(*, sharded_variable_reads: bool = False) -> None:
    """Installs the permanent patches (idempotent); see the table above.

    ``sharded_variable_reads`` also installs `parameter_server.SHARDED_READS`
    (for a strategy that partitions variables).
    """
    _permanent().install()
    keras_api_patches().install()
    if sharded_variable_reads:
        _sharded_reads().install()


@functools.cache
def keras_api_patches():
    """The Keras-API set: Keras's public functions that fail or are ignored on TensorFlow without it."""
    from keras_replicator._compat import keras_distribution, keras_remat, patching

    return patching.Patches([*keras_remat.PATCHES, *keras_distribution.PATCHES])


def install_keras_api() -> None:
    """Installs the Keras-API set (idempotent): `import keras_replicator` calls it.

    A Keras distribution set before the patch (before `import keras_replicator`)
    is followed now, as if it had been set after.
    """
    keras_api_patches().install()
    from keras_replicator._compat import keras_distribution

    keras_distribution.follow_current()


def uninstall_keras_api() -> None:
    """Undoes `install_keras_api()`: every attribute it patched is restored exactly (idempotent)."""
    keras_api_patches().uninstall()


def uninstall() -> None:
    """Undoes `install()`: every attribute it patched is restored exactly (idempotent)."""
    for patches in reversed(installed_patches()):
        patches.uninstall()


@functools.cache
def _strategy_scope():
    from keras_replicator._compat import (
        all_reduce_gradient,
        keras_batch_norm,
        keras_seed_generator,
        patching,
    )

    return patching.Patches([all_reduce_gradient.PATCH, keras_batch_norm.PATCH, keras_batch_norm.ROW_WEIGHTED_ASSIGN,
                             keras_seed_generator.PATCH])


@contextlib.contextmanager
def strategy_scope_patches() -> Iterator[None]:
    """The scoped patches, applied for the outermost of nested strategy scopes."""
    from keras_replicator._compat import keras_layouts

    # add_weight under a LayoutMap first, so BatchNormalization's patch wraps it.
    with keras_layouts.ADD_WEIGHT.scope(), _strategy_scope().scope():
        yield
