"""The one place where keras_replicator touches private TensorFlow and Keras APIs.

Every name imported from ``tensorflow.python`` lives here, with the reason and
the versions it was checked on (TensorFlow 2.16 to 2.21, Keras 3.15). Other
modules import from here, never from ``tensorflow.python`` directly, so that a
TensorFlow upgrade is a change to one file.
"""

from __future__ import annotations

import tensorflow as tf

# MirroredExtended / CollectiveAllReduceExtended are the in-graph (one worker)
# and between-graph (many workers) replication engines behind the public
# strategies; ReplicatorStrategy reuses them instead of re-implementing replica
# threads, device placement and cross-device reductions.
from tensorflow.python.distribute import (  # noqa: F401  (re-exported)
    collective_all_reduce_strategy,
    cross_device_ops,
    cross_device_utils,
    distribute_lib,
    distribute_utils,
    mirrored_strategy,
)
from tensorflow.python.distribute import values as _values
from tensorflow.python.eager import context as _context
from tensorflow.python.eager import record as _record
from tensorflow.python.framework import ops as _ops
from tensorflow.python.ops import control_flow_util, resource_variable_ops

MirroredExtended = mirrored_strategy.MirroredExtended
CollectiveAllReduceExtended = collective_all_reduce_strategy.CollectiveAllReduceExtended
StrategyBase = distribute_lib.Strategy  # == tf.distribute.Strategy


def tensorflow_initialized() -> bool:
    """True once TensorFlow's runtime context (and so its device list) exists.

    ``tf.config.set_logical_device_configuration`` only works before this point.
    """
    return _context.context()._context_handle is not None  # TF 2.16-2.21


class _ExecutionOrderedLauncher(cross_device_utils.CollectiveReplicaLauncher):
    """A collective launcher whose instance keys follow execution, not tracing.

    Why (TF 2.16-2.21): inside TF2 functions, stock launchers feed each
    collective's instance key at call time through
    ``FuncGraph.capture_call_time_value``. That deferred capture is lost when
    the traced function is later called from a control-flow branch of an outer
    function, which Keras 3 does in two common cases: ``steps_per_execution > 1``
    (a ``tf.cond`` in a ``tf.while_loop`` around ``strategy.run``), and any step
    that creates variables on its first call (TensorFlow wraps the traced step in
    a ``tf.cond`` on "variables initialised"), e.g. a GAN's optimizers built
    lazily in ``train_step``. Both fail with "You must feed a value for
    placeholder tensor" (keras-team/keras#19246), on stock MirroredStrategy too.

    Here each launcher keeps an execution counter in a host variable and the key
    of a collective is ``base + counter.assign_add(1)``. Every replica (and every
    worker) runs the same sequence of collectives on its device, so the keys
    agree; they depend on what ran, not on when each process traced, so a worker
    that retraces alone does not fall out of step (the reason TF abandoned
    trace-time keys).
    """

    _KEY_BASE = 1 << 30  # above the keys TensorFlow hands out from Python

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        host = tf.DeviceSpec.from_string(self._device).replace(device_type="CPU", device_index=0)
        with _ops.init_scope(), _ops.device(host.to_string()):
            self._executions = resource_variable_ops.ResourceVariable(
                tf.constant(0, tf.int64), trainable=False, name="collective_executions"
            )

    def _next_instance_key(self):
        if (
            _context.executing_eagerly()
            or not self._use_unique_instance_key()
            or control_flow_util.GraphOrParentsInXlaContext(_ops.get_default_graph())
        ):
            return super()._next_instance_key()
        with _ops.device(self._executions.device):
            count = self._executions.assign_add(1, read_value=True)
            return tf.cast(self._KEY_BASE + count % self._KEY_BASE, tf.int32)


def make_control_flow_safe(ops_obj):
    """Gives a ``CollectiveAllReduce`` cross-device ops object execution-ordered keys.

    Replaces its launchers (``_launchers``, TF 2.16-2.21) in place; other cross
    device ops (reduction to one device, NCCL batch ops) need no fix.
    """
    if isinstance(ops_obj, cross_device_ops.CollectiveAllReduce):
        launchers = ops_obj._launchers
        for i, old in enumerate(launchers):
            if type(old) is cross_device_utils.CollectiveReplicaLauncher:
                launchers[i] = _ExecutionOrderedLauncher(
                    old._group_key, old._group_size, old._collective_keys, old._device, old._options
                )
    return ops_obj


def is_distributed_values(value) -> bool:
    return isinstance(value, tf.distribute.DistributedValues)


def devices_of(destinations) -> tuple[str, ...]:
    """The canonical device strings of a reduction's destinations (a device
    string, a variable, a tensor or distributed values), as TensorFlow's
    cross-device ops compute them (TF 2.16-2.21: ``get_devices_from``)."""
    return tuple(cross_device_ops.get_devices_from(destinations))


def per_replica(values: list) -> tf.distribute.DistributedValues:
    """One tensor per replica, wrapped as ``PerReplica`` (TF 2.16-2.21: ``values.PerReplica``)."""
    return _values.PerReplica(tuple(values))


def mirrored(values: list) -> tf.distribute.DistributedValues:
    """One tensor per device, wrapped as the ``Mirrored`` value a cross-device
    reduction returns (TF 2.16-2.21: ``distribute_utils.regroup``)."""
    return distribute_utils.regroup(values, wrap_class=_values.Mirrored)


# --- Keras 3 (checked on 3.15) -------------------------------------------------


def _first_replica(strategy, value):
    if isinstance(value, tf.distribute.DistributedValues):
        return strategy.experimental_local_results(value)[0]
    return value


def install_keras_patches() -> None:
    """Makes Keras 3's TensorFlow trainer work with ``ReplicatorStrategy``.

    ``TensorFlowTrainer._maybe_symbolic_build`` (Keras 3.x) builds the model from
    one distributed batch by ``strategy.reduce("MEAN", batch, axis=None)``: an
    element-wise mean of every replica's slice. That fails when the slices
    differ in size (a short last batch: "Inputs to operation AddN must have the
    same size and shape") and, across workers, on structures of PerReplica
    values (tensorflow/tensorflow#72388). The build only needs the shapes and
    dtypes of one example batch, so for our strategies we take replica 0's slice.
    Other strategies keep Keras's behaviour. Idempotent.
    """
    from keras.src.backend.tensorflow import trainer as tf_trainer

    install_keras_data_checks()  # keras_replicator.data: an infinite dataset needs a step count
    original = tf_trainer.TensorFlowTrainer._maybe_symbolic_build
    if getattr(original, "_keras_replicator_patch", False):
        return

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if iterator is None or not getattr(strategy, "_keras_replicator", False):
            return original(self, iterator=iterator, data_batch=data_batch)
        for _, _, it in iterator:
            batch = next(it)
            data_batch = tf.nest.map_structure(lambda v: _first_replica(strategy, v), batch)
            break
        with strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    _maybe_symbolic_build._keras_replicator_patch = True
    tf_trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build


def _already_reduced(grads_and_vars):
    return list(grads_and_vars)


def skip_optimizer_gradient_all_reduce(optimizer) -> None:
    """Stops a Keras optimizer (and the ones it wraps) summing gradients across replicas.

    Why (Keras 3.15, TF backend): ``TFOptimizer._backend_update_step`` calls
    ``self._all_reduce_sum_gradients`` (a replica-context all-reduce) before every
    update. ``CrossReplicaOptimizer`` reduces the gradients itself (accumulated,
    compressed, once per update) and hands the result to the wrapped optimizer,
    which must then not sum them a second time. We override that method on the
    instance with the identity; the wrapped optimizer belongs to the wrapper from
    then on. ``LossScaleOptimizer`` has no reduction of its own: we follow
    ``inner_optimizer`` down to the optimizer that does the update. If a Keras
    version renames the method, fail loudly rather than reduce twice.
    """
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    opt = optimizer
    while opt is not None:
        if isinstance(opt, TFOptimizer):
            if not callable(getattr(type(opt), "_all_reduce_sum_gradients", None)):
                raise RuntimeError(
                    "This Keras version has no TFOptimizer._all_reduce_sum_gradients; "
                    "keras_replicator's CrossReplicaOptimizer needs updating for it."
                )
            opt._all_reduce_sum_gradients = _already_reduced
        opt = getattr(opt, "inner_optimizer", None)


# --- TensorFlow replica-context all-reduce (checked on TF 2.16-2.21) ------------


def install_all_reduce_gradient_patch() -> None:
    """Makes differentiable all-reduces cheap to trace under our strategies.

    Why: ``ReplicaContext.all_reduce`` attaches its gradient (the all-reduce of
    the upstream gradient) with ``tf.custom_gradient``. In a traced function
    ``tf.custom_gradient`` walks the graph backward from the result to find the
    variables it depends on, stopping only at the function's inputs and at
    non-differentiable ops. Through an all-reduce that walk enters every other
    replica's graph and follows it back to the model's inputs, so tracing a
    model with one all-reduce per layer (Keras's ``BatchNormalization
    (synchronized=True)``, ``kr.all_reduce`` in a layer) takes time that grows
    with the square of its depth: ResNet-50 with synchronized batch norm did not
    finish its first step in 10 minutes on 4 simulated replicas.

    For our strategies, dense SUM/MEAN all-reduces reduce ``stop_gradient`` of
    the inputs (the walk stops there at once) and attach the same gradient, an
    all-reduce of the upstream gradient, one level up. Values and gradients are
    unchanged, second-order gradients included. Other strategies, and
    ``IndexedSlices``, keep TensorFlow's behaviour. Idempotent.
    """
    original = distribute_lib.ReplicaContext.all_reduce
    if getattr(original, "_keras_replicator_patch", False):
        return

    def all_reduce(self, reduce_op, value, options=None):
        flat = tf.nest.flatten(value)
        if (
            not getattr(self._strategy, "_keras_replicator", False)
            or not flat
            or not all(isinstance(v, tf.Tensor) for v in flat)
        ):
            return original(self, reduce_op, value, options)

        @tf.custom_gradient
        def reduce(*xs):
            ys = original(self, reduce_op, [tf.stop_gradient(x) for x in xs], options)
            return ys, lambda *dys: all_reduce(self, reduce_op, list(dys), options)

        return tf.nest.pack_sequence_as(value, reduce(*flat))

    all_reduce._keras_replicator_patch = True
    distribute_lib.ReplicaContext.all_reduce = all_reduce


def gradient_tape_recording() -> bool:
    """True if a ``tf.GradientTape`` is recording, e.g. while a gradient is being
    taken inside an outer tape (a gradient penalty). TF 2.16-2.21:
    ``record.could_possibly_record``; no public equivalent exists.
    """
    return _record.could_possibly_record()


# --- Multi-worker (checked on TF 2.21) ----------------------------------------


def coordination_leader(cluster_spec: tf.train.ClusterSpec) -> str:
    """The task that runs the coordination service (the chief, else worker 0)."""
    job = "chief" if "chief" in cluster_spec.jobs else "worker"
    return f"/job:{job}/replica:0/task:0"


def configure_coordination_service(
    cluster_spec: tf.train.ClusterSpec, *, heartbeat_timeout: float, startup_timeout: float
) -> bool:
    """Configures TensorFlow's coordination service with our failure timeouts.

    Why (TF 2.16-2.21): ``CollectiveAllReduceExtended._initialize_multi_worker``
    enables the coordination service with TensorFlow's defaults (no bound on the
    wait for other workers at start-up) unless one is already configured; the
    service's heartbeats are what detect a dead worker (its Python-level health
    check thread is turned off when the service is on). Configuring it first,
    through the private ``Context.configure_coordination_service``, bounds both:
    a worker silent for ``heartbeat_timeout`` seconds aborts every collective on
    the others, and a cluster not complete within ``startup_timeout`` seconds
    fails strategy creation. Returns False when a service was already configured
    (a second strategy in the process) and so keeps its settings.
    """
    try:  # TF 2.21
        from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    except ImportError:  # older layouts
        from tensorflow.tsl.protobuf import coordination_config_pb2

    ctx = _context.context()
    if ctx.coordination_service is not None:
        return False
    jobs = [
        coordination_config_pb2.CoordinatedJob(name=job, num_tasks=cluster_spec.num_tasks(job))
        for job in ("chief", "worker")
        if job in cluster_spec.jobs
    ]
    ctx.configure_coordination_service(
        service_type="standalone",
        service_leader=coordination_leader(cluster_spec),
        enable_health_check=True,
        cluster_register_timeout_in_ms=int(startup_timeout * 1000),
        heartbeat_timeout_in_ms=int(heartbeat_timeout * 1000),
        shutdown_barrier_timeout_in_ms=int(heartbeat_timeout * 1000),
        coordinated_jobs=jobs,
    )
    # Without the barrier the leader waits for the other tasks with no bound,
    # whatever cluster_register_timeout says (TF 2.21); not exposed by the method.
    config = ctx._coordination_service_config
    if "cluster_register_with_barrier" in config.DESCRIPTOR.fields_by_name:
        config.cluster_register_with_barrier = True
    return True


def unhealthy_peers(tasks, timeout: float) -> tuple[list[str], list[str]]:
    """Probes ``tasks`` ("/job:worker/replica:0/task:1", ...): (those lost, those unknown).

    Uses the private ``Context.check_collective_ops_peer_health`` (TF 2.16-2.21),
    which asks the peer's worker service whether it is the same live process:
    unreachable, restarted or silent for ``timeout`` seconds counts as lost; any
    other error leaves the peer unknown.
    """
    from tensorflow.python.framework import errors

    lost, unknown = [], []
    for task in tasks:
        try:
            _context.context().check_collective_ops_peer_health(task, timeout_in_ms=int(timeout * 1000))
        except (errors.UnavailableError, errors.FailedPreconditionError, errors.DeadlineExceededError):
            lost.append(task)
        except errors.OpError:
            unknown.append(task)
    return lost, unknown


# --- Keras 3 in multi-worker jobs (checked on Keras 3.15) ----------------------


def _multi_worker(strategy) -> bool:
    return getattr(strategy, "_keras_replicator", False) and getattr(strategy, "num_workers", 1) > 1


def _callback_strategy(callback):
    model = getattr(callback, "model", None)
    strategy = getattr(model, "_distribute_strategy", None)
    return strategy if _multi_worker(strategy) else None


def _patch_reduce_per_replica(tf_trainer) -> None:
    """Global metrics and all of predict's rows across workers.

    Why: Keras 3's ``reduce_per_replica`` (keras/src/backend/tensorflow/trainer.py)
    reduces across workers only for ``isinstance(strategy,
    MultiWorkerMirroredStrategy)``, and there with ``strategy.reduce(..., axis=0)``,
    which fails on the scalar metrics ("Invalid reduction dimension 0",
    tensorflow/tensorflow#72388). For other strategies it reduces the local
    replicas only: each worker's ``predict`` would return its own rows and
    step outputs would be per-worker means. For our multi-worker strategies:
    "concat" gathers every replica's rows with Keras's own
    ``_multi_worker_concat`` (which undoes the order in which tf.data's
    data-sharding hands rows to replicas), and "mean"/"sum" reduce over every
    replica of every worker, element-wise as Keras does on one worker.
    """
    original = tf_trainer.reduce_per_replica
    if getattr(original, "_keras_replicator_patch", False):
        return

    def reduce_per_replica(values, strategy, reduction):
        if not _multi_worker(strategy) or reduction == "first":
            return original(values, strategy, reduction)
        if reduction == "auto":
            reduction = "mean"
        if reduction not in ("mean", "sum", "concat"):
            return original(values, strategy, reduction)

        def _reduce(v):
            if not isinstance(v, (tf.Tensor, tf.distribute.DistributedValues)):
                return v
            if reduction == "concat":
                return tf_trainer._multi_worker_concat(v, strategy)
            if not isinstance(v, tf.distribute.DistributedValues):
                # One local replica: strategy.run returned this worker's plain value.
                v = strategy.experimental_distribute_values_from_function(lambda _: v)
            return strategy.reduce(reduction.upper(), v, axis=None)

        return tf.nest.map_structure(_reduce, values)

    reduce_per_replica._keras_replicator_patch = True
    tf_trainer.reduce_per_replica = reduce_per_replica


def _patch_lost_worker_errors(tf_trainer) -> None:
    """``fit``/``evaluate``/``predict`` raise ``WorkerLostError`` when a worker was lost.

    The step fails with TensorFlow's UnavailableError (or a kin) whose text is
    about collectives and heartbeats; the strategy's ``_lost_worker_error``
    probes the peers and names the lost one.
    """
    cls = tf_trainer.TensorFlowTrainer
    names = ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch")
    if getattr(cls.fit, "_keras_replicator_lost_worker_patch", False):
        return

    def wrap(method):
        def wrapper(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            except tf.errors.OpError as e:
                strategy = getattr(self, "_distribute_strategy", None)
                if _multi_worker(strategy):
                    lost = strategy._lost_worker_error(e)
                    if lost is not None:
                        raise lost from e
                raise

        wrapper.__name__, wrapper.__doc__ = method.__name__, method.__doc__
        wrapper.__wrapped__ = method
        wrapper._keras_replicator_lost_worker_patch = True
        return wrapper

    for name in names:
        setattr(cls, name, wrap(getattr(cls, name)))


class _PathsRedirected:
    """On a non-chief worker, points a callback's output paths into a temporary directory.

    Every worker runs the same save (the same reads of every variable, so any
    collective a read needs happens on all workers alike), but only the chief's
    files land where the user asked; the others' are removed afterwards.
    """

    def __init__(self, callback, attributes, strategy):
        import tempfile

        self.callback, self.attributes = callback, attributes
        self.tmp = tempfile.mkdtemp(prefix=f"keras_replicator_worker{strategy.worker_index}_")

    def redirect(self, path: str) -> str:
        import os

        return os.path.join(self.tmp, os.path.basename(str(path).rstrip("/\\")) or "out")

    def __enter__(self):
        self.saved = {a: getattr(self.callback, a) for a in self.attributes}
        for a, path in self.saved.items():
            setattr(self.callback, a, self.redirect(path))
        return self

    def __exit__(self, *exc):
        import shutil

        for a, path in self.saved.items():
            setattr(self.callback, a, path)
        shutil.rmtree(self.tmp, ignore_errors=True)
        return False


def _patch_checkpoint_callbacks() -> None:
    """Only the chief writes ``ModelCheckpoint`` and ``BackupAndRestore`` files.

    Why: Keras 3's callbacks (3.15) know nothing of workers, so every worker
    would write the same files concurrently. On a non-chief worker of our
    multi-worker strategies the output paths point into a temporary directory
    that is removed after each save, the backup is not deleted at the end of
    training (the chief does that), and after ``BackupAndRestore`` restored,
    the workers check that they all resume from the same epoch (the backup must
    be on storage every worker reads).
    """
    from keras.src.callbacks import backup_and_restore, model_checkpoint

    mc = model_checkpoint.ModelCheckpoint
    if getattr(mc._save_model, "_keras_replicator_patch", False):
        return
    original_mc_save = mc._save_model

    def mc_save_model(self, epoch, batch, logs):
        strategy = _callback_strategy(self)
        if strategy is None or strategy.is_chief:
            return original_mc_save(self, epoch, batch, logs)
        redirect = _PathsRedirected(self, (), strategy)
        original_get = self._get_file_path
        self._get_file_path = lambda *a: redirect.redirect(original_get(*a))
        try:
            with redirect:
                return original_mc_save(self, epoch, batch, logs)
        finally:
            del self._get_file_path

    br = backup_and_restore.BackupAndRestore
    original_br_save, original_br_end, original_br_begin = br._save_model, br.on_train_end, br.on_train_begin
    paths = ("backup_dir", "_weights_path", "_training_metadata_path", "_prev_weights_path",
             "_prev_training_metadata_path")

    def br_save_model(self):
        strategy = _callback_strategy(self)
        if strategy is None or strategy.is_chief:
            return original_br_save(self)
        with _PathsRedirected(self, paths, strategy):
            return original_br_save(self)

    def br_on_train_end(self, logs=None):
        strategy = _callback_strategy(self)
        if strategy is None or strategy.is_chief:
            return original_br_end(self, logs)

    def br_on_train_begin(self, logs=None):
        result = original_br_begin(self, logs)
        strategy = _callback_strategy(self)
        if strategy is not None:
            # All equal iff n * sum(e^2) == sum(e)^2 (integers: exact).
            epoch = int(getattr(self.model, "_initial_epoch", None) or 0)
            total, squares = (
                int(v)
                for v in strategy.reduce("SUM", tf.constant([epoch, epoch * epoch], tf.int64), axis=None)
            )
            if strategy.num_workers * squares != total * total:
                raise RuntimeError(
                    f"BackupAndRestore: the workers restored different epochs; worker "
                    f"{strategy.worker_index} restored epoch {epoch} from {self.backup_dir!r}. The "
                    "chief writes the backup; backup_dir must be on storage that every worker reads "
                    "(a shared file system or bucket)."
                )
        return result

    for cls, name, fn in (
        (mc, "_save_model", mc_save_model),
        (br, "_save_model", br_save_model),
        (br, "on_train_end", br_on_train_end),
        (br, "on_train_begin", br_on_train_begin),
    ):
        fn._keras_replicator_patch = True
        setattr(cls, name, fn)


def install_multi_worker_keras_patches() -> None:
    """Makes Keras 3 work with ``ReplicatorStrategy`` across workers (idempotent).

    Each patch acts only for our strategies with more than one worker; other
    strategies (and one-machine ``ReplicatorStrategy``) keep Keras's behaviour.
    """
    from keras.src.backend.tensorflow import trainer as tf_trainer

    _patch_reduce_per_replica(tf_trainer)
    _patch_lost_worker_errors(tf_trainer)
    _patch_checkpoint_callbacks()


# --- tf.data (checked on TF 2.21, Keras 3.15) ----------------------------------
# keras_replicator.data needs three things tf.data has no public API for: which
# batch transformation a dataset ends with (to tell batched from unbatched
# input), how many files it reads (to choose file or data sharding before any
# work), and TensorFlow's file-sharding rewrite itself. All three read the
# Python objects tf.data builds (``_input_dataset``, ``_batch_size``,
# ``_filenames``, ``_map_func``), which have been stable since TF 2.4.

import functools as _functools  # noqa: E402
import re as _re  # noqa: E402

# Transformations that keep "one element = one batch" (batch detection), and that
# file counting looks through as TensorFlow's FILE auto-sharding does (its
# kPassThroughOps in grappler/optimizers/data/auto_shard.cc; map, filter, shuffle,
# prefetch, batch, unbatch... were checked; if the rewrite disagrees it fails with
# TensorFlow's own message when the pipeline starts).
_PASS_THROUGH = {
    "_AssertCardinalityDataset", "_AssertNextDataset", "CacheDataset", "_FilterDataset",
    "_IgnoreErrorsDataset", "_MapDataset", "_MaxIntraOpParallelismDataset", "_ModelDataset",
    "_OptionsDataset", "_ParallelMapDataset", "_PrefetchDataset", "_PrivateThreadPoolDataset",
    "_RepeatDataset", "_ShardDataset", "_ShuffleAndRepeatDataset", "_ShuffleDataset",
    "_SkipDataset", "_TakeDataset", "_ParseExampleDataset", "_NonSerializableDataset",
}
_BATCHES = {"_BatchDataset", "_ParallelBatchDataset", "_PaddedBatchDataset", "_MapAndBatchDataset"}
# Also passed through by FILE sharding (they change the batching, not the files).
_FILE_PASS_THROUGH = _PASS_THROUGH | _BATCHES | {
    "_RebatchDataset", "_LegacyRebatchDataset", "_UnbatchDataset", "_WindowDataset",
}
_INTERLEAVES = {"_InterleaveDataset", "_ParallelInterleaveDataset", "_FlatMapDataset", "ParallelInterleaveDataset"}
_READER_OP = _re.compile(r"^(ArrayRecord|FixedLengthRecord|RecordIO|SSTable|TextLine|TFRecord)Dataset(V\d+)?$")


def _unwrap_dataset(ds):
    while type(ds).__name__ in ("DatasetV1Adapter", "TFRecordDatasetV1", "TextLineDatasetV1",
                                "FixedLengthRecordDatasetV1"):
        ds = ds._dataset
    return ds


def find_batch(dataset: tf.data.Dataset) -> tuple[int | None, bool | None] | None:
    """``(batch_size, drop_remainder)`` of the batch transformation ``dataset`` ends with.

    Looks through element-wise transformations (map, prefetch, shuffle, ...).
    ``None`` when no batch transformation is found (the dataset is taken as
    unbatched); a size of ``None`` when the batch size is not a constant.
    """
    ds = _unwrap_dataset(dataset)
    while True:
        name = type(ds).__name__
        if name in _BATCHES:
            size = getattr(ds, "_batch_size", None)
            drop = getattr(ds, "_drop_remainder", None)
            try:
                size = int(size)
            except (TypeError, ValueError):
                size = None
            try:
                drop = bool(drop)
            except (TypeError, ValueError):
                drop = None
            return size, drop
        if name in _PASS_THROUGH and hasattr(ds, "_input_dataset"):
            ds = _unwrap_dataset(ds._input_dataset)
            continue
        return None


def _reads_files(function_wrapper) -> bool:
    """Whether a tf.data function (an interleave's or flat_map's) opens a file reader."""
    function = getattr(function_wrapper, "function", None)
    graph = getattr(function, "graph", None)
    if graph is None:
        return False
    graph_def = graph.as_graph_def()
    ops = [node.op for node in graph_def.node]
    for fn in graph_def.library.function:
        ops.extend(node.op for node in fn.node_def)
    return any(_READER_OP.match(op) for op in ops)


def _number_of(filenames) -> int | None:
    if isinstance(filenames, tf.data.Dataset):
        count = int(filenames.cardinality())
        return count if count >= 0 else None
    try:
        return int(tf.size(filenames))
    except (TypeError, ValueError):
        return None


def count_source_files(dataset: tf.data.Dataset) -> int | None:
    """How many files ``dataset`` reads, as TensorFlow's FILE auto-sharding sees them.

    0: the data does not come from files (tensors, ranges, generators);
    ``None``: the files could not be found or counted (a transformation FILE
    sharding cannot see through, or a file list of unknown length).
    """
    ds = _unwrap_dataset(dataset)
    name = type(ds).__name__
    if hasattr(ds, "_filenames"):  # TFRecordDataset, TextLineDataset, FixedLengthRecordDataset
        return _number_of(ds._filenames)
    if name in _INTERLEAVES:
        if _reads_files(getattr(ds, "_map_func", None)):
            return _number_of(ds._input_dataset)
        return None
    if name in _FILE_PASS_THROUGH and hasattr(ds, "_input_dataset"):
        return count_source_files(ds._input_dataset)
    if name in ("_ZipDataset", "_ConcatenateDataset"):
        counts = [count_source_files(d) for d in ds._inputs()]
        return None if any(c is None for c in counts) else min(counts)
    if name in ("_TensorSliceDataset", "_TensorDataset", "_RangeDataset", "_GeneratorDataset",
                "_SparseTensorSliceDataset", "_RandomDataset", "RandomDatasetV2"):
        return 0
    return None


def auto_shard(
    dataset: tf.data.Dataset,
    num_shards: int,
    index: int,
    num_replicas: int,
    policy: tf.data.experimental.AutoShardPolicy = tf.data.experimental.AutoShardPolicy.FILE,
) -> tf.data.Dataset:
    """TensorFlow's auto-sharding rewrite, as ``tf.distribute`` applies it (``_AutoShardDataset``).

    With the FILE policy, shard ``index`` of ``num_shards`` reads every
    ``num_shards``-th file, found by rewriting the dataset's graph. (Applied twice
    in one process to the same TFDS dataset object, TF 2.21 returned the first
    shard both times; each worker builds its own dataset, so this does not arise
    across workers.)
    """
    from tensorflow.python.data.experimental.ops import distribute as data_distribute

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = policy
    return data_distribute._AutoShardDataset(dataset.with_options(options), num_shards, index, num_replicas)


def set_distributed_cardinality(distributed_dataset, steps: int) -> None:
    """Makes a ``DistributedDatasetsFromFunction`` report ``steps`` as its cardinality.

    TensorFlow reports the cardinality of each worker's dataset, which for a
    dataset of per-replica batches is steps x local replicas; Keras reads it as
    the number of steps of an epoch. ``_cardinality`` is read by the iterators
    only to recognise infinite and empty datasets (TF 2.16-2.21).
    """
    distributed_dataset._cardinality = steps


def _infinite_without_steps(data, steps) -> bool:
    if steps is not None:
        return False
    if isinstance(data, (tf.data.Dataset, tf.distribute.DistributedDataset)):
        cardinality = data.cardinality
        cardinality = int(cardinality() if callable(cardinality) else cardinality)
        return cardinality == tf.data.INFINITE_CARDINALITY
    return False


def install_keras_data_checks() -> None:
    """Makes Keras 3 refuse an infinite dataset without a step count, before any step.

    Keras 3.15 (``EpochIterator``) runs an epoch of an infinite ``tf.data`` dataset
    forever when ``steps_per_epoch`` (``steps``, ``validation_steps``) is not
    given. For strategies marked ``_keras_replicator`` we raise instead: in
    ``TFEpochIterator.__init__`` (fit, evaluate, predict) and, for
    ``validation_data``, at the start of ``fit`` (Keras builds the validation
    iterator only after the first epoch). Idempotent.
    """
    from keras.src.backend.tensorflow import trainer as tf_trainer

    iterator_cls = tf_trainer.TFEpochIterator
    if getattr(iterator_cls.__init__, "_keras_replicator_patch", False):
        return
    original_init = iterator_cls.__init__
    original_fit = tf_trainer.TensorFlowTrainer.fit

    @_functools.wraps(original_init)
    def __init__(self, distribute_strategy=None, *args, **kwargs):
        if getattr(distribute_strategy, "_keras_replicator", False) and _infinite_without_steps(
            kwargs.get("x"), kwargs.get("steps_per_epoch")
        ):
            raise ValueError(
                "The dataset is infinite (it repeats forever), so an epoch would never end. "
                "Give the number of steps: model.fit(..., steps_per_epoch=N), "
                "model.evaluate(..., steps=N) or model.predict(..., steps=N); "
                "or make the dataset finite (remove .repeat())."
            )
        original_init(self, distribute_strategy, *args, **kwargs)

    @_functools.wraps(original_fit)
    def fit(self, *args, **kwargs):
        validation_data = kwargs.get("validation_data")
        if isinstance(validation_data, (tuple, list)) and validation_data:
            validation_data = validation_data[0]
        if getattr(self.distribute_strategy, "_keras_replicator", False) and _infinite_without_steps(
            validation_data, kwargs.get("validation_steps")
        ):
            raise ValueError(
                "validation_data is an infinite dataset (it repeats forever), so validation "
                "would never end. Pass validation_steps=N to fit, or make it finite."
            )
        return original_fit(self, *args, **kwargs)

    __init__._keras_replicator_patch = True
    iterator_cls.__init__ = __init__
    tf_trainer.TensorFlowTrainer.fit = fit
