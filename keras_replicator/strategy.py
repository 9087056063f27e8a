"""`ReplicatorStrategy`: a `tf.distribute.Strategy` that makes Keras 3 replicate.

A researcher writes ordinary Keras code under `strategy.scope()`; `fit`,
`evaluate` and `predict` then run data-parallel over every local device. The
replication engine is TensorFlow's own (`MirroredExtended`: one thread per
replica tracing into one graph, collective or reduction-to-one-device all-reduces).
What this module adds is what Keras 3 needs from it and does not get from the
stock strategies (the engines and patches are in `keras_replicator._compat`):

* `steps_per_execution > 1` with 2+ replicas works (keras-team/keras#19246);
* every strategy instance gets its own collective keys, so several strategies
  over different devices can live in one process (tests, notebooks);
* the defaults a laptop user expects: every GPU, else every logical CPU device.

When `TF_CONFIG`, Slurm or a `cluster_resolver` describes a cluster of
several workers, the strategy replicates between graphs across them with
TensorFlow's `CollectiveAllReduceExtended` (ring over gRPC on CPUs, NCCL on
GPUs), with the same fixes plus what Keras 3 lacks there: `predict` returns
every worker's rows, metrics are global, the failure of one worker stops the
others with `WorkerLostError` within `failure_timeout` seconds, and checkpoints
are written by the chief only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import keras
import tensorflow as tf

from keras_replicator import _announce, _compat, cluster, data, versions
from keras_replicator._compat import engines, keras_trainer, preemption, short_batches, tf_logging
from keras_replicator._validation import (
    ArgumentError,
    check_bool,
    check_choice,
    check_int,
    check_number,
)
from keras_replicator.cross_device_ops import default_cross_device_ops
from keras_replicator.model_parallel.layout import LayoutRules
from keras_replicator.model_parallel.mesh import ReplicaMesh
from keras_replicator.model_parallel.sharding import ModelSharding, StrategyPlacement

_COMMUNICATION = {
    "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
    "ring": tf.distribute.experimental.CommunicationImplementation.RING,
    "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
}


def _device_strings(devices) -> list[str]:
    """A ``devices=`` argument (a name, or names and LogicalDevices) as a non-empty list of names."""
    names = [devices] if isinstance(devices, str) else devices
    try:
        names = list(names)
    except TypeError:
        raise ArgumentError(
            f"devices must be a list of device names such as ['/gpu:0', '/gpu:1'], got {devices!r}"
        ) from None
    if not names:
        raise ArgumentError("devices is empty: give at least one device, or None for all local devices.")
    out = []
    for d in names:
        if isinstance(d, tf.config.LogicalDevice):
            d = d.name
        if not isinstance(d, str):
            raise ArgumentError(f"Each device must be a string such as '/gpu:0', got {d!r}.")
        out.append(d)
    return out


def _normalise_devices(devices) -> list[str]:
    if devices is None:
        return cluster.local_devices()
    names = _device_strings(devices)
    specs = [tf.DeviceSpec.from_string(d) for d in names]
    if len({s.to_string() for s in specs}) != len(specs):
        raise ArgumentError(f"devices has duplicates: {names}")
    local = tf.config.list_logical_devices()
    known = {(s.device_type, s.device_index) for s in (tf.DeviceSpec.from_string(d.name) for d in local)}
    for name, spec in zip(names, specs):
        if spec.job not in (None, "localhost"):
            continue  # a remote device: checked when the cluster connects
        if (spec.device_type or "").upper() not in ("CPU", "GPU", "TPU"):
            raise ArgumentError(f"Device {name!r} names no device type; write e.g. '/gpu:0'.")
        if (spec.device_type.upper(), spec.device_index or 0) not in known:
            raise ArgumentError(
                f"Device {name!r} does not exist here. Local devices: {[d.name for d in local]}. "
                "On a CPU-only machine, call kr.simulate_devices(n) first to get n CPU devices."
            )
    return names


def _mesh_shape(rules: LayoutRules, devices_per_replica: int, devices) -> tuple[int, list[str]]:
    """k and the devices a `LayoutMap`'s mesh gives (its model axis, its devices replica by replica)."""
    k = rules.model_size
    if devices_per_replica not in (1, k):
        raise ArgumentError(
            f"devices_per_replica={devices_per_replica} differs from the layout_map mesh's model axis "
            f"({k}): give one or the other."
        )
    mesh_devices = rules.mesh_devices()
    if devices is not None and len(_device_strings(devices)) != len(mesh_devices):
        raise ArgumentError(
            f"devices lists {len(_device_strings(devices))} devices but the layout_map's mesh has "
            f"{len(mesh_devices)} ({rules.axis_sizes}): leave devices out to use the mesh's."
        )
    return k, mesh_devices if devices is None else devices


def _local_device_names(devices) -> list[str] | None:
    """Checks the form of a multi-worker ``devices=`` argument without starting TensorFlow."""
    if devices is None:
        return None
    names = _device_strings(devices)
    out = []
    for d in names:
        spec = tf.DeviceSpec.from_string(d)
        if spec.job not in (None, "localhost") or spec.task not in (None, 0):
            raise ArgumentError(
                f"Device {d!r} names a job or task. In a multi-worker job, devices= lists this "
                "worker's local devices, e.g. ['/gpu:0', '/gpu:1']."
            )
        if (spec.device_type or "").upper() not in ("CPU", "GPU"):
            raise ArgumentError(f"Device {d!r} names no device type; write e.g. '/gpu:0'.")
        out.append(f"/device:{spec.device_type.upper()}:{spec.device_index or 0}")
    if len(set(out)) != len(out):
        raise ArgumentError(f"devices has duplicates: {names}")
    return out


def _check_divides(devices_per_replica: int, devices: list[str]) -> None:
    if len(devices) % devices_per_replica:
        raise ArgumentError(
            f"devices_per_replica={devices_per_replica} must divide the number of local devices, "
            f"{len(devices)} ({devices}): each replica spans exactly {devices_per_replica} devices."
        )


class _ScopeWithPatches:
    """TensorFlow's strategy scope, with the scoped patches applied while it is entered."""

    def __init__(self, tf_scope):
        self._tf_scope = tf_scope
        self._patches = None

    def __enter__(self):
        self._patches = _compat.strategy_scope_patches()
        self._patches.__enter__()
        try:
            return self._tf_scope.__enter__()
        except BaseException:
            self._patches.__exit__(None, None, None)
            raise

    def __exit__(self, *exc):
        try:
            return self._tf_scope.__exit__(*exc)
        finally:
            self._patches.__exit__(None, None, None)


class ReplicatorStrategy(tf.distribute.Strategy):
    """Synchronous data-parallel replication for Keras 3 (the TF-Replicator model).

    Each replica runs the same step on its slice of the global batch; gradients
    are all-reduced, so every replica keeps identical weights. Use it as any
    ``tf.distribute.Strategy``: build and compile the model under ``scope()``,
    then ``fit`` as usual, or drive ``run`` from a custom ``tf.function`` loop.

    Example:
        ```python
        import keras, numpy as np
        import keras_replicator as kr

        kr.simulate_devices(2)                  # a CPU-only machine: 2 replicas
        strategy = kr.ReplicatorStrategy()
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile("sgd", "mse", steps_per_execution=4)
        model.fit(np.ones((64, 4)), np.ones((64, 1)), batch_size=16, verbose=0)
        ```

        The same script runs on several workers unchanged when ``TF_CONFIG``
        (or Slurm) describes them, e.g. ``keras-replicator launch --workers 2
        train.py``; create the strategy first thing in the script:

        ```python
        strategy = kr.ReplicatorStrategy(failure_timeout=30)
        print(strategy.num_workers, strategy.worker_index, strategy.is_chief)
        ```

    Args:
        devices: the devices to replicate over, as for
            ``tf.distribute.MirroredStrategy``: device names such as
            ``["/gpu:0", "/gpu:1"]``. ``None`` takes every local GPU, else every
            logical CPU device (see `keras_replicator.simulate_devices`).
        cross_device_ops: a ``tf.distribute.CrossDeviceOps`` to use for
            all-reduces (e.g. ``tf.distribute.NcclAllReduce()``,
            ``tf.distribute.ReductionToOneDevice()``). ``None`` chooses by the
            devices (`default_cross_device_ops`): NCCL on GPUs, a
            reduction on one device over CPU devices, for reductions across
            replicas outside a step; inside a step traced once every replica
            all-reduces with its own collective launcher. Given here, a
            ``CrossDeviceOps`` that is not a collective all-reduce (e.g.
            ``NcclAllReduce``, ``ReductionToOneDevice``) also does a step's
            all-reduces, and the step is traced per replica: a warning at
            creation says so (``communication="nccl"`` keeps one trace). As for
            ``MirroredStrategy``, ``devices`` and ``cross_device_ops`` may be
            given by position. One machine only; across workers choose
            ``communication``.
        cluster_resolver: a ``tf.distribute.cluster_resolver.ClusterResolver``
            describing a multi-worker job. ``None`` looks at ``TF_CONFIG``, then
            at a Kubernetes JobSet pod's, then at Slurm's environment (see
            `keras_replicator.cluster.resolve_cluster`);
            with no cluster (or a cluster of one task) the strategy is local.
            In a multi-worker job ``devices`` lists each worker's local devices.
        communication: ``"auto"``, ``"ring"`` or ``"nccl"``: the implementation
            of collective all-reduces (``"auto"``: NCCL on GPUs, ring otherwise).
        failure_timeout: seconds without a heartbeat after which a worker counts
            as lost; the others then stop with `WorkerLostError` naming it
            (a dead or a silent worker, e.g. a stopped process or a hung
            device). The default, 30, ends a job with a silent worker in
            about 30 to 40 s. Multi-worker only.
        startup_timeout: seconds to wait at creation for every worker of the
            cluster to be up before failing with
            `ClusterStartupError`. Multi-worker only.
        on_sigterm: what SIGTERM (a preemption, an eviction) does during
            ``fit``. ``"save"``: with ``keras.callbacks.BackupAndRestore`` in
            ``fit``'s callbacks, every worker stops after the same step, the
            backup is written there (epoch and step within it) and the
            process exits with status 143 ("restart me"); the restarted job
            resumes at that step. Several workers exit with 143 after that
            step even without the callback. ``"fatal"``: SIGTERM ends the
            process at once, as in a plain Python program. ``None``: the
            environment variable ``KERAS_REPLICATOR_ON_SIGTERM``, else ``"save"``.
        shard_optimizer_state: if ``True``, every Keras optimizer built under
            the scope keeps the slots of each model variable (Adam's moments,
            momentum, ...) on one replica only, which applies its update and
            sends the new weights to the others (ZeRO stage 1): the optimizer
            state per device shrinks to about ``1/N``. Checkpoints keep the
            unsharded format. See `keras_replicator.optimizers.state_sharding`
            and the guide "Memory". On several workers the state is shared
            over all the job's replicas (each worker holds ``1/W``).
        trace_once: trace the replica step once and call it on every
            replica (the default), so that the time to the first step stays
            about flat as replicas are added. ``False`` goes back to
            TensorFlow's tracing of one copy per replica, for debugging. A step
            that cannot be traced once (it creates variables, or calls
            ``merge_call``) is traced per replica either way, which is logged
            once at INFO level with the reason. See the guide "Performance".
        devices_per_replica: k, the devices one replica spans (TF-Replicator's
            logical devices, for models larger than one device): the local
            devices form M = devices / k replicas, replica ``r``'s logical
            device ``j`` being device ``r * k + j``, and k must divide the
            number of local devices (of each worker, on several). Inputs
            arrive on each replica's logical device 0, where its step runs;
            `logical_device_for_variables` and `keras_replicator.logical_device`
            place variables and ops on the others (see the guide "Model
            parallelism"). Steps are then traced per replica. The default, 1,
            is data parallelism: one device per replica.
        layout_map: a ``keras.distribution.LayoutMap`` over a
            ``keras.distribution.DeviceMesh`` with a model axis ``"model"``
            (and a data axis ``"batch"``): tensor parallelism as Keras's
            ``ModelParallel`` describes it. The mesh gives M (the data axis) and
            k (the model axis, ``devices_per_replica``) and, unless ``devices``
            is given, the devices (``mesh.devices[r, j]`` is replica r's logical
            device j). A variable made in the scope whose layout names the model
            axis is stored as k shards, shard j on logical device j of every
            replica; ``Dense``, ``EinsumDense``, ``Embedding`` and
            ``MultiHeadAttention`` compute on the shards (see the guide "Model
            parallelism: layouts"). A bad layout raises
            `keras_replicator.errors.LayoutError` before any step.
        strict_layouts: what a ``layout_map`` rule that matches no variable of
            the model does (checked at ``compile`` once the model is built, else
            at the first ``fit``, ``evaluate`` or ``predict``). ``False`` (the
            default, Keras's semantics): a `keras_replicator.errors.LayoutWarning`
            naming the rules and the variables no rule matched, and training goes
            on. ``True``: `keras_replicator.errors.LayoutError` there, before any
            step: the way to catch a renamed layer. Needs a ``layout_map``.
    """

    def __init__(
        self,
        devices: Sequence[str] | None = None,
        cross_device_ops: tf.distribute.CrossDeviceOps | None = None,
        *,
        cluster_resolver: tf.distribute.cluster_resolver.ClusterResolver | None = None,
        communication: str = "auto",
        failure_timeout: float = 30.0,
        startup_timeout: float = 300.0,
        on_sigterm: str | None = None,
        shard_optimizer_state: bool = False,
        trace_once: bool = True,
        devices_per_replica: int = 1,
        layout_map: keras.distribution.LayoutMap | None = None,
        strict_layouts: bool = False,
    ):
        devices_per_replica = check_int("devices_per_replica", devices_per_replica, minimum=1)
        strict_layouts = check_bool("strict_layouts", strict_layouts)
        if strict_layouts and layout_map is None:
            raise ArgumentError("strict_layouts=True checks a layout_map's rules: give a layout_map too.")
        rules = None
        if layout_map is not None:
            rules = LayoutRules(layout_map)  # the layouts' errors, before any work
            devices_per_replica, devices = _mesh_shape(rules, devices_per_replica, devices)
        self.shard_optimizer_state = check_bool("shard_optimizer_state", shard_optimizer_state)
        trace_once = check_bool("trace_once", trace_once)
        given_ops = cross_device_ops
        if cross_device_ops is not None and not isinstance(cross_device_ops, tf.distribute.CrossDeviceOps):
            raise ArgumentError("cross_device_ops must be a tf.distribute.CrossDeviceOps such as "
                                f"tf.distribute.ReductionToOneDevice(), got {cross_device_ops!r}.")
        communication = check_choice(
            "communication", communication.lower() if isinstance(communication, str) else communication,
            sorted(_COMMUNICATION),
        )
        failure_timeout = check_number("failure_timeout", failure_timeout, positive=True)
        startup_timeout = check_number("startup_timeout", startup_timeout, positive=True)
        if on_sigterm is None:
            on_sigterm = preemption.default_mode()
        self.on_sigterm = check_choice("on_sigterm", on_sigterm, list(preemption.MODES))
        implementation = _COMMUNICATION[communication]
        versions.warn_if_untested(_compat.CHECKED)  # a Keras or TensorFlow newer than any tested
        tf_logging.install()  # before TensorFlow's engine logs "Using MirroredStrategy ..."
        cluster.simulate_devices_from_env()
        resolver = cluster.resolve_cluster(cluster_resolver)
        spec = resolver.cluster_spec() if resolver is not None else tf.train.ClusterSpec({})
        if sum(spec.num_tasks(job) for job in spec.jobs) > 1:
            if cross_device_ops is not None:
                raise ArgumentError(
                    "cross_device_ops applies to one machine; in a multi-worker job choose "
                    'communication="ring" or "nccl" instead.'
                )
            local_names = _local_device_names(devices)
            if local_names is not None:
                _check_divides(devices_per_replica, local_names)  # else checked once the worker's devices are known
            extended = engines.ReplicatorMultiWorkerExtended(
                self,
                resolver,
                devices=local_names,
                communication=implementation,
                failure_timeout=failure_timeout,
                startup_timeout=startup_timeout,
                trace_once=trace_once,
                devices_per_replica=devices_per_replica,
            )
        else:
            device_names = _normalise_devices(devices)
            _check_divides(devices_per_replica, device_names)
            chosen = cross_device_ops is not None
            if cross_device_ops is None and communication == "auto":
                cross_device_ops = default_cross_device_ops(device_names)
            extended = engines.ReplicatorExtended(
                self,
                devices=device_names,
                cross_device_ops=cross_device_ops,
                communication=None if communication == "auto" else implementation,
                trace_once=trace_once,
                cross_device_ops_chosen=chosen,
                devices_per_replica=devices_per_replica,
            )
        super().__init__(extended)
        if rules is not None:
            self.model_sharding = ModelSharding(layout_map, StrategyPlacement(self), strict=strict_layouts)
        if self.on_sigterm == "fatal" and self.num_workers > 1:
            preemption.make_sigterm_fatal()  # the coordination service had caught it
        _compat.install()
        keras_trainer.register_strategy(self)
        all_reduce = _announce.strategy_all_reduce(
            extended, communication, given_ops,
            trace_once and self.num_replicas_in_sync > 1 and devices_per_replica == 1)
        _announce.announce(
            "ReplicatorStrategy", self.num_replicas_in_sync, self.mesh.devices, all_reduce,
            self.num_workers, self.worker_index,
        )

    # Marks the strategies whose Keras integration keras_replicator handles.
    _keras_replicator = True
    #: The `layout_map`'s layouts in force in the scope (`model_parallel.sharding.ModelSharding`), or None.
    model_sharding: ModelSharding | None = None

    @property
    def devices(self) -> tuple[str, ...]:
        """The devices of the local replicas, in replica order.

        With ``devices_per_replica > 1``, each replica's logical device 0 (where its
        inputs arrive and its step runs); `mesh` lists them all.
        """
        return tuple(self.extended.worker_devices)

    @property
    def devices_per_replica(self) -> int:
        """k, the devices (logical devices) one replica spans; 1 for data parallelism."""
        return self.extended.devices_per_replica

    @property
    def mesh(self) -> ReplicaMesh:
        """This worker's device grid: its replicas x their logical devices.

        Example:
            ```python
            strategy = kr.ReplicatorStrategy(devices_per_replica=2)   # 2 devices: 1 replica
            strategy.mesh.num_replicas              # 1
            strategy.mesh.replica_devices(0)        # ('/job:localhost/.../device:CPU:0', '/job:.../device:CPU:1')
            ```
        """
        return self.extended.mesh

    def logical_device_for_variables(self, logical_device: int) -> contextlib.AbstractContextManager:
        """Variables made in it (and in `scope`) live on logical device `logical_device`.

        Each is a mirrored variable with one copy per replica, on that replica's
        logical device `logical_device` (TF-Replicator's
        ``strategy.logical_device_for_variables``); its gradients are summed over
        its copies, so they stay equal. An optimizer's slots follow their
        variable. Keras makes a layer's variables when the layer is built: build
        it in the context. Outside the context variables live on logical device 0.
        Enter it inside `scope` (a `RuntimeError` says so otherwise: outside the
        scope variables are TensorFlow's plain ones).

        Example:
            ```python
            strategy = kr.ReplicatorStrategy(devices_per_replica=2)   # 1 replica of 2 devices
            with strategy.scope():
                first = keras.layers.Dense(8)
                with strategy.logical_device_for_variables(0):
                    first.build((None, 4))
                second = keras.layers.Dense(1)
                with strategy.logical_device_for_variables(1):
                    second.build((None, 8))
            second.kernel.value.values[0].device   # '/job:localhost/replica:0/task:0/device:CPU:1'
            ```

        Args:
            logical_device: the index, ``0 .. devices_per_replica - 1``.
        """
        self.extended.check_logical_device(logical_device)  # now, not when entered
        return self.extended.logical_device_for_variables(logical_device)

    @property
    def num_workers(self) -> int:
        """Number of worker processes in the job (1 on one machine)."""
        return self.extended.num_workers

    @property
    def worker_index(self) -> int:
        """This worker's index in `0 .. num_workers - 1` (the chief's is 0).

        Its replicas are the global replicas `worker_index * k .. worker_index * k + k - 1`
        for `k` local devices.
        """
        return self.extended.worker_index

    @property
    def is_chief(self) -> bool:
        """True on the worker that writes checkpoints and summaries (always on one machine)."""
        return self.extended.is_chief

    @property
    def cluster_resolver(self) -> tf.distribute.cluster_resolver.ClusterResolver | None:
        """The resolver of the multi-worker job, or `None` on one machine."""
        return self.extended.cluster_resolver if self.num_workers > 1 else None

    def scope(self):
        """The strategy's scope, as `tf.distribute.Strategy.scope()`.

        Also applies keras_replicator's scoped patches while it is entered (see
        `keras_replicator._compat`): plain Keras `BatchNormalization` keeps its
        moving statistics identical across replicas, all-reduces get a
        gradient that is cheap to trace, and Keras random ops (dropout,
        augmentation layers) draw independently on every replica.

        Example:
            ```python
            with strategy.scope():
                model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            ```
        """
        return _ScopeWithPatches(super().scope())

    def run(self, fn, args=(), kwargs=None, options=None):
        """Runs ``fn`` on every replica, as `tf.distribute.Strategy.run`.

        The batches `fit`, `evaluate` and `predict` read carry each replica's count of
        real rows; ``fn`` gets the plain batch (see `keras_replicator._compat.short_batches`).

        Example:
            ```python
            sums = strategy.run(lambda: tf.constant(1.0))
            print(strategy.reduce("SUM", sums, axis=None).numpy())   # one per replica
            ```
        """
        fn, args, kwargs = short_batches.unwrap(self, fn, args, kwargs)
        return super().run(fn, args, kwargs, options)

    def __repr__(self) -> str:
        if self.num_workers > 1:
            return (
                f"ReplicatorStrategy(num_replicas={self.num_replicas_in_sync}, "
                f"num_workers={self.num_workers}, worker_index={self.worker_index}, "
                f"devices={list(self.devices)})"
            )
        sharded = ", shard_optimizer_state=True" if self.shard_optimizer_state else ""
        k = self.devices_per_replica
        spans = f", devices_per_replica={k}" if k > 1 else ""
        devices = self.mesh.devices if k > 1 else self.devices
        return (
            f"ReplicatorStrategy(num_replicas={self.num_replicas_in_sync}, "
            f"devices={list(devices)}{spans}{sharded})"
        )

    # --- input pipelines (keras_replicator.data) ---------------------------------

    def distribute_dataset(
        self,
        dataset_or_fn: data.DatasetOrFn,
        *,
        global_batch_size: int | None = None,
        per_replica_batch_size: int | None = None,
        shard_policy: str = "auto",
        drop_remainder: bool | None = None,
        shuffle_buffer_size: int | None = None,
        seed: int | None = None,
        batched: bool | None = None,
        options: tf.distribute.InputOptions | None = None,
        padding: bool = False,
    ) -> tf.distribute.DistributedDataset:
        """Batches, shards and splits a dataset or an ``input_fn`` over the replicas.

        Every example of a finite dataset is used exactly once per epoch (unless
        ``drop_remainder=True``) and every replica gets at least one example per
        step. See `keras_replicator.data.distribute_dataset` for the
        arguments and the guide "Input pipelines" for the details.

        Example:
            ```python
            import tensorflow as tf

            x, y = np.ones((64, 4), "float32"), np.ones((64, 1), "float32")
            dataset = tf.data.Dataset.from_tensor_slices((x, y))     # unbatched examples
            train = strategy.distribute_dataset(dataset, per_replica_batch_size=8)
            with strategy.scope():                   # the model of the strategy that distributes the data
                model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
                model.compile("sgd", "mse")
            model.fit(train, epochs=2, verbose=0)

            def input_fn(ctx):                       # called once per worker
                return dataset.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
            train = strategy.distribute_dataset(input_fn, global_batch_size=16)
            ```
        """
        return data.distribute_dataset(
            self,
            dataset_or_fn,
            global_batch_size=global_batch_size,
            per_replica_batch_size=per_replica_batch_size,
            shard_policy=shard_policy,
            drop_remainder=drop_remainder,
            shuffle_buffer_size=shuffle_buffer_size,
            seed=seed,
            batched=batched,
            options=options,
            padding=padding,
        )

    def experimental_distribute_dataset(self, dataset, options=None):
        """Distributes a dataset batched by the global batch size (what Keras calls).

        As ``tf.distribute.Strategy.experimental_distribute_dataset``, with the
        guarantees of `distribute_dataset`: slices of a batch differ by at
        most one example, a short last batch leaves no replica empty, and
        sharding follows the dataset's ``auto_shard_policy`` without
        TensorFlow's AUTO->DATA warning. Datasets it cannot split (sparse or
        scalar components) get TensorFlow's own implementation.

        Example:
            ```python
            import tensorflow as tf

            dataset = tf.data.Dataset.from_tensor_slices(np.ones((128, 4), "float32"))

            @tf.function
            def step(batch):                         # on each replica, its half of the batch
                return tf.reduce_sum(batch)

            dist = strategy.experimental_distribute_dataset(dataset.batch(64))
            for batch in dist:
                sums = strategy.run(step, args=(batch,))
                total = strategy.reduce("SUM", sums, axis=None)   # 256.0: 64 rows of 4 ones
            ```
        """
        distributed = data.distribute_batched_dataset(self, dataset, options)
        if distributed is None:
            return super().experimental_distribute_dataset(dataset, options)
        return distributed
