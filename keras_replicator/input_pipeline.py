"""One input pipeline as small steps composed in order, from a plan decided beforehand.

`keras_replicator.data` checks the arguments once and decides, for one input
pipeline (worker), a frozen `Plan`: the sharding, the batch sizes, whether to
batch, re-batch or keep the source's batches, the shuffle seed. `build` then
runs `STEPS` in order, each a small pure function ``step(stream, plan) ->
stream`` over a frozen `Stream` (the dataset and what the steps so far know of
its batches), as optax chains its transformations:

1. `shard_files`: keep this pipeline's files (file sharding);
2. `shuffle`: examples, before batching;
3. `batch`: batch, re-batch, or keep the source's batches (dropping short ones);
4. `check_components`: batches of dense or ragged tensors with a batch dimension;
5. `recut_tail`: no replica left empty by a short last batch (not when padding);
6. `split`: each batch into per-replica slices, this pipeline's only (with `Plan.pad`:
   each slice with its count of real rows, an empty one given a padding row:
   `_compat.short_batches`; without, a batch with fewer rows than slices leaves
   the last ones empty, as TensorFlow does);
7. `assert_cardinality`: the number of elements, when it is known;
8. `finish`: deterministic order unless chosen otherwise, prefetching.

Nothing here checks a user's argument: the plan is already valid.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import tensorflow as tf

from keras_replicator._compat import short_batches, tf_data
from keras_replicator._validation import ArgumentError

__all__ = ["STEPS", "Plan", "Stream", "build"]

# The functions given to tf.data below use TensorFlow's ops and no Python control flow over
# tensors, so AutoGraph has nothing to convert; tf.data converts every function by default,
# and that conversion was 18% of the CPU time of a first `fit` call on arrays (the peers' LM
# on 4 replicas, profiled 2026-12-07), paid again by every new pipeline.
_graph_function = tf.autograph.experimental.do_not_convert


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one input pipeline does, decided (and checked) before any step runs."""

    #: The dataset this pipeline reads (an input_fn's result for this pipeline).
    source: tf.data.Dataset
    num_replicas: int
    pipelines: int
    index: int
    #: "file", "data" or "off" (on one pipeline, nothing is sharded whatever it says).
    policy: str
    #: Examples per step over all replicas; None: Keras's batches, as they come.
    global_batch: int | None
    #: The source's batch size (None: unbatched, or not known).
    source_batch: int | None
    #: Whether the source's batching drops a short last batch (None: not known).
    source_drops: bool | None
    #: Whether the source is batched (an input_fn's per replica, a dataset's globally).
    batched: bool
    #: Whether the source is an input_fn's dataset.
    from_fn: bool
    drop: bool
    shuffle_buffer_size: int | None = None
    #: The seed of this pipeline's shuffle, already derived for it.
    shuffle_seed: int | None = None
    #: Slices as `short_batches.PaddedBatch` (Keras's batches, or ``padding=True``: no re-cut).
    pad: bool = False

    @property
    def local_replicas(self) -> int:
        return self.num_replicas // self.pipelines

    @property
    def sharding(self) -> str:
        """The sharding applied: the policy, or "off" on one pipeline."""
        return self.policy if self.pipelines > 1 else "off"

    @property
    def slice_level(self) -> bool:
        """Data sharding: every pipeline reads all global batches and keeps its replicas' slices."""
        return self.policy == "data" and self.pipelines > 1

    @property
    def stream_batch(self) -> int | None:
        """The batch size of the stream this pipeline splits."""
        if self.global_batch is None:
            return self.source_batch
        return self.global_batch if self.slice_level else self.global_batch // self.pipelines

    @property
    def batching(self) -> str:
        """"batch" an unbatched source, "rebatch" a batched one, or "keep" its batches."""
        if not self.batched:
            return "batch"
        if self.from_fn:  # an input_fn's per-replica batches, as big as this pipeline's?
            return "keep" if self.stream_batch == self.source_batch else "rebatch"
        # Global batches: sharded by file or not at all, each pipeline takes its share.
        return "rebatch" if self.policy in ("file", "off") and self.pipelines > 1 else "keep"

    @property
    def slices(self) -> int:
        """Into how many slices each batch of the stream is split."""
        return self.num_replicas if self.slice_level else self.local_replicas

    @property
    def infinite(self) -> bool:
        return int(self.source.cardinality()) == tf.data.INFINITE_CARDINALITY


@dataclasses.dataclass(frozen=True)
class Stream:
    """The dataset between two steps, and what is known of its batches."""

    dataset: tf.data.Dataset
    #: All batches but the last have `Plan.stream_batch` rows (set by `batch`).
    uniform: bool = False
    #: The number of batches, if known (< 0: unknown or infinite; set by `recut_tail`).
    count: int = tf.data.UNKNOWN_CARDINALITY


Step = Callable[[Stream, Plan], Stream]


# --- tensors in batches ----------------------------------------------------------


def leaves_supported(element_spec) -> bool:
    """Dense or ragged components, each with a batch dimension."""
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
    raise ArgumentError("A batch must contain at least one tensor.")


def _map_leaves(fn, structure):
    return tf.nest.map_structure(lambda t: None if t is None else fn(t), structure)


def static_batch(element_spec) -> int | None:
    """The batch size all components agree on statically (``batch(n, drop_remainder=True)``)."""
    sizes = {s.shape[0] for s in tf.nest.flatten(element_spec) if s is not None and s.shape.rank}
    return sizes.pop() if len(sizes) == 1 and None not in sizes else None


def rebatched_count(cardinality: int, batch: int | None, exact: bool | None, new_batch: int, drop: bool):
    """Batches after re-batching ``cardinality`` batches of ``batch`` (the last maybe short), if certain."""
    if cardinality < 0 or batch is None:
        return None
    most = cardinality * batch
    least = most if exact or cardinality == 0 else most - batch + 1
    rounding = (lambda n: n // new_batch) if drop else (lambda n: -(-n // new_batch))
    return rounding(least) if rounding(least) == rounding(most) else None


# --- the steps ---------------------------------------------------------------------


def shard_files(stream: Stream, plan: Plan) -> Stream:
    """File sharding: this pipeline keeps its own files."""
    if plan.policy != "file" or plan.pipelines == 1:
        return stream
    dataset = tf_data.auto_shard(stream.dataset, plan.pipelines, plan.index, plan.num_replicas)
    return dataclasses.replace(stream, dataset=dataset)


def shuffle(stream: Stream, plan: Plan) -> Stream:
    """Examples shuffled (after file sharding, before batching), reshuffled every epoch."""
    if plan.shuffle_buffer_size is None:
        return stream
    dataset = stream.dataset.shuffle(
        plan.shuffle_buffer_size, seed=plan.shuffle_seed, reshuffle_each_iteration=True
    )
    return dataclasses.replace(stream, dataset=dataset)


def _full_batches(batches: tf.data.Dataset, size: int) -> tf.data.Dataset:
    size = tf.constant(size, tf.int64)

    @_graph_function
    def is_full(batch):
        return tf.equal(_rows(batch), size)

    @_graph_function
    def unwrap(batch):
        return batch

    # zip, not the dataset itself: filter and map would unpack a batch that is a tuple.
    return tf.data.Dataset.zip((batches,)).filter(is_full).map(unwrap)


def batch(stream: Stream, plan: Plan) -> Stream:
    """Batches of `Plan.stream_batch` rows: batched, re-batched, or the source's own."""
    dataset = stream.dataset
    if plan.batching == "batch":
        return Stream(dataset.batch(plan.stream_batch, drop_remainder=plan.drop), uniform=True)
    if plan.batching == "rebatch":
        # Per-replica batches of an input_fn, or one pipeline's share of global batches.
        batches = dataset.rebatch(plan.stream_batch, drop_remainder=plan.drop)
        known = rebatched_count(
            int(dataset.cardinality()), plan.source_batch, plan.source_drops, plan.stream_batch, plan.drop
        )
        if known is not None:
            batches = batches.apply(tf.data.experimental.assert_cardinality(known))
        return Stream(batches, uniform=True)
    if plan.drop and not plan.source_drops:
        return Stream(_full_batches(dataset, plan.stream_batch), uniform=False)
    return Stream(dataset, uniform=plan.source_batch is not None)


def check_components(stream: Stream, plan: Plan) -> Stream:
    """Refuses batches this module cannot split (components without a batch dimension)."""
    if not leaves_supported(stream.dataset.element_spec):
        raise ArgumentError(
            "distribute_dataset supports batches of dense or ragged tensors with a batch "
            f"dimension; got element_spec {stream.dataset.element_spec}."
        )
    return stream


def recut_tail(stream: Stream, plan: Plan) -> Stream:
    """No empty replica: a short last batch is merged with the one before and cut again."""
    count = int(stream.dataset.cardinality())
    if plan.pad or plan.infinite or plan.drop or not _recuttable(stream.dataset.element_spec):
        return dataclasses.replace(stream, count=count)
    threshold = plan.slices
    dataset = _recut(stream.dataset, threshold)
    # Re-cutting keeps the number of batches unless a short last batch had to be merged
    # whole into the one before it (only with batches of fewer than 2 x threshold rows).
    keeps_count = plan.stream_batch is not None and plan.stream_batch >= 2 * threshold
    if not (stream.uniform and count >= 0 and (keeps_count or count <= 1)):
        count = tf.data.UNKNOWN_CARDINALITY
    return dataclasses.replace(stream, dataset=dataset, count=count)


def split(stream: Stream, plan: Plan) -> Stream:
    """Each batch into `Plan.slices` slices, this pipeline's only.

    Slice j of a global batch goes to pipeline j % pipelines, as its local replica
    j // pipelines: TensorFlow's own layout for data sharding, which Keras's multi-worker
    predict (_multi_worker_concat) reassembles in order.
    """
    first, step = (plan.index, plan.pipelines) if plan.slice_level else (0, 1)
    if plan.pad:
        wrapper = short_batches.PaddedBatch if plan.pipelines == 1 or plan.slice_level else (
            short_batches.LocalPaddedBatch)
        return dataclasses.replace(stream, dataset=_split_padded(stream.dataset, plan.slices, first, step, wrapper))
    per_replica = None if plan.global_batch is None else plan.global_batch // plan.num_replicas
    static_rows = per_replica if (plan.drop and stream.uniform) else None
    return dataclasses.replace(stream, dataset=_split(stream.dataset, plan.slices, first, step, static_rows))


def assert_cardinality(stream: Stream, plan: Plan) -> Stream:
    """The number of elements (steps x local replicas), when it is known."""
    if plan.infinite:
        known = tf.data.INFINITE_CARDINALITY
    elif stream.count >= 0:
        known = stream.count * plan.local_replicas
    else:
        return stream
    return dataclasses.replace(stream, dataset=stream.dataset.apply(tf.data.experimental.assert_cardinality(known)))


def finish(stream: Stream, plan: Plan) -> Stream:
    """Deterministic order unless the user chose, then prefetching.

    distribute_datasets_from_function never auto-shards, so TensorFlow's AUTO->DATA warning
    cannot occur. Order is TensorFlow's default; a user's explicit choice stays. Autotuning is
    left unset (TensorFlow's default: on) so that ReplicatorStrategy can turn it off over CPU
    replicas, where its thread stalled every epoch (_compat/multi_device_iterator.py).
    """
    options = tf.data.Options()
    if stream.dataset.options().deterministic is None:
        options.deterministic = True
    return dataclasses.replace(stream, dataset=stream.dataset.prefetch(tf.data.AUTOTUNE).with_options(options))


STEPS: tuple[Step, ...] = (
    shard_files, shuffle, batch, check_components, recut_tail, split, assert_cardinality, finish,
)


def build(plan: Plan) -> tf.data.Dataset:
    """One input pipeline's dataset of per-replica batches: `STEPS` applied in order."""
    stream = Stream(plan.source)
    for step in STEPS:
        stream = step(stream, plan)
    return stream.dataset


# --- re-cutting and splitting batches ------------------------------------------------


def _recut(batches: tf.data.Dataset, minimum: int) -> tf.data.Dataset:
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

    @_graph_function
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

    @_graph_function
    def is_valid(emitted, valid):
        return valid

    @_graph_function
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
        @_graph_function
        def as_slices(batch):
            def cut(t):
                shape = [num_slices, static_rows, *t.shape[1:]]
                t = tf.reshape(t, tf.concat([[num_slices, static_rows], tf.shape(t)[1:]], 0))
                return tf.ensure_shape(t, shape)[first::step]

            return _map_leaves(cut, batch)

        return tf.data.Dataset.zip((batches,)).map(as_slices).unbatch()

    num = tf.constant(num_slices, tf.int64)

    @_graph_function
    def slices(batch):
        n = _rows(batch)
        q, rem = n // num, n % num

        @_graph_function
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


def _split_padded(batches: tf.data.Dataset, num_slices: int, first: int, step: int, wrapper):
    """As `_split`, each slice as ``wrapper(slice, real rows, batch rows)``.

    A slice that would be empty (a batch of fewer rows than ``num_slices``) is one
    padding row instead, a copy of the batch's last row, with 0 real rows.
    """
    num = tf.constant(num_slices, tf.int64)

    @_graph_function
    def slices(batch):
        n = _rows(batch)
        q, rem = n // num, n % num

        @_graph_function
        def one(j):
            size = q + tf.cast(j < rem, tf.int64)
            start = tf.where(size > 0, j * q + tf.minimum(j, rem), n - 1)
            length = tf.maximum(size, 1)
            piece = _map_leaves(lambda t: t[start : start + length], batch)
            return wrapper(piece, tf.cast(size, tf.int32), tf.cast(n, tf.int32))

        return tf.data.Dataset.range(first, num_slices, step).map(one)

    return tf.data.Dataset.zip((batches,)).flat_map(slices)
