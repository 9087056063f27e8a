"""TensorFlow's collective launcher: instance keys that follow execution, not tracing.

Patches (subclasses and swaps in): `cross_device_utils.CollectiveReplicaLauncher`
inside a `cross_device_ops.CollectiveAllReduce` (its private `_launchers`,
`_group_key`, `_group_size`, `_collective_keys`, `_device`, `_options`, and the
launcher's `_all_gather`); wraps that object's `_all_reduce` (an instance
attribute) so that its `IndexedSlices` are gathered together; sets the
launchers' key counters equal before each step (`align_execution_counters`).
Why: see `_ExecutionOrderedLauncher`, its `all_gather_indexed_slices` and
`align_execution_counters`. Checked on TensorFlow 2.16-2.21.
"""

from __future__ import annotations

import functools

import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops, cross_device_utils
from tensorflow.python.eager import context
from tensorflow.python.framework import ops
from tensorflow.python.ops import control_flow_util, resource_variable_ops
from tensorflow.python.util import nest


class _ExecutionOrderedLauncher(cross_device_utils.CollectiveReplicaLauncher):
    """A collective launcher whose instance keys follow execution, not tracing.

    Why (TF 2.16-2.21): inside TF2 functions, stock launchers feed each
    collective's instance key at call time through
    `FuncGraph.capture_call_time_value`. That deferred capture is lost when
    the traced function is later called from a control-flow branch of an outer
    function, which Keras 3 does in two common cases: `steps_per_execution > 1`
    (a `tf.cond` in a `tf.while_loop` around `strategy.run`), and any step
    that creates variables on its first call (TensorFlow wraps the traced step in
    a `tf.cond` on "variables initialised"), e.g. a GAN's optimizers built
    lazily in `train_step`. Both fail with "You must feed a value for
    placeholder tensor" (keras-team/keras#19246), on stock MirroredStrategy too.

    Here each launcher keeps an execution counter in a host variable and the key
    of a collective is `base + counter.assign_add(1)`. Every replica (and every
    worker) runs the same sequence of collectives on its device, so the keys
    agree; they depend on what ran, not on when each process traced, so a worker
    that retraces alone does not fall out of step (the reason TF abandoned
    trace-time keys).
    """

    _KEY_BASE = 1 << 30  # above the keys TensorFlow hands out from Python

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        host = tf.DeviceSpec.from_string(self._device).replace(device_type="CPU", device_index=0)
        with ops.init_scope(), ops.device(host.to_string()):
            self._executions = resource_variable_ops.ResourceVariable(
                tf.constant(0, tf.int64), trainable=False, name="collective_executions"
            )

    def _next_instance_key(self):
        if (
            context.executing_eagerly()
            or not self._use_unique_instance_key()
            or control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph())
        ):
            return super()._next_instance_key()
        with ops.device(self._executions.device):
            count = self._executions.assign_add(1, read_value=True)
            return tf.cast(self._KEY_BASE + count % self._KEY_BASE, tf.int32)


    def batch_all_reduce(self, input_tensor_packs, options=None):
        """TensorFlow's, with each pack split by dtype and fewer ops in a graph.

        Why (TF 2.21):
        * `CollectiveAllReduce._all_reduce` (the replica-context all-reduce
          without a merge call, which a step traced once uses) packs every
          dense value into one pack whatever its dtype, and the pack's `concat`
          then fails on mixed float32 and float64 values;
        * TensorFlow's pack flattens and concatenates even a lone tensor, and
          computes every size at run time (`Shape`, `Prod`, `Pack`) though the
          shapes are static: 11 ops per lone all-reduce and 3 per packed
          tensor. A traced-once ResNet-50 step makes 106 lone all-reduces
          (batch norm's mean-aggregated moving statistics) and packs 161
          gradients; every op is instantiated and optimised once per device.
        A collective reduces element-wise whatever the shape, so a lone tensor
        is reduced as it is; a pack of static shapes is split by constant sizes.
        The values reduced (and their order in the pack) are TensorFlow's.
        """
        if context.executing_eagerly():
            return super().batch_all_reduce(input_tensor_packs, options)
        # As TensorFlow's: NCCL packs are ordered, each after the one before.
        ordered = self._is_nccl(options)
        outputs: list = []
        last = None
        for pack in input_tensor_packs:
            by_dtype: dict = {}
            for i, t in enumerate(pack):
                by_dtype.setdefault(t.dtype, []).append(i)
            results: list = [None] * len(pack)
            for members in by_dtype.values():
                reduced = self._reduce_pack([pack[i] for i in members], last if ordered else None, options)
                last = reduced[-1]
                for i, r in zip(members, reduced):
                    results[i] = r
            outputs.extend(results)
        return outputs

    def _is_nccl(self, options) -> bool:
        merged = self._options.merge(options)
        return merged.implementation == tf.distribute.experimental.CommunicationImplementation.NCCL

    def _reduce_pack(self, pack: list, control_input, options) -> list:
        """One all-reduce of a pack of tensors of one dtype."""
        with ops.device(self._device):
            if len(pack) == 1:
                return [self.all_reduce(pack[0], control_input, options)]
            if all(t.shape.is_fully_defined() for t in pack):
                shapes = [t.shape for t in pack]
                sizes = [shape.num_elements() for shape in shapes]
            else:
                shapes = [tf.shape(t) for t in pack]
                sizes = tf.stack([tf.reduce_prod(shape) for shape in shapes])
            flat = tf.concat([tf.reshape(t, [-1]) for t in pack], axis=0)
            reduced = self.all_reduce(flat, control_input, options)
            parts = tf.split(reduced, sizes, num=len(pack))
            return [tf.reshape(part, shape) for part, shape in zip(parts, shapes)]

    def all_gather_indexed_slices(self, slices: list, options=None) -> list:
        """Several `IndexedSlices` all-reduced by 3 collectives, not 3 each.

        Why (TF 2.21): TensorFlow's `all_reduce_indexed_slices` all-gathers one
        value's row count, then its values and indices in a `tf.cond` (padded
        or not), per value: the SN-GAN's 8 class embeddings cost 24 collectives
        a step, run one after another, and 8 conds of 168 ops to trace and
        instantiate on every device. Here the row counts of all the values are
        gathered at once, then their values (flattened, concatenated, padded to
        the longest replica's) and their indices. The result is TensorFlow's:
        each value's rows, replica by replica, unsummed.
        """
        options = self._options.merge(options)
        nccl = self._is_nccl(options)
        n, k = self._group_size, len(slices)
        with ops.device(self._device):
            lengths = tf.stack([tf.shape(s.indices, out_type=tf.int32)[0] for s in slices])
            all_lengths = tf.reshape(self._all_gather(lengths, options), [n, k])
            widths = tf.constant([s.values.shape[1:].num_elements() for s in slices], tf.int32)
            value_sizes = all_lengths * widths
            values = self._gather_padded(
                tf.concat([tf.reshape(s.values, [-1]) for s in slices], 0), value_sizes, options)
            with ops.control_dependencies([values[0]] if nccl else []):
                indices = self._gather_padded(
                    tf.concat([s.indices for s in slices], 0), all_lengths, options)
            out = []
            for j, s in enumerate(slices):
                out.append(tf.IndexedSlices(
                    values=tf.reshape(tf.concat([values[r][j] for r in range(n)], 0), [-1, *s.values.shape[1:]]),
                    indices=tf.concat([indices[r][j] for r in range(n)], 0),
                    dense_shape=s.dense_shape))
            return out

    def _gather_padded(self, flat, sizes, options) -> list:
        """All-gathers a 1-D tensor whose length differs by replica; its parts by `sizes` [n, k]."""
        n, k = self._group_size, sizes.shape[1]
        longest = tf.reduce_max(tf.reduce_sum(sizes, axis=1))
        padded = tf.pad(flat, [[0, longest - tf.shape(flat, out_type=tf.int32)[0]]])
        rows = tf.unstack(tf.reshape(self._all_gather(padded, options), [n, longest]), num=n)
        # Each replica's row: its k parts, then its padding; one split per replica.
        with_padding = tf.concat([sizes, longest - tf.reduce_sum(sizes, axis=1, keepdims=True)], 1)
        return [tf.split(row, row_sizes, num=k + 1)[:k]
                for row, row_sizes in zip(rows, tf.unstack(with_padding, num=n))]


def align_execution_counters(launchers) -> None:
    """Sets every launcher's execution counter to the highest, in the function being traced.

    Why: each device's counter advances as that device launches its collectives. A
    step that fails on one replica (an error in the user's step, an empty batch
    under oneDNN) is cancelled while the others are ahead of it, and from then on
    each replica asks for keys that no other replica uses: the next step waits
    forever (tests/test_new_user_mistakes.py hung in 1 run in 4, and in CI). Emitted
    before a step's replicas run: after a healthy step the counters are equal and
    nothing changes; after a failed one, the step starts from keys no replica has
    used. Automatic control dependencies order it before the step's own reads.
    One worker's devices only: a step that fails on one worker fails the job.
    """
    counters = [launcher._executions for launcher in launchers
                if isinstance(launcher, _ExecutionOrderedLauncher)]
    graph = ops.get_default_graph()
    if len(counters) < 2 or not ops.inside_function() or control_flow_util.GraphOrParentsInXlaContext(graph):
        return
    with ops.device(counters[0].device):
        highest = tf.reduce_max(tf.stack([counter.read_value() for counter in counters]))
        for counter in counters:
            counter.assign(highest, read_value=False)


def make_control_flow_safe(ops_obj):
    """Gives a `CollectiveAllReduce` cross-device ops object execution-ordered keys.

    Replaces its launchers in place and returns it; other cross-device ops
    (reduction to one device, NCCL batch ops) need no fix and are returned as
    they are.
    """
    if isinstance(ops_obj, cross_device_ops.CollectiveAllReduce):
        launchers = ops_obj._launchers
        for i, old in enumerate(launchers):
            if type(old) is cross_device_utils.CollectiveReplicaLauncher:
                launchers[i] = _ExecutionOrderedLauncher(
                    old._group_key, old._group_size, old._collective_keys, old._device, old._options
                )
        if "_all_reduce" not in vars(ops_obj):
            ops_obj._all_reduce = functools.partial(_all_reduce_slices_together, ops_obj, ops_obj._all_reduce)
    return ops_obj


def _all_reduce_slices_together(ops_obj, original, reduce_op, value, replica_id, options):
    """`CollectiveAllReduce._all_reduce` (the merge-call-free path), with its
    `IndexedSlices` of one dtype gathered together (see
    `_ExecutionOrderedLauncher.all_gather_indexed_slices`); the rest is TensorFlow's.
    """
    flat = nest.flatten(value)
    launcher = ops_obj._launchers[replica_id]
    groups: dict = {}
    for i, v in enumerate(flat):
        if isinstance(v, tf.IndexedSlices) and v.values.shape[1:].is_fully_defined():
            groups.setdefault((v.values.dtype, v.indices.dtype), []).append(i)
    groups = {key: members for key, members in groups.items() if len(members) > 1}
    if context.executing_eagerly() or not groups or not isinstance(launcher, _ExecutionOrderedLauncher):
        return original(reduce_op, value, replica_id, options)
    together = {i for members in groups.values() for i in members}
    results = list(flat)
    rest = [i for i in range(len(flat)) if i not in together]
    if rest:
        for i, r in zip(rest, original(reduce_op, [flat[i] for i in rest], replica_id, options)):
            results[i] = r
    for members in groups.values():
        gathered = launcher.all_gather_indexed_slices([flat[i] for i in members], options)
        for i, r in zip(members, gathered):
            if reduce_op == tf.distribute.ReduceOp.MEAN:
                with ops.device(ops_obj._devices[replica_id]):
                    r = tf.IndexedSlices(r.values / ops_obj._group_size, r.indices, r.dense_shape)
            results[i] = r
    return nest.pack_sequence_as(value, results)
