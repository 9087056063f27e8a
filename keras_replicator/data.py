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
* **No empty replica.** TensorFlow splits a short last batch so that some
  replicas may get no example at all (450 examples, global batch 64, 4
  replicas: the last batch of 2 leaves two replicas empty), which breaks
  oneDNN convolutions on CPU and wastes a step. Here the last two batches are
  re-cut (62 + 4 instead of 64 + 2) so that every replica gets at least one
  example whenever the pipeline has at least as many examples as replicas.
  Slices of one batch differ in size by at most one.
* **Sharding across input pipelines** (one per worker): by file when the data
  is read from at least as many files as there are pipelines, else by data
  (every pipeline reads the data and keeps its own slice of every global batch,
  so all workers run the same number of steps).
* **Errors before any step**: batch sizes that do not divide, a batched
  dataset whose batch disagrees, too few files for file sharding, an infinite
  dataset given to Keras without a step count.
* **Speed**: autotuned ``tf.data`` and prefetching to every replica's device.

``model.fit(x, y)`` with NumPy arrays or an ordinary batched dataset under a
``ReplicatorStrategy`` goes through the same machinery (the strategy's
``experimental_distribute_dataset``), without TensorFlow's AUTO->DATA sharding
warning.

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

from keras_replicator._compat import tf_data
from keras_replicator._validation import check_bool, check_choice, check_int

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

_AUTOTUNE = tf.data.AUTOTUNE


# --- argument checks ------------------------------------------------------------


def _resolve_global_batch(global_batch_size, per_replica_batch_size, num_replicas: int) -> int:
    if (global_batch_size is None) == (per_replica_batch_size is None):
        raise ValueError(
            "Give exactly one of global_batch_size and per_replica_batch_size "
            f"(got global_batch_size={global_batch_size!r}, "
            f"per_replica_batch_size={per_replica_batch_size!r}); the other is derived from "
            "the number of replicas."
        )
    if per_replica_batch_size is not None:
        return int(per_replica_batch_size) * num_replicas
    global_batch_size = int(global_batch_size)
    if global_batch_size % num_replicas:
        lower = (global_batch_size // num_replicas) * num_replicas
        upper = lower + num_replicas
        suggestion = f"{lower} or {upper}" if lower else f"{upper}"
        raise ValueError(
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


# --- splitting and re-cutting batches ----------------------------------------------


def _leaves_supported(element_spec) -> bool:
    specs = [s for s in tf.nest.flatten(element_spec) if s is not None]
    return bool(specs) and all(
        isinstance(s, (tf.TensorSpec, tf.RaggedTensorSpec)) and s.shape.rank is not None and s.shape.rank >= 1
        for s in specs
    )


def _recuttable(element_spec) -> bool:
    """Batches can be concatenated: dense components with fully known non-batch dimensions."""
    specs = [s for s in tf.nest.flatten(element_spec) if s is not None]
    return all(isinstance(s, tf.TensorSpec) and s.shape[1:].is_fully_defined() for s in specs)


def _rows(batch) -> tf.Tensor:
    """The number of examples in a batch (its first component's leading dimension)."""
    for t in tf.nest.flatten(batch):
        if isinstance(t, tf.RaggedTensor):
            return tf.cast(t.nrows(), tf.int64)
        if t is not None:
            return tf.shape(t, out_type=tf.int64)[0]
    raise ValueError("A batch must contain at least one tensor.")


def _map_leaves(fn, structure):
    return tf.nest.map_structure(lambda t: None if t is None else fn(t), structure)


def _recut_tail(batches: tf.data.Dataset, minimum: int) -> tf.data.Dataset:
    """Re-cuts a stream of batches so that each has at least ``minimum`` rows.

    Same rows in the same order. A batch smaller than ``minimum`` (the short
    last batch) is merged with the batch before it and the two are cut again:
    ``[..., 64, 2]`` becomes ``[..., 62, 4]`` for ``minimum=4``. Only when the
    whole stream has fewer than ``minimum`` rows does a smaller batch remain.
    Batches of ``minimum`` rows or more pass through without a copy.
    """
    spec = batches.element_spec
    empty = tf.nest.map_structure(
        lambda s: None if s is None else tf.zeros([0, *s.shape[1:].as_list()], s.dtype), spec
    )
    # zip, not map: map would unpack a batch that is a tuple.
    flags = tf.data.Dataset.from_tensors(False).repeat()
    stream = tf.data.Dataset.zip((batches, flags)).concatenate(
        tf.data.Dataset.from_tensors((empty, True))
    )
    minimum = tf.constant(minimum, tf.int64)

    def step(pending, item):
        current, at_end = item
        p, c = _rows(pending), _rows(current)
        plain = at_end | tf.equal(p, 0) | ((p >= minimum) & (c >= minimum))

        def pass_through():
            # At the end: emit what is pending (if any). First batch: keep it. Else emit pending,
            # keep current.
            emit_pending = tf.greater(p, 0)
            keep = tf.nest.map_structure(
                lambda e, cur: None if e is None else cur, empty, current
            )
            return pending, emit_pending, keep

        def merge():
            both = tf.nest.map_structure(
                lambda a, b: None if a is None else tf.concat([a, b], axis=0), pending, current
            )
            total = p + c
            cut = tf.where(total >= 2 * minimum, total - minimum, tf.constant(0, tf.int64))
            emitted = _map_leaves(lambda t: t[:cut], both)
            kept = _map_leaves(lambda t: t[cut:], both)
            return emitted, cut > 0, kept

        emitted, valid, kept = tf.cond(plain, pass_through, merge)
        return kept, (emitted, valid)

    def is_valid(emitted, valid):
        return valid

    def batch_of(emitted, valid):
        return emitted

    return stream.scan(empty, step).filter(is_valid).map(batch_of)


def _split(batches: tf.data.Dataset, num_slices: int, first: int, step: int, static_rows: int | None):
    """Splits every batch into ``num_slices`` contiguous slices; keeps ``first, first + step, ...``.

    Slice ``j`` of a batch of ``n`` rows has ``n // num_slices`` rows, one more for
    ``j < n % num_slices``; the slices of one batch together are the batch, in order.
    """
    leaves = [spec for spec in tf.nest.flatten(batches.element_spec) if spec is not None]
    if static_rows is not None and all(
        isinstance(spec, tf.TensorSpec) and spec.shape.rank and spec.shape[0] == num_slices * static_rows
        for spec in leaves
    ):
        # Dense batches of num_slices * static_rows rows: a reshape and an unbatch,
        # instead of a nested dataset per batch (measured: a few % of a small model's
        # step time on 2 cores).
        def as_slices(batch):
            def cut(t):
                shape = [num_slices, static_rows, *t.shape[1:]]
                t = tf.reshape(t, tf.concat([[num_slices, static_rows], tf.shape(t)[1:]], 0))
                return tf.ensure_shape(t, shape)[first::step]

            return _map_leaves(cut, batch)

        return tf.data.Dataset.zip((batches,)).map(as_slices).unbatch()

    num = tf.constant(num_slices, tf.int64)

    def slices(batch):
        n = _rows(batch)
        q, rem = n // num, n % num

        def one(j):
            start = j * q + tf.minimum(j, rem)
            size = q + tf.cast(j < rem, tf.int64)
            piece = _map_leaves(lambda t: t[start : start + size], batch)
            if static_rows is not None:
                piece = _map_leaves(
                    lambda t: tf.ensure_shape(t, [static_rows, *t.shape[1:]])
                    if isinstance(t, tf.Tensor)
                    else t,
                    piece,
                )
            return piece

        return tf.data.Dataset.range(first, num_slices, step).map(one)

    return tf.data.Dataset.zip((batches,)).flat_map(slices)  # zip: the batch arrives whole


# --- the per-pipeline input function --------------------------------------------


def _policy_from_options(dataset: tf.data.Dataset) -> str | None:
    """The shard policy a dataset's ``tf.data.Options`` ask for (``None``: HINT, unsupported)."""
    policy = dataset.options().experimental_distribute.auto_shard_policy
    P = tf.data.experimental.AutoShardPolicy
    mapping = {P.OFF: "off", P.AUTO: "auto", P.FILE: "file", P.DATA: "data"}
    return mapping.get(policy)


def _pipeline(
    dataset: tf.data.Dataset,
    input_context: tf.distribute.InputContext,
    *,
    global_batch: int | None,
    source_batch: int | None,
    source_drops: bool | None,
    from_fn: bool,
    batched: bool,
    policy: str,
    drop: bool,
    shuffle_buffer_size: int | None,
    seed: int | None,
) -> tf.data.Dataset:
    """One input pipeline's dataset of per-replica batches (arguments already checked)."""
    num_replicas = int(input_context.num_replicas_in_sync)
    pipelines = int(input_context.num_input_pipelines)
    index = int(input_context.input_pipeline_id)
    local = num_replicas // pipelines
    infinite = int(dataset.cardinality()) == tf.data.INFINITE_CARDINALITY

    if pipelines > 1 and policy in ("file", "off") and batched and global_batch is None:
        policy = "data"  # batches of unknown size cannot be re-batched per pipeline
    if policy == "file" and pipelines > 1:
        dataset = tf_data.auto_shard(dataset, pipelines, index, num_replicas)
    # Data sharding: every pipeline reads all global batches and keeps its replicas' slices,
    # so that all pipelines run the same number of steps.
    slice_level = policy == "data" and pipelines > 1
    if shuffle_buffer_size is not None:
        if slice_level:
            if seed is None:
                raise ValueError(
                    "With data sharding every input pipeline reads all the data and keeps its "
                    "own slice of each global batch, so all must shuffle identically: give seed=."
                )
        elif seed is not None:
            seed = pipeline_seed(seed, input_context)
        dataset = dataset.shuffle(shuffle_buffer_size, seed=seed, reshuffle_each_iteration=True)

    if global_batch is None:  # Keras's batches, as they come
        stream_batch = source_batch
    else:
        stream_batch = global_batch if slice_level else global_batch // pipelines
    if not batched:
        batches = dataset.batch(stream_batch, drop_remainder=drop)
        uniform = True
    elif stream_batch != source_batch if from_fn else (policy in ("file", "off") and pipelines > 1):
        # Per-replica batches of an input_fn, or one pipeline's share of global batches: re-batch.
        batches = dataset.rebatch(stream_batch, drop_remainder=drop)
        uniform = True
        known = _rebatched_count(int(dataset.cardinality()), source_batch, source_drops, stream_batch, drop)
        if known is not None:
            batches = batches.apply(tf.data.experimental.assert_cardinality(known))
    else:
        batches = dataset
        uniform = source_batch is not None
        if drop and not source_drops:
            size = tf.constant(stream_batch, tf.int64)

            def is_full(batch):
                return tf.equal(_rows(batch), size)

            def unwrap(batch):
                return batch

            # zip, not the dataset itself: filter and map would unpack a batch that is a tuple.
            batches = tf.data.Dataset.zip((batches,)).filter(is_full).map(unwrap)
            uniform = False

    if not _leaves_supported(batches.element_spec):
        raise TypeError(
            "distribute_dataset supports batches of dense or ragged tensors with a batch "
            f"dimension; got element_spec {batches.element_spec}."
        )
    threshold = num_replicas if slice_level else local
    count = int(batches.cardinality())
    if not (infinite or drop) and _recuttable(batches.element_spec):
        batches = _recut_tail(batches, threshold)
        # Re-cutting keeps the number of batches unless a short last batch had to be merged
        # whole into the one before it (only with batches of fewer than 2 x threshold rows).
        keeps_count = stream_batch is not None and stream_batch >= 2 * threshold
        if not (uniform and count >= 0 and (keeps_count or count <= 1)):
            count = tf.data.UNKNOWN_CARDINALITY
    # Slice j of a global batch goes to pipeline j % pipelines, as its local replica
    # j // pipelines: TensorFlow's own layout for data sharding, which Keras's multi-worker
    # predict (_multi_worker_concat) reassembles in order.
    first, step = (index, pipelines) if slice_level else (0, 1)
    per_replica = None if global_batch is None else global_batch // num_replicas
    static_rows = per_replica if (drop and uniform) else None
    pieces = _split(batches, threshold, first, step, static_rows)
    if infinite:
        pieces = pieces.apply(tf.data.experimental.assert_cardinality(tf.data.INFINITE_CARDINALITY))
    elif count >= 0:
        pieces = pieces.apply(tf.data.experimental.assert_cardinality(count * local))

    # distribute_datasets_from_function never auto-shards, so TensorFlow's AUTO->DATA warning
    # cannot occur. Order is TensorFlow's default; a user's explicit choice stays. Autotuning is
    # left unset (TensorFlow's default: on) so that ReplicatorStrategy can turn it off over CPU
    # replicas, where its thread stalled every epoch (issue 21, _compat/multi_device_iterator.py).
    current = pieces.options()
    options = tf.data.Options()
    if current.deterministic is None:
        options.deterministic = True
    return pieces.prefetch(_AUTOTUNE).with_options(options)


def _rebatched_count(cardinality: int, batch: int | None, exact: bool | None, new_batch: int, drop: bool):
    """Batches after re-batching ``cardinality`` batches of ``batch`` (the last maybe short), if certain."""
    if cardinality < 0 or batch is None:
        return None
    most = cardinality * batch
    least = most if exact or cardinality == 0 else most - batch + 1
    rounding = (lambda n: n // new_batch) if drop else (lambda n: -(-n // new_batch))
    return rounding(least) if rounding(least) == rounding(most) else None


def _choose_policy(policy: str, dataset: tf.data.Dataset, from_fn: bool, pipelines: int) -> str:
    if policy == "auto":
        if from_fn or pipelines == 1:
            return "off"  # an input_fn shards itself with its input_context
        files = tf_data.count_source_files(dataset)
        return "file" if files is not None and files >= pipelines else "data"
    if policy == "file":
        files = tf_data.count_source_files(dataset)
        if files is None:
            raise ValueError(
                "shard_policy='file' could not find the files this dataset reads (it looks for "
                "TFRecordDataset, TextLineDataset or FixedLengthRecordDataset, directly or inside "
                "interleave/flat_map, under element-wise transformations). Use shard_policy='data'."
            )
        if files < pipelines:
            source = "does not read files" if files == 0 else f"reads only {files} file(s)"
            raise ValueError(
                f"shard_policy='file' needs at least one file per input pipeline ({pipelines}), "
                f"but the dataset {source}. Split the data into more files, or use "
                "shard_policy='data' (or 'auto', which picks it)."
            )
    return policy


def _check_context(input_context: tf.distribute.InputContext) -> int:
    num_replicas = int(input_context.num_replicas_in_sync)
    pipelines = int(input_context.num_input_pipelines)
    if num_replicas % pipelines:
        raise ValueError(f"{num_replicas} replicas cannot be shared evenly by {pipelines} input pipelines.")
    return num_replicas // pipelines


@dataclasses.dataclass
class InputFn:
    """The ``input_fn(input_context) -> tf.data.Dataset`` built by `make_input_fn`.

    Calling it builds one input pipeline's dataset of **per-replica** batches,
    as ``tf.distribute.Strategy.distribute_datasets_from_function`` expects:
    its replicas take consecutive elements, so element ``s * L + i`` (for ``L``
    replicas of the pipeline) is local replica ``i``'s slice of step ``s``. Its
    cardinality, when known, is the number of steps times ``L``.

    Example:
        ```python
        input_fn = kr.data.make_input_fn(dataset, global_batch_size=64)
        ctx = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=0,
                                         num_replicas_in_sync=4)
        pipeline_0 = input_fn(ctx)       # what worker 0's two replicas read
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
    #: Set by a call: the number of replicas the pipeline built last feeds.
    local_replicas: int | None = dataclasses.field(default=None, init=False)
    #: Set by a call: the sharding applied last ("file", "data" or "off").
    applied_policy: str | None = dataclasses.field(default=None, init=False)

    def __call__(self, input_context: tf.distribute.InputContext) -> tf.data.Dataset:
        local = _check_context(input_context)
        num_replicas = int(input_context.num_replicas_in_sync)
        pipelines = int(input_context.num_input_pipelines)
        global_batch = _resolve_global_batch(self.global_batch_size, self.per_replica_batch_size, num_replicas)
        per_replica = global_batch // num_replicas

        from_fn = not isinstance(self.source, tf.data.Dataset)
        if from_fn:
            dataset = self.source(input_context)
            if not isinstance(dataset, tf.data.Dataset):
                raise TypeError(
                    f"The input_fn must return a tf.data.Dataset, it returned {type(dataset).__name__}."
                )
        else:
            dataset = self.source

        # Batched or not; an input_fn's batches are per replica (TensorFlow's convention).
        found = tf_data.find_batch(dataset)
        batched = self.batched if self.batched is not None else found is not None
        source_batch, source_drops = found if (found and batched) else (None, None)
        expected = per_replica if from_fn else global_batch
        if batched and source_batch is None:
            source_batch = _static_batch(dataset.element_spec)
        if batched and source_batch is not None and source_batch != expected:
            if from_fn:
                raise ValueError(
                    f"The input_fn returned a dataset batched by {source_batch}, but its batches must be "
                    f"per replica: {expected} (global batch {global_batch} over {num_replicas} replicas; "
                    f"input_context.get_per_replica_batch_size({global_batch}) gives it). Or return the "
                    "dataset unbatched and let distribute_dataset batch it."
                )
            raise ValueError(
                f"The dataset is already batched by {source_batch}, but the global batch size is "
                f"{global_batch} ({per_replica} per replica on {num_replicas} replicas). Batch it by "
                f"{global_batch}, or pass it unbatched and let distribute_dataset batch it."
            )
        if batched:
            _check_batch_dimension(dataset.element_spec)
        if self.shuffle_buffer_size is not None and batched:
            raise ValueError(
                "shuffle_buffer_size shuffles examples before batching, but this dataset is already "
                "batched. Shuffle before your .batch(), or pass the dataset unbatched."
            )
        policy = _choose_policy(self.shard_policy, dataset, from_fn, pipelines)
        self.local_replicas = local
        self.applied_policy = policy if pipelines > 1 else "off"
        return _pipeline(
            dataset,
            input_context,
            global_batch=global_batch,
            source_batch=source_batch if batched else None,
            source_drops=source_drops,
            from_fn=from_fn,
            batched=batched,
            policy=policy,
            drop=bool(self.drop_remainder),
            shuffle_buffer_size=self.shuffle_buffer_size,
            seed=self.seed,
        )


def _static_batch(element_spec) -> int | None:
    """The batch size all components agree on statically (``batch(n, drop_remainder=True)``)."""
    sizes = {s.shape[0] for s in tf.nest.flatten(element_spec) if s is not None and s.shape.rank}
    return sizes.pop() if len(sizes) == 1 and None not in sizes else None


def _check_batch_dimension(element_spec) -> None:
    for spec in tf.nest.flatten(element_spec):
        if spec is not None and getattr(spec, "shape", None) is not None and spec.shape.rank == 0:
            raise ValueError(
                "The dataset is treated as batched but has scalar components "
                f"({element_spec}); pass batched=False if it is not batched."
            )


@dataclasses.dataclass
class _KerasInputFn:
    """The input_fn for a dataset Keras batched (``experimental_distribute_dataset``)."""

    dataset: tf.data.Dataset
    local_replicas: int | None = None

    def __call__(self, input_context: tf.distribute.InputContext) -> tf.data.Dataset:
        self.local_replicas = _check_context(input_context)
        found = tf_data.find_batch(self.dataset)
        source_batch, source_drops = found if found else (_static_batch(self.dataset.element_spec), None)
        policy = _choose_policy(
            _policy_from_options(self.dataset), self.dataset, False, int(input_context.num_input_pipelines)
        )
        return _pipeline(
            self.dataset,
            input_context,
            global_batch=source_batch,
            source_batch=source_batch,
            source_drops=source_drops,
            from_fn=False,
            batched=True,
            policy=policy,
            drop=False,
            shuffle_buffer_size=None,
            seed=None,
        )


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
) -> InputFn:
    """The ``input_fn`` behind `distribute_dataset`, for use with any strategy.

    ``strategy.distribute_datasets_from_function(make_input_fn(...))`` gives the
    same data as ``distribute_dataset``; calling the result with a
    ``tf.distribute.InputContext`` shows what one input pipeline (worker) reads.
    Arguments as for `distribute_dataset`; those that need the number of
    replicas are checked when the function is called.

    Example:
        ```python
        input_fn = kr.data.make_input_fn(dataset, per_replica_batch_size=16)
        train = strategy.distribute_datasets_from_function(input_fn)
        ```

    Returns:
        An `InputFn`.
    """
    if not isinstance(dataset_or_fn, tf.data.Dataset) and not callable(dataset_or_fn):
        raise TypeError(
            "distribute_dataset takes a tf.data.Dataset or a function input_fn(input_context) -> "
            f"tf.data.Dataset, got {type(dataset_or_fn).__name__}."
        )
    if isinstance(dataset_or_fn, tf.distribute.DistributedDataset):
        raise TypeError("This dataset is already distributed; pass the tf.data.Dataset it came from.")
    check_int("global_batch_size", global_batch_size, minimum=1, optional=True)
    check_int("per_replica_batch_size", per_replica_batch_size, minimum=1, optional=True)
    if (global_batch_size is None) == (per_replica_batch_size is None):
        _resolve_global_batch(global_batch_size, per_replica_batch_size, 1)  # raises the message
    check_choice(
        "shard_policy", shard_policy.lower() if isinstance(shard_policy, str) else shard_policy,
        SHARD_POLICIES,
    )
    check_bool("drop_remainder", drop_remainder, optional=True)
    check_bool("batched", batched, optional=True)
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
    )


def _distribute(strategy: tf.distribute.Strategy, input_fn: InputFn, options) -> tf.distribute.DistributedDataset:
    if options is not None and not isinstance(options, tf.distribute.InputOptions):
        raise TypeError(f"options must be a tf.distribute.InputOptions, got {options!r}.")
    if options is not None and (
        options.experimental_replication_mode != tf.distribute.InputReplicationMode.PER_WORKER
    ):
        raise ValueError("distribute_dataset needs InputReplicationMode.PER_WORKER (the default).")
    distributed = strategy.distribute_datasets_from_function(input_fn, options)
    cardinality = int(distributed.cardinality)
    if cardinality > 0 and input_fn.local_replicas:
        tf_data.set_distributed_cardinality(distributed, np.int64(cardinality // input_fn.local_replicas))
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
) -> tf.distribute.DistributedDataset:
    """Distributes a dataset or an ``input_fn`` over the replicas of ``strategy``.

    Usually called as ``strategy.distribute_dataset(...)`` on a
    `ReplicatorStrategy`; this function works with any
    ``tf.distribute`` strategy that has ``distribute_datasets_from_function``.

    Example:
        ```python
        # An unbatched dataset: batched, sharded and split for you.
        train = strategy.distribute_dataset(dataset.shuffle(10_000), global_batch_size=256)

        # A TF-Replicator input_fn: called once per input pipeline (worker).
        def input_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
            return tfds.load("mnist", split="train", as_supervised=True,
                             read_config=tfds.ReadConfig(input_context=ctx))
        train = strategy.distribute_dataset(input_fn, per_replica_batch_size=64)
        model.fit(train, epochs=10)
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
            each replica's slice to its device.

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
        raise TypeError(f"strategy must be a tf.distribute.Strategy, got {strategy!r}.")
    input_fn = make_input_fn(
        dataset_or_fn,
        global_batch_size=global_batch_size,
        per_replica_batch_size=per_replica_batch_size,
        shard_policy=shard_policy,
        drop_remainder=drop_remainder,
        shuffle_buffer_size=shuffle_buffer_size,
        seed=seed,
        batched=batched,
    )
    _resolve_global_batch(global_batch_size, per_replica_batch_size, strategy.num_replicas_in_sync)
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
    if not isinstance(dataset, tf.data.Dataset) or not _leaves_supported(dataset.element_spec):
        return None
    if options is not None and (
        options.experimental_replication_mode != tf.distribute.InputReplicationMode.PER_WORKER
    ):
        return None
    if _policy_from_options(dataset) is None:
        return None
    return _distribute(strategy, _KerasInputFn(dataset), options)
