"""`AsyncReplicatorStrategy`: asynchronous training with parameter servers, for Keras 3.

TF-Replicator's second regime. Variables live on parameter servers ("ps"
tasks); each worker takes a step on its own batch whenever it is free (read the
variables, compute gradients, apply them on the parameter servers) without
waiting for the others; a chief runs the training script and schedules the
steps. A slow worker does fewer steps instead of slowing everyone, and a lost
worker's steps are re-run by the others. The machinery is TensorFlow's
(`tf.distribute.ParameterServerStrategy`, `ClusterCoordinator`); this module
adds the cluster handling of `ReplicatorStrategy` (TF_CONFIG, Slurm, checks),
one script for every task, and Keras 3 `fit`/`evaluate`/`predict`
(`keras_replicator._compat.parameter_server`).

Module name: `async` is a Python keyword, hence `async_strategy`.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable

import tensorflow as tf

from keras_replicator import _announce, _compat, cluster, versions
from keras_replicator._compat import tf_data, tf_logging
from keras_replicator._validation import ArgumentError, check_int, check_number
from keras_replicator.errors import ParameterServerLostError
from keras_replicator.launch.addresses import split_address

__all__ = ["AsyncDataset", "AsyncReplicatorStrategy"]

# Printed by a worker or parameter server when it starts serving and when it ends.
_SERVING = "keras_replicator: {name} is serving; it ends when the chief ends the job"
_ENDING = "keras_replicator: the chief at {address} ended the job; {name} exits"


def _reachable(address: str, timeout: float = 1.0) -> bool:
    """True if a TCP connection to `host:port` opens (a task's gRPC server is listening)."""
    try:
        with socket.create_connection(split_address(address), timeout=timeout):
            return True
    except OSError:
        return False


def _serve(resolver, startup_timeout: float, shutdown_grace: float) -> None:
    """Runs this worker's or parameter server's TensorFlow server until the chief is gone; exits 0."""
    spec = resolver.cluster_spec()
    task_type, task_id = resolver.task_type, resolver.task_id
    names = cluster.task_names(spec)
    name = names[f"/job:{task_type}/replica:0/task:{task_id}"]
    server = tf.distribute.Server(
        spec, job_name=task_type, task_index=task_id, protocol=resolver.rpc_layer or "grpc", start=True
    )
    print(_SERVING.format(name=name), flush=True)
    chief = spec.task_address("chief", 0)
    deadline = time.monotonic() + startup_timeout
    while not _reachable(chief):
        if time.monotonic() > deadline:
            raise cluster.ClusterStartupError(
                f"{name}: the chief at {chief} did not come up within startup_timeout="
                f"{startup_timeout:g} s. Start the chief with the same cluster."
            )
        time.sleep(0.5)
    gone_since = None
    while True:
        time.sleep(0.5)
        if _reachable(chief):
            gone_since = None
        elif gone_since is None:
            gone_since = time.monotonic()
        elif time.monotonic() - gone_since >= shutdown_grace:
            break
    print(_ENDING.format(address=chief, name=name), flush=True)
    del server
    sys.stdout.flush()
    sys.stderr.flush()
    # TensorFlow's gRPC server has no stop(), and its threads keep the interpreter from ending.
    os._exit(0)


class AsyncDataset:
    """Per-worker input for `fit` under `AsyncReplicatorStrategy` (see `distribute_dataset`).

    Each worker runs its own copy of the pipeline; the chief's `fit` hands the
    iterator of the worker that runs a step to that step. Not iterable on the
    chief.

    Example:
        ```python
        train = strategy.distribute_dataset(dataset_fn, per_replica_batch_size=32)
        print(train.element_spec)
        model.fit(train, epochs=3, steps_per_epoch=100)
        ```
    """

    _keras_replicator_async_input = True

    def __init__(self, strategy: AsyncReplicatorStrategy, per_worker_dataset, element_spec):
        self.strategy = strategy
        self._per_worker_dataset = per_worker_dataset
        self._per_worker_iterator = None
        self.element_spec = element_spec

    def _iterator(self):
        """The per-worker iterators, created once: every epoch goes on with each worker's stream."""
        if self._per_worker_iterator is None:
            self._per_worker_iterator = iter(self._per_worker_dataset)
        return self._per_worker_iterator

    def __repr__(self) -> str:
        return f"AsyncDataset(num_workers={self.strategy.num_workers}, element_spec={self.element_spec})"


class AsyncReplicatorStrategy(tf.distribute.ParameterServerStrategy):
    """Asynchronous data-parallel training with parameter servers, for Keras 3.

    The cluster has one chief, `N` workers and `M` parameter servers ("ps"). The
    same script runs on every task: on a worker or a parameter server, creating
    the strategy starts that task's TensorFlow server and blocks until the chief
    ends the job, then the process exits with status 0; on the chief it returns
    the strategy and the script goes on. Build and compile the model under
    `scope()` (its variables go to the parameter servers), then `fit` on
    `distribute_dataset(...)`: the chief schedules steps onto whichever worker is
    free; each applies its gradients to the parameter servers without waiting
    for the others. `evaluate` and `predict` run on the chief.

    A lost worker costs nothing but its share of the steps: the steps it was
    running run again on another worker, and a restarted worker rejoins. A lost
    parameter server ends `fit` with `kr.errors.ParameterServerLostError`
    (restart the job; `keras.callbacks.BackupAndRestore` resumes it).

    Example:
        ```python
        import keras, tensorflow as tf
        import keras_replicator as kr

        strategy = kr.AsyncReplicatorStrategy()   # workers and ps block here, then exit 0

        def dataset_fn(input_context):            # runs on every worker
            return make_examples().shuffle(10_000).repeat()

        with strategy.scope():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
            model.compile("sgd", "mse", steps_per_execution=10)
        train = strategy.distribute_dataset(dataset_fn, per_replica_batch_size=32)
        model.fit(train, epochs=5, steps_per_epoch=200,
                  callbacks=[keras.callbacks.BackupAndRestore("/shared/backup")])
        model.evaluate(x_test, y_test)             # on the chief
        ```

    Args:
        cluster_resolver: a `tf.distribute.cluster_resolver.ClusterResolver`
            whose cluster has one "chief", one or more "worker" and "ps" tasks.
            `None` reads `TF_CONFIG`, then a Kubernetes JobSet pod's environment
            (`keras_replicator.cluster.jobset_cluster`), then Slurm (`KERAS_REPLICATOR_SLURM_NUM_PS`
            of the tasks are parameter servers; see
            `keras_replicator.cluster.slurm_cluster`).
        variable_partitioner: a `tf.distribute.experimental.partitioners.Partitioner`
            that splits large variables over the parameter servers, e.g.
            `MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=num_ps)`.
            Saved and loaded as whole tensors. `None`: every variable on one
            parameter server (round-robin).
        startup_timeout: seconds the chief waits for every task to listen, and a
            worker or parameter server for the chief, before failing with
            `kr.ClusterStartupError`.
        failure_timeout: seconds a parameter server may be unreachable before
            the chief stops training with `ParameterServerLostError`.
        shutdown_grace: seconds the chief must be gone before a worker or
            parameter server concludes that the job ended and exits (a chief
            restarted within it keeps them).
    """

    _keras_replicator_async = True

    def __init__(
        self,
        cluster_resolver: tf.distribute.cluster_resolver.ClusterResolver | None = None,
        variable_partitioner: tf.distribute.experimental.partitioners.Partitioner | None = None,
        *,
        startup_timeout: float = 300.0,
        failure_timeout: float = 30.0,
        shutdown_grace: float = 10.0,
    ):
        startup_timeout = check_number("startup_timeout", startup_timeout, positive=True)
        failure_timeout = check_number("failure_timeout", failure_timeout, positive=True)
        shutdown_grace = check_number("shutdown_grace", shutdown_grace, non_negative=True)
        if variable_partitioner is not None and not callable(variable_partitioner):
            raise ArgumentError(
                "variable_partitioner must be a tf.distribute.experimental.partitioners.Partitioner "
                f"such as MinSizePartitioner(...), got {variable_partitioner!r}."
            )
        versions.warn_if_untested(_compat.CHECKED)  # a Keras or TensorFlow newer than any tested
        tf_logging.install()  # before TensorFlow's engine logs its connection lines
        resolver = cluster.resolve_cluster(cluster_resolver, parameter_servers=True)
        if resolver is None:
            raise cluster.ClusterConfigError(
                "AsyncReplicatorStrategy needs a cluster of one chief, workers and parameter servers "
                '("ps"), described by TF_CONFIG (e.g. keras-replicator launch --workers 2 --ps 1 '
                "train.py), Slurm or a cluster_resolver; none was found."
            )
        if resolver.task_type in ("worker", "ps"):
            _serve(resolver, startup_timeout, shutdown_grace)  # never returns
        spec = resolver.cluster_spec()
        self._kr_names = cluster.task_names(spec)
        self._kr_failure_timeout = failure_timeout
        self._kr_ps_down_since: dict[str, float] = {}
        self._kr_ps_last_probe = 0.0
        self._wait_for_tasks(spec, startup_timeout)
        super().__init__(resolver, variable_partitioner=variable_partitioner)
        self._kr_coordinator = tf.distribute.coordinator.ClusterCoordinator(self)
        # fit/evaluate/predict of its models go to parameter_server; partitioned
        # variables read as whole arrays.
        _compat.install(sharded_variable_reads=variable_partitioner is not None)
        _announce.announce_async(self.num_workers, self.num_ps)

    def _wait_for_tasks(self, spec: tf.train.ClusterSpec, timeout: float) -> None:
        """Waits until every worker and parameter server listens; names those that do not."""
        tasks = [(job, i, a) for job in ("worker", "ps") for i, a in enumerate(spec.job_tasks(job))]
        deadline = time.monotonic() + timeout
        while True:
            silent = [(job, i, a) for job, i, a in tasks if not _reachable(a)]
            if not silent:
                return
            if time.monotonic() > deadline:
                names = [self._kr_names[f"/job:{job}/replica:0/task:{i}"] for job, i, _ in silent]
                raise cluster.ClusterStartupError(
                    f"The chief could not reach {' and '.join(names)} within startup_timeout="
                    f"{timeout:g} s. Start every task with the same cluster (the same script: "
                    "AsyncReplicatorStrategy() serves on workers and parameter servers), and check "
                    "that the addresses are reachable from the chief."
                )
            time.sleep(0.5)

    # --- where am I --------------------------------------------------------------

    @property
    def coordinator(self) -> tf.distribute.coordinator.ClusterCoordinator:
        """The `tf.distribute.coordinator.ClusterCoordinator` that schedules steps onto workers."""
        return self._kr_coordinator

    @property
    def num_workers(self) -> int:
        """Number of worker tasks (the chief and parameter servers not counted)."""
        return self.cluster_resolver.cluster_spec().num_tasks("worker")

    @property
    def num_ps(self) -> int:
        """Number of parameter servers."""
        return self.cluster_resolver.cluster_spec().num_tasks("ps")

    @property
    def is_chief(self) -> bool:
        """Always True: only the chief gets a strategy (workers and ps serve and exit)."""
        return True

    @property
    def cluster_resolver(self) -> tf.distribute.cluster_resolver.ClusterResolver:
        """The resolver of the job's cluster."""
        return self._cluster_resolver

    def __repr__(self) -> str:
        return f"AsyncReplicatorStrategy(num_workers={self.num_workers}, num_ps={self.num_ps})"

    # --- parameter servers lost -----------------------------------------------------

    def _parameter_server_addresses(self) -> dict[str, str]:
        spec = self._cluster_resolver.cluster_spec()
        return {f"/job:ps/replica:0/task:{i}": a for i, a in enumerate(spec.job_tasks("ps"))}

    def _lost_parameter_servers(self) -> list[str]:
        return [t for t, a in self._parameter_server_addresses().items() if not _reachable(a, 2.0)]

    def _check_parameter_servers(self) -> None:
        """Raises ParameterServerLostError once a ps was unreachable for failure_timeout s.

        Called by fit while it waits for steps (every second at most): TensorFlow
        alone may retry a lost parameter server's steps for a long time.
        """
        now = time.monotonic()
        if now - self._kr_ps_last_probe < 1.0:
            return
        self._kr_ps_last_probe = now
        lost = set(self._lost_parameter_servers())
        for task in list(self._kr_ps_down_since):
            if task not in lost:
                del self._kr_ps_down_since[task]
        for task in lost:
            self._kr_ps_down_since.setdefault(task, now)
        expired = sorted(t for t, since in self._kr_ps_down_since.items() if now - since >= self._kr_failure_timeout)
        if expired:
            raise self._ps_error(expired, f"unreachable for failure_timeout={self._kr_failure_timeout:g} s")

    def _ps_error(self, tasks, how: str, error: Exception | None = None) -> ParameterServerLostError:
        names = [self._kr_names[t] for t in tasks]
        said = f" TensorFlow said: {_first_line(error)}" if error is not None else ""
        return ParameterServerLostError(
            f"Lost {' and '.join(names)} ({how}): the variables it held are gone, so training "
            "stopped. Restart every task of the job; keras.callbacks.BackupAndRestore resumes from "
            f"the last saved epoch.{said}",
            names,
        )

    def _parameter_server_lost_error(self, error: Exception) -> ParameterServerLostError | None:
        """A ParameterServerLostError if `error` came from a lost parameter server, else None."""
        if not isinstance(error, (tf.errors.OpError, RuntimeError, TypeError)):
            return None
        lost = self._lost_parameter_servers()
        if not lost:
            return None
        return self._ps_error(lost, "it does not answer", error)

    # --- input ------------------------------------------------------------------------

    def distribute_dataset(
        self,
        dataset_fn: Callable[[tf.distribute.InputContext], tf.data.Dataset],
        *,
        per_replica_batch_size: int | None = None,
        options: tf.distribute.InputOptions | None = None,
    ) -> AsyncDataset:
        """Builds `dataset_fn`'s pipeline on every worker, for `model.fit`.

        Each worker calls `dataset_fn(input_context)` and reads its own stream;
        the chief never sees the data. Nothing coordinates the workers' streams
        (it is the asynchronous regime): shuffle without a fixed seed, or each
        worker reads the same order. A finite dataset is repeated: an epoch is
        `steps_per_epoch` steps, whichever workers run them.

        Example:
            ```python
            def dataset_fn(input_context):
                return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x))

            train = strategy.distribute_dataset(dataset_fn, per_replica_batch_size=64)
            model.fit(train, epochs=3, steps_per_epoch=100)
            ```

        Args:
            dataset_fn: `input_context -> tf.data.Dataset` of single examples
                (`(x, y)` or `(x, y, sample_weight)`), or of batches when
                `per_replica_batch_size` is `None`. Called once on the chief to
                check it (tf.data builds lazily: nothing is read there).
            per_replica_batch_size: the batch size of each step of each replica;
                `None` if `dataset_fn` batches itself.
            options: `tf.distribute.InputOptions` for the per-worker pipeline.

        Returns:
            An `AsyncDataset` to pass to `model.fit`.

        Raises:
            ArgumentError: (a `ValueError` and a `TypeError`) `dataset_fn` is not
                callable or returns no `tf.data.Dataset`, or returns a batched dataset
                with a `per_replica_batch_size`, or an unbatched one without.
        """
        if not callable(dataset_fn) or isinstance(dataset_fn, tf.data.Dataset):
            raise ArgumentError(
                "dataset_fn must be a function input_context -> tf.data.Dataset (each worker calls "
                f"it to build its own pipeline), got {dataset_fn!r}."
            )
        per_replica_batch_size = check_int(
            "per_replica_batch_size", per_replica_batch_size, minimum=1, optional=True
        )
        if options is not None and not isinstance(options, tf.distribute.InputOptions):
            raise ArgumentError(f"options must be a tf.distribute.InputOptions, got {options!r}.")
        context = tf.distribute.InputContext(
            num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=self.num_replicas_in_sync
        )
        probe = dataset_fn(context)
        if not isinstance(probe, tf.data.Dataset):
            raise ArgumentError(f"dataset_fn must return a tf.data.Dataset, it returned {type(probe).__name__}.")
        found = tf_data.find_batch(probe)
        if per_replica_batch_size is not None and found is not None:
            raise ArgumentError(
                f"dataset_fn returns a dataset batched by {found[0]} (it ends with .batch()), and "
                f"per_replica_batch_size={per_replica_batch_size} asks to batch it again. Return "
                "single examples from dataset_fn, or drop per_replica_batch_size."
            )
        if per_replica_batch_size is None and found is None:
            raise ArgumentError(
                "dataset_fn returns single examples (no .batch() at its end) and no "
                "per_replica_batch_size was given: pass per_replica_batch_size=..., or batch in "
                "dataset_fn."
            )

        # Decided here, eagerly, from the probe (on the workers the pipeline is traced).
        finite = int(probe.cardinality()) != tf.data.INFINITE_CARDINALITY

        def per_replica_dataset(input_context):
            dataset = dataset_fn(input_context)
            if per_replica_batch_size is not None:
                dataset = dataset.batch(per_replica_batch_size, drop_remainder=True)
            if finite:
                dataset = dataset.repeat()
            return dataset.prefetch(tf.data.AUTOTUNE)

        element_spec = per_replica_dataset(context).element_spec

        def per_worker_dataset():
            return self.distribute_datasets_from_function(per_replica_dataset, options)

        return AsyncDataset(self, self.coordinator.create_per_worker_dataset(per_worker_dataset), element_spec)


def _first_line(error: Exception) -> str:
    text = str(getattr(error, "message", error)).strip()
    return text.splitlines()[0].strip() if text else type(error).__name__
