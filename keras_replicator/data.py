"""Input pipelines for replicated training: sharding, batch semantics, uneven batches.

``ReplicatorStrategy.distribute_dataset`` (or `distribute_dataset`, for any
``tf.distribute`` strategy) turns one dataset, or one TF-Replicator style
``input_fn(input_context)``, into what ``model.fit`` and ``strategy.run`` loops
consume, with these guarantees:

* **Exactly once.** Over one epoch of a finite dataset, every example goes to
  exactly one replica of one worker. With ``drop_remainder=False`` (the
  default) nothing is dropped. On one worker, global batch ``t`` is split into
  contiguous slices in replica order (replica 0 gets the first rows); with data
  sharding across ``W`` workers, slice ``j`` goes to worker ``j % W``
  (TensorFlow's layout, which Keras's multi-worker ``predict`` puts back in order).
* **No empty replica.** A short last batch is re-cut with the one before (62 + 4, not
  64 + 2, on 4 replicas); with ``padding=True``, batches stay as they come and a replica
  that would get no example gets a padding row (`kr.real_rows`). Without it, a dataset
  (or a worker's share) smaller than the replicas leaves the last ones empty.
* **Sharding across input pipelines** (one per worker): by file when the data is read
  from at least as many files as there are pipelines, else by data (every pipeline
  reads the data and keeps its slice of every global batch: the same steps everywhere).
* **Errors before any step**: batch sizes that do not divide, a batched
  dataset whose batch disagrees, too few files for file sharding, an infinite
  dataset given to Keras without a step count.
* **Speed**: autotuned ``tf.data``; over the CPU replicas of one worker, one host
  iterator for all replicas; elsewhere, prefetching to every replica's device.

``model.fit(x, y)`` (arrays, a batched dataset) under a ``ReplicatorStrategy`` goes through the
same machinery (``experimental_distribute_dataset``), without TensorFlow's AUTO->DATA warning.

Example:
    ```python
    import keras, numpy as np, tensorflow as tf
    import keras_replicator as kr

    kr.simulate_devices(4)
    strategy = kr.ReplicatorStrategy()
    x = np.random.rand(450, 8).astype("float32")
    y = np.random.rand(450, 1).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y))      # unbatched
    train = strategy.distribute_dataset(dataset, global_batch_size=64)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    model.fit(train, epochs=2, verbose=0)    # 8 steps per epoch, all 450 examples
    ```
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from keras_replicator import input_pipeline, resume
from keras_replicator._compat import host_iterator, short_batches, tf_data
from keras_replicator._validation import ArgumentError, check_bool, check_choice, check_int

__all__ = [
    "SHARD_POLICIES",
    "DatasetOrFn",
    "InputFn",
    "distribute_batched_dataset",
    "distribute_dataset",
    "make_input_fn",
    "pipeline_seed",
]

SHARD_POLICIES = ("auto", "file", "data", "off")
"""The values ``shard_policy`` accepts."""

DatasetOrFn = tf.data.Dataset | Callable[[tf.distribute.InputContext], tf.data.Dataset]
"""A ``tf.data.Dataset``, or a function ``input_fn(input_context) -> tf.data.Dataset``."""


# --- argument checks ------------------------------------------------------------


def _check_one_batch_size(global_batch_size, per_replica_batch_size) -> None:
    if (global_batch_size is None) == (per_replica_batch_size is None):
        raise ArgumentError(
            "Give exactly one of global_batch_size and per_replica_batch_size "
            f"(got global_batch_size={global_batch_size!r}, "
            f"per_replica_batch_size={per_replica_batch_size!r}); the other is derived from "
            "the number of replicas."
        )


def _resolve_global_batch(global_batch_size, per_replica_batch_size, num_replicas: int) -> int:
    """The global batch over ``num_replicas`` (the batch sizes given are already checked)."""
    if per_replica_batch_size is not None:
        return int(per_replica_batch_size) * num_replicas
    global_batch_size = int(global_batch_size)
    if global_batch_size % num_replicas:
        lower = (global_batch_size // num_replicas) * num_replicas
        upper = lower + num_replicas
        suggestion = f"{lower} or {upper}" if lower else f"{upper}"
        raise ArgumentError(
            f"global_batch_size={global_batch_size} is not divisible by the {num_replicas} "
            f"replicas, so replicas would get different batch sizes. Use a multiple of "
            f"{num_replicas} such as {suggestion}, or give per_replica_batch_size instead."
        )
    return global_batch_size


# --- seeds ----------------------------------------------------------------------


def pipeline_seed(seed: int, input_context: tf.distribute.InputContext) -> int:
    """A shuffle seed for one input pipeline, derived from a run's ``seed``.

    Different pipelines (workers) get different, decorrelated seeds; the same
    ``seed`` and pipeline always give the same value, so a run is reproducible.
    Use it for the shuffles inside an ``input_fn`` whose pipelines read
    different data (file sharding). Pipelines that read the same data and keep
    different slices of it must shuffle with the same seed instead.

    Example:
        ```python
        def input_fn(ctx):
            files = tf.data.Dataset.list_files(pattern, shuffle=False)
            files = files.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
            ds = files.interleave(tf.data.TFRecordDataset)
            return ds.shuffle(10_000, seed=kr.data.pipeline_seed(42, ctx))
        ```

    Args:
        seed: the run's seed, an integer.
        input_context: the ``tf.distribute.InputContext`` given to the ``input_fn``.

    Returns:
        A seed in ``[0, 2**31)``.
    """
    check_int("seed", seed)
    state = np.random.SeedSequence([int(seed) & 0xFFFF_FFFF, input_context.input_pipeline_id])
    return int(state.generate_state(1, dtype=np.uint32)[0] & 0x7FFF_FFFF)


# --- planning one pipeline --------------------------------------------------------


def _policy_from_options(dataset: tf.data.Dataset) -> str | None:
    """The shard policy a dataset's ``tf.data.Options`` ask for (``None``: HINT, unsupported)."""
    policy = dataset.options().experimental_distribute.auto_shard_policy
    P = tf.data.experimental.AutoShardPolicy
    mapping = {P.OFF: "off", P.AUTO: "auto", P.FILE: "file", P.DATA: "data"}
    return mapping.get(policy)


def _choose_policy(policy: str, dataset: tf.data.Dataset, from_fn: bool, pipelines: int) -> str:
    if policy == "auto":
        if from_fn or pipelines == 1:
            return "off"  # an input_fn shards itself with its input_context
        files = tf_data.count_source_files(dataset)
        return "file" if files is not None and files >= pipelines else "data"
    if policy == "file":
        files = tf_data.count_source_files(dataset)
        if files is None:
            raise ArgumentError(
                "shard_policy='file' could not find the files this dataset reads (it looks for "
                "TFRecordDataset, TextLineDataset or FixedLengthRecordDataset, directly or inside "
                "interleave/flat_map, under element-wise transformations). Use shard_policy='data'."
            )
        if files < pipelines:
            source = "does not read files" if files == 0 else f"reads only {files} file(s)"
            raise ArgumentError(
                f"shard_policy='file' needs at least one file per input pipeline ({pipelines}), "
                f"but the dataset {source}. Split the data into more files, or use "
                "shard_policy='data' (or 'auto', which picks it)."
            )
    return policy


def _check_context(input_context: tf.distribute.InputContext) -> int:
    num_replicas = int(input_context.num_replicas_in_sync)
    pipelines = int(input_context.num_input_pipelines)
    if num_replicas % pipelines:
        raise ArgumentError(f"{num_replicas} replicas cannot be shared evenly by {pipelines} input pipelines.")
    return num_replicas // pipelines


def _shuffle_seed(seed: int | None, shuffles: bool, slice_level: bool, input_context) -> int | None:
    """The seed of one pipeline's shuffle: the run's seed with data sharding, else its own."""
    if not shuffles:
        return None
    if slice_level:
        if seed is None:
            raise ArgumentError(
                "With data sharding every input pipeline reads all the data and keeps its "
                "own slice of each global batch, so all must shuffle identically: give seed=."
            )
        return seed
    return None if seed is None else pipeline_seed(seed, input_context)


@dataclasses.dataclass(frozen=True)
class InputFn:
    """The ``input_fn(input_context) -> tf.data.Dataset`` built by `make_input_fn`.

    Calling it builds one input pipeline's dataset of **per-replica** batches,
    as ``tf.distribute.Strategy.distribute_datasets_from_function`` expects:
    its replicas take consecutive elements, so element ``s * L + i`` (for ``L``
    replicas of the pipeline) is local replica ``i``'s slice of step ``s``. Its
    cardinality, when known, is the number of steps times ``L``. Its fields are
    the checked arguments of `make_input_fn` and never change; `plan` tells
    what a call does (the sharding applied, the batching) without building it.

    Example:
        ```python
        input_fn = kr.data.make_input_fn(dataset, global_batch_size=64)
        ctx = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=0,
                                         num_replicas_in_sync=4)
        pipeline_0 = input_fn(ctx)       # what worker 0's two replicas read
        input_fn.plan(ctx).sharding      # "data": both workers read it all, keep their slices
        ```
    """

    source: DatasetOrFn
    global_batch_size: int | None = None
    per_replica_batch_size: int | None = None
    shard_policy: str = "auto"
    drop_remainder: bool = False
    shuffle_buffer_size: int | None = None
    seed: int | None = None
    batched: bool | None = None
    padding: bool = False

    def global_batch(self, num_replicas: int) -> int:
        """The global batch size over ``num_replicas`` replicas (an error if they cannot share it)."""
        return _resolve_global_batch(self.global_batch_size, self.per_replica_batch_size, num_replicas)

    def _dataset(self, input_context: tf.distribute.InputContext) -> tf.data.Dataset:
        if isinstance(self.source, tf.data.Dataset):
            return self.source
        dataset = self.source(input_context)
        if not isinstance(dataset, tf.data.Dataset):
            raise ArgumentError(
                f"The input_fn must return a tf.data.Dataset, it returned {type(dataset).__name__}."
            )
        return dataset

    def _source_batch(self, dataset, from_fn: bool, global_batch: int, num_replicas: int):
        """``(batched, source_batch, source_drops)``, checked against the batch sizes asked for.

        An input_fn's batches are per replica (TensorFlow's convention).
        """
        per_replica = global_batch // num_replicas
        found = tf_data.find_batch(dataset)
        batched = self.batched if self.batched is not None else found is not None
        if not batched:
            return False, None, None
        source_batch, source_drops = found if found else (None, None)
        if source_batch is None:
            source_batch = _static_batch(dataset.element_spec)
        expected = per_replica if from_fn else global_batch
        if source_batch is not None and source_batch != expected:
            if from_fn:
                raise ArgumentError(
                    f"The input_fn returned a dataset batched by {source_batch}, but its batches must be "
                    f"per replica: {expected} (global batch {global_batch} over {num_replicas} replicas; "
                    f"input_context.get_per_replica_batch_size({global_batch}) gives it). Or return the "
                    "dataset unbatched and let distribute_dataset batch it."
                )
            raise ArgumentError(
                f"The dataset is already batched by {source_batch}, but the global batch size is "
                f"{global_batch} ({per_replica} per replica on {num_replicas} replicas). Batch it by "
                f"{global_batch}, or pass it unbatched and let distribute_dataset batch it."
            )
        _check_batch_dimension(dataset.element_spec)
        if self.shuffle_buffer_size is not None:
            raise ArgumentError(
                "shuffle_buffer_size shuffles examples before batching, but this dataset is already "
                "batched. Shuffle before your .batch(), or pass the dataset unbatched."
            )
        return True, source_batch, source_drops

    def plan(self, input_context: tf.distribute.InputContext) -> input_pipeline.Plan:
        """What the pipeline of ``input_context`` does, decided and checked before any step.

        Its ``sharding`` is the sharding applied (``"file"``, ``"data"`` or ``"off"``).
        """
        _check_context(input_context)
        num_replicas = int(input_context.num_replicas_in_sync)
        pipelines = int(input_context.num_input_pipelines)
        global_batch = self.global_batch(num_replicas)
        from_fn = not isinstance(self.source, tf.data.Dataset)
        dataset = self._dataset(input_context)
        batched, source_batch, source_drops = self._source_batch(dataset, from_fn, global_batch, num_replicas)
        policy = _choose_policy(self.shard_policy, dataset, from_fn, pipelines)
        slice_level = policy == "data" and pipelines > 1
        return input_pipeline.Plan(
            source=dataset,
            num_replicas=num_replicas,
            pipelines=pipelines,
            index=int(input_context.input_pipeline_id),
            policy=policy,
            global_batch=global_batch,
            source_batch=source_batch,
            source_drops=source_drops,
            batched=batched,
            from_fn=from_fn,
            drop=bool(self.drop_remainder),
            shuffle_buffer_size=self.shuffle_buffer_size,
            shuffle_seed=_shuffle_seed(self.seed, self.shuffle_buffer_size is not None, slice_level, input_context),
            pad=self.padding,
        )

    def __call__(self, input_context: tf.distribute.InputContext) -> tf.data.Dataset:
        return input_pipeline.build(self.plan(input_context))


def _static_batch(element_spec) -> int | None:
    return input_pipeline.static_batch(element_spec)


def _check_batch_dimension(element_spec) -> None:
    for spec in tf.nest.flatten(element_spec):
        if spec is not None and getattr(spec, "shape", None) is not None and spec.shape.rank == 0:
            raise ArgumentError(
                "The dataset is treated as batched but has scalar components "
                f"({element_spec}); pass batched=False if it is not batched."
            )


@dataclasses.dataclass(frozen=True)
class _KerasInputFn:
    """The input_fn for a dataset Keras batched (``experimental_distribute_dataset``)."""

    dataset: tf.data.Dataset
    #: Keras's epoch iterator distributes it: slices with their real rows (`_compat.short_batches`).
    pad: bool = False

    def plan(self, input_context: tf.distribute.InputContext) -> input_pipeline.Plan:
        _check_context(input_context)
        pipelines = int(input_context.num_input_pipelines)
        found = tf_data.find_batch(self.dataset)
        source_batch, source_drops = found if found else (_static_batch(self.dataset.element_spec), None)
        policy = _choose_policy(_policy_from_options(self.dataset), self.dataset, False, pipelines)
        if pipelines > 1 and policy in ("file", "off") and source_batch is None:
            policy = "data"  # batches of unknown size cannot be re-batched per pipeline
        return input_pipeline.Plan(
            source=self.dataset,
            num_replicas=int(input_context.num_replicas_in_sync),
            pipelines=pipelines,
            index=int(input_context.input_pipeline_id),
            policy=policy,
            global_batch=source_batch,
            source_batch=source_batch,
            source_drops=source_drops,
            batched=True,
            from_fn=False,
            drop=False,
            pad=self.pad and not _divides(self.dataset.element_spec, int(input_context.num_replicas_in_sync)),
        )

    def __call__(self, input_context: tf.distribute.InputContext) -> tf.data.Dataset:
        return input_pipeline.build(self.plan(input_context))


def _divides(element_spec, num_replicas: int) -> bool:
    """Every batch's rows divide evenly among the replicas (a static batch size that is a multiple)."""
    size = _static_batch(element_spec)
    return size is not None and size > 0 and size % num_replicas == 0


def make_input_fn(
    dataset_or_fn: DatasetOrFn,
    *,
    global_batch_size: int | None = None,
    per_replica_batch_size: int | None = None,
    shard_policy: str = "auto",
    drop_remainder: bool | None = None,
    shuffle_buffer_size: int | None = None,
    seed: int | None = None,
    batched: bool | None = None,
    padding: bool = False,
) -> InputFn:
    """The ``input_fn`` behind `distribute_dataset`, for use with any strategy.

    ``strategy.distribute_datasets_from_function(make_input_fn(...))`` gives the
    same data as ``distribute_dataset``; calling the result with a
    ``tf.distribute.InputContext`` shows what one input pipeline (worker) reads.
    Arguments as for `distribute_dataset`, checked here once; those that need
    the number of replicas are checked when the function is called.

    Example:
        ```python
        input_fn = kr.data.make_input_fn(dataset, per_replica_batch_size=16)
        train = strategy.distribute_datasets_from_function(input_fn)
        ```

    Returns:
        An `InputFn`.
    """
    if not isinstance(dataset_or_fn, tf.data.Dataset) and not callable(dataset_or_fn):
        raise ArgumentError(
            "distribute_dataset takes a tf.data.Dataset or a function input_fn(input_context) -> "
            f"tf.data.Dataset, got {type(dataset_or_fn).__name__}."
        )
    if isinstance(dataset_or_fn, tf.distribute.DistributedDataset):
        raise ArgumentError("This dataset is already distributed; pass the tf.data.Dataset it came from.")
    check_int("global_batch_size", global_batch_size, minimum=1, optional=True)
    check_int("per_replica_batch_size", per_replica_batch_size, minimum=1, optional=True)
    _check_one_batch_size(global_batch_size, per_replica_batch_size)
    check_choice(
        "shard_policy", shard_policy.lower() if isinstance(shard_policy, str) else shard_policy,
        SHARD_POLICIES,
    )
    check_bool("drop_remainder", drop_remainder, optional=True)
    check_bool("batched", batched, optional=True)
    check_bool("padding", padding)
    check_int("shuffle_buffer_size", shuffle_buffer_size, minimum=1, optional=True)
    check_int("seed", seed, optional=True)
    return InputFn(
        source=dataset_or_fn,
        global_batch_size=None if global_batch_size is None else int(global_batch_size),
        per_replica_batch_size=None if per_replica_batch_size is None else int(per_replica_batch_size),
        shard_policy=shard_policy.lower(),
        drop_remainder=bool(drop_remainder) if drop_remainder is not None else False,
        shuffle_buffer_size=None if shuffle_buffer_size is None else int(shuffle_buffer_size),
        seed=None if seed is None else int(seed),
        batched=None if batched is None else bool(batched),
        padding=bool(padding),
    )


def _check_options(options) -> None:
    if options is not None and not isinstance(options, tf.distribute.InputOptions):
        raise ArgumentError(f"options must be a tf.distribute.InputOptions, got {options!r}.")
    if options is not None and (
        options.experimental_replication_mode != tf.distribute.InputReplicationMode.PER_WORKER
    ):
        raise ArgumentError("distribute_dataset needs InputReplicationMode.PER_WORKER (the default).")


def _distribute(
    strategy: tf.distribute.Strategy, input_fn: InputFn | _KerasInputFn, options
) -> tf.distribute.DistributedDataset:
    """``distribute_datasets_from_function``, with the number of steps as its cardinality.

    Its cardinality counts per-replica elements; divided by the replicas of the
    pipeline TensorFlow built here (the last one it asked for), it is the steps.
    """
    contexts, plans, datasets = [], [], []

    def pipeline(input_context: tf.distribute.InputContext) -> tf.data.Dataset:
        contexts.append(input_context)
        plans.append(input_fn.plan(input_context))
        datasets.append(input_pipeline.build(plans[-1]))
        return datasets[-1]

    # Over the CPU replicas of one worker, one host iterator for all of them (_compat.host_iterator).
    options = host_iterator.options_for(strategy, options)
    distributed = strategy.distribute_datasets_from_function(pipeline, options)
    cardinality = int(distributed.cardinality)
    if cardinality > 0 and contexts:
        local = _check_context(contexts[-1])
        tf_data.set_distributed_cardinality(distributed, np.int64(cardinality // local))
    if plans:  # what a backup records to resume at the same example (keras_replicator.resume)
        plan = plans[-1]
        position = resume.InputPosition(plan.global_batch, plan.pipelines, plan.pipelines == 1 or plan.slice_level)
        resume.record_pipelines(distributed, position, datasets)
    return distributed


def distribute_dataset(
    strategy: tf.distribute.Strategy,
    dataset_or_fn: DatasetOrFn,
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
    """Distributes a dataset or an ``input_fn`` over the replicas of ``strategy``.

    Usually called as ``strategy.distribute_dataset(...)`` on a
    `ReplicatorStrategy`; this function works with any
    ``tf.distribute`` strategy that has ``distribute_datasets_from_function``.

    Example:
        ```python
        # An unbatched dataset: batched, sharded and split for you.
        train = strategy.distribute_dataset(dataset.shuffle(450), global_batch_size=64)
        model.fit(train, epochs=1, verbose=0)

        # A TF-Replicator input_fn: called once per input pipeline (worker), with its context.
        def input_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
            return dataset.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        train = strategy.distribute_dataset(input_fn, per_replica_batch_size=16)
        model.fit(train, epochs=1, verbose=0)
        ```

    Args:
        strategy: the strategy whose replicas consume the data.
        dataset_or_fn: an unbatched ``tf.data.Dataset``; or one batched by the
            global batch size (detected from its last ``batch``, see
            ``batched``); or a function ``input_fn(input_context)`` returning
            this pipeline's dataset, unbatched or batched per replica (the
            ``tf.distribute`` convention). ``input_context`` is a
            ``tf.distribute.InputContext`` with ``num_input_pipelines``,
            ``input_pipeline_id`` and ``num_replicas_in_sync``.
        global_batch_size: examples per step over all replicas of all workers;
            must be divisible by ``strategy.num_replicas_in_sync``.
        per_replica_batch_size: examples per step on each replica. Give exactly
            one of the two batch sizes.
        shard_policy: how input pipelines (one per worker) share the data.
            ``"auto"``: by file when the dataset reads at least as many files as
            there are pipelines, else by data; for an ``input_fn``, no sharding
            (it shards itself with its ``input_context``). ``"file"``: each
            pipeline reads its own files (an error if there are too few).
            ``"data"``: each pipeline reads all the data and keeps its slice of
            every global batch. ``"off"``: every pipeline reads everything and
            keeps all of it (each worker then sees every example). On one
            worker there is one pipeline and nothing to shard.
        drop_remainder: ``False`` (default): every example is used once per
            epoch, the last batch may be smaller. ``True``: a last batch smaller
            than the batch size is dropped, and batches get a static shape.
        shuffle_buffer_size: if given, examples are shuffled (after file
            sharding, before batching) with this buffer, reshuffled every epoch.
        seed: seed of that shuffle. Pipelines holding different data (file
            sharding, an ``input_fn``) get different seeds derived from it
            (`pipeline_seed`); with data sharding all use it as is, as they
            must agree. Required for data sharding across several pipelines.
        batched: whether the dataset is already batched; ``None`` detects it
            from the dataset's last transformations.
        options: ``tf.distribute.InputOptions``; by default TensorFlow prefetches
            each replica's slice to its device, except over the CPU replicas of
            one worker, where one host iterator feeds them all (any options
            given bring back TensorFlow's per-device pipelines).
        padding: ``False``: a short last batch is re-cut with the one before; a
            dataset with fewer examples than replicas leaves the last ones empty
            (a dense model trains; a convolution, an RNN or ``Add`` fails). ``True``:
            batches as they come, each element one that ``strategy.run`` takes
            apart; a replica without examples gets a padding row (`kr.real_rows`;
            divide a custom loop's loss sum by `kr.global_real_rows`).

    Returns:
        A ``tf.distribute.DistributedDataset`` for ``model.fit/evaluate/predict``
        and for ``for batch in ...: strategy.run(step, args=(batch,))`` loops.
        Each element gives every replica its slice of one global batch.

    Raises:
        ValueError: bad batch sizes, policy or options; a batched dataset whose
            batch disagrees; too few files for ``shard_policy="file"``.
        TypeError: arguments of the wrong type.
    """
    if not isinstance(strategy, tf.distribute.Strategy):
        raise ArgumentError(f"strategy must be a tf.distribute.Strategy, got {strategy!r}.")
    input_fn = make_input_fn(
        dataset_or_fn,
        global_batch_size=global_batch_size,
        per_replica_batch_size=per_replica_batch_size,
        shard_policy=shard_policy,
        drop_remainder=drop_remainder,
        shuffle_buffer_size=shuffle_buffer_size,
        seed=seed,
        batched=batched,
        padding=padding,
    )
    input_fn.global_batch(strategy.num_replicas_in_sync)  # divisible: an error before any work
    _check_options(options)
    return _distribute(strategy, input_fn, options)


def distribute_batched_dataset(
    strategy: tf.distribute.Strategy,
    dataset: tf.data.Dataset,
    options: tf.distribute.InputOptions | None = None,
) -> tf.distribute.DistributedDataset | None:
    """``experimental_distribute_dataset`` for ``ReplicatorStrategy`` (what Keras calls).

    ``dataset`` is batched by the global batch size (Keras batches NumPy input by
    ``batch_size``); its sharding policy comes from its ``tf.data.Options``
    (Keras sets DATA for NumPy, AUTO otherwise). Returns ``None`` for datasets
    this module does not handle (components without a batch dimension, sparse
    tensors), which the caller then gives to TensorFlow's own implementation.

    Example:
        ```python
        dist = kr.data.distribute_batched_dataset(strategy, dataset.batch(64))
        ```
    """
    if not isinstance(dataset, tf.data.Dataset) or not input_pipeline.leaves_supported(dataset.element_spec):
        return None
    if options is not None and (
        options.experimental_replication_mode != tf.distribute.InputReplicationMode.PER_WORKER
    ):
        return None
    if _policy_from_options(dataset) is None:
        return None
    _check_options(options)
    pad = short_batches.wanted() and getattr(strategy, "_keras_replicator", False)
    return _distribute(strategy, _KerasInputFn(dataset, pad=pad), options)
