"""tf.data internals that keras_replicator.data needs and tf.data has no public API for.

Which batch transformation a dataset ends with (to tell batched from unbatched
input), how many files it reads (to choose file or data sharding before any
work), TensorFlow's file-sharding rewrite itself (`_AutoShardDataset`), and the
cardinality a distributed dataset reports, the reshuffling shuffles a pipeline
reads from (to advance their seeds when a run resumes). All read the Python
objects tf.data builds (`_input_dataset`, `_inputs()`, `_batch_size`,
`_filenames`, `_map_func`, `_reshuffle_each_iteration`, `_cardinality`), stable
since TF 2.4; checked on TensorFlow 2.16-2.21.
"""

from __future__ import annotations

import re

import tensorflow as tf
from tensorflow.python.data.experimental.ops import distribute as data_distribute

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
_READER_OP = re.compile(r"^(ArrayRecord|FixedLengthRecord|RecordIO|SSTable|TextLine|TFRecord)Dataset(V\d+)?$")


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


def reshuffling_shuffles(dataset: tf.data.Dataset) -> list[tf.data.Dataset]:
    """The ``shuffle(..., reshuffle_each_iteration=True)`` datasets ``dataset`` reads from.

    Found through every transformation's inputs (``_inputs()``), each once; not inside
    the functions of ``interleave``/``flat_map`` (those are remade per element).
    """
    found, seen, stack = [], set(), [dataset]
    while stack:
        ds = _unwrap_dataset(stack.pop())
        if id(ds) in seen:
            continue
        seen.add(id(ds))
        if type(ds).__name__ == "_ShuffleDataset" and getattr(ds, "_reshuffle_each_iteration", False):
            found.append(ds)
        try:
            stack.extend(ds._inputs())
        except (AttributeError, NotImplementedError):
            continue
    return found
