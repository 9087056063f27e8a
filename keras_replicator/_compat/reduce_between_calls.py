"""A step traced once, split at its large all-reduces: each reduced between the calls.

Why: inside the one trace (`replica_trace`) every all-reduce is a collective, and
on the CPU devices of one process TensorFlow's collective is a ring that copies
every chunk from device to device, and allocates each copy. The engine that
traces per replica sums in the caller's graph instead
(`PackedReductionToOneDevice`), where the devices read each other's tensors in
place. Measured on 4 simulated devices: 64 MB all-reduced in 194 ms by the
ring, 54 ms by the packed reduction; a step whose work is its gradients'
all-reduce ran 0.65x as fast traced once as traced per replica.

What we do: while the step is traced once, each dense all-reduce of at least
`MIN_BYTES` in the trace's own graph (not in a branch or a loop body, nor
recorded by a tape) is a cut: the collective is traced as before, then an
`IdentityN` (the marker) stands for its result. At the call, when the engine
reduces on one machine's CPUs (`stages_applies`), the trace is copied into
stages: stage i holds what cut i's values need and no earlier stage holds; the
last stage holds the rest. The caller calls stage i on every device, reduces its
cut's values with the engine's cross-device ops (the sums of the per-replica
engine, bitwise), and feeds the results to the next stage in place of the
marker. The collective of a cut is not copied. Where the split does not apply
the trace runs whole, its collectives real: the marker is an identity.

Reordering is safe: a stage holds only what a cut needs (its ancestors by data
and by automatic control dependencies), and an op the trace ordered after
another stays after it.

What it reads, checked on TensorFlow 2.16-2.21: `MirroredExtended.
_replica_ctx_all_reduce` (wrapped by the engines while tracing once), a
`ConcreteFunction`'s `graph` (`inputs`, ops' `inputs` and `control_inputs`,
`structured_outputs`, `_functions`), `_call_flat`; the op copying of
`exhausted_step`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import tensorflow as tf
from tensorflow.python.distribute import values as tf_values
from tensorflow.python.framework import ops
from tensorflow.python.util import nest, object_identity

from keras_replicator._compat import all_reduce_gradient, exhausted_step

# Smaller all-reduces stay collectives: a cut costs one more call per device and a
# join of every replica in the caller's graph.
MIN_BYTES = 2**20


@dataclass
class Cut:
    """One all-reduce of the trace, to be reduced between the stages."""

    reduce_op: tf.distribute.ReduceOp
    values: list  # the replica's tensors (trace tensors)
    marker: ops.Operation  # IdentityN standing for the reduced values
    collective: set = field(default_factory=set)  # the ops that reduced them in the trace


@dataclass
class _Recording:
    graph: object
    cuts: list = field(default_factory=list)


_local = threading.local()


@contextlib.contextmanager
def recording(graph, enabled: bool) -> Iterator[list]:
    """While the one trace runs in `graph`: its cuts, in trace order (none unless `enabled`)."""
    previous = getattr(_local, "recording", None)
    current = _Recording(graph) if enabled else None
    _local.recording = current
    try:
        yield current.cuts if current is not None else []
    finally:
        _local.recording = previous


def _qualifies(values) -> bool:
    if not isinstance(values, (list, tuple)) or not values:
        return False
    total = 0
    for v in values:
        if not isinstance(v, tf.Tensor) or not v.shape.is_fully_defined():
            return False
        total += v.shape.num_elements() * v.dtype.size
    return total >= MIN_BYTES


def all_reduce(reduce: Callable[[], list], reduce_op, values) -> list:
    """`reduce()`'s result, recorded as a cut where it qualifies (see the module docstring)."""
    current = getattr(_local, "recording", None)
    graph = ops.get_default_graph()
    if (
        current is None
        or graph is not current.graph
        or not _qualifies(values)
        or all_reduce_gradient.gradient_tape_recording()
    ):
        return reduce()
    before = len(graph.get_operations())
    reduced = list(reduce())
    collective = set(graph.get_operations()[before:])
    if not all(isinstance(r, tf.Tensor) for r in reduced):
        return reduced
    marker = tf.raw_ops.IdentityN(input=reduced, name="kr_reduced_between_calls")
    current.cuts.append(Cut(reduce_op, list(values), marker[0].op, collective))
    return list(marker)


# --- the stages ----------------------------------------------------------------------


@dataclass(frozen=True)
class Stages:
    """The trace in stages: `functions[i](replica_id, *arguments, *imports[i]) -> exports[i]`."""

    functions: list
    imports: list  # per stage: the trace tensors it reads from earlier stages or cuts
    exports: list  # per stage: the trace tensors it gives to later stages or the outputs
    cuts: list
    arguments: list  # the trace's inputs: replica id, inputs, captures
    structured_outputs: object  # the trace's
    optimized_once: bool = False  # the functions optimised by Grappler already (`grappler_once`)


def _stage_ops(graph, cuts: list, arguments: set) -> list[list] | None:
    markers = {c.marker for c in cuts}
    # Captures made while the collective was traced are the trace's inputs, shared.
    dropped = set().union(*(c.collective for c in cuts)) - arguments
    # The collective's results must reach nothing but its marker.
    for op in dropped:
        for t in op.outputs:
            if any(user not in dropped and user not in markers for user in t.consumers()):
                return None
    assigned: set = set()
    stages = []
    for cut in cuts:
        found, stack = set(), [v.op for v in cut.values]
        while stack:
            op = stack.pop()
            if op in found or op in assigned or op in arguments or op in markers or op in dropped:
                continue
            found.add(op)
            stack.extend(t.op for t in op.inputs)
            stack.extend(op.control_inputs)
        assigned |= found
        stages.append(found)
    rest = {op for op in graph.get_operations()} - assigned - arguments - markers - dropped
    stages.append(rest)
    return [_topological(stage) for stage in stages]


def _topological(stage: set) -> list:
    """`stage`'s ops, each after the ops of `stage` it reads. Not the creation order: a
    loop's gradient adds inputs made later to its forward `While` (accumulators)."""
    order, done = [], set()
    for root in sorted(stage, key=lambda op: op._id):
        stack = [(root, False)]
        while stack:
            op, expanded = stack.pop()
            if op in done:
                continue
            if expanded:
                done.add(op)
                order.append(op)
                continue
            stack.append((op, True))
            for dep in [*(t.op for t in op.inputs), *op.control_inputs]:
                if dep in stage and dep not in done:
                    stack.append((dep, False))
    return order


def split(traced, cuts: list, optimized_stages: Callable | None = None) -> Stages | None:
    """`traced` (replica_id, *inputs, *captures) in stages at `cuts`, or None if it cannot be.

    `optimized_stages(graph, stage_ops, feeds, exports)`: the stages' functions
    optimised once (`grappler_once.optimized_stages`), or None to copy them here.
    """
    if not cuts:
        return None
    graph = traced.graph
    if exhausted_step.compiled_by_xla(graph):
        # A jit_compile function in the step: its errors are reported as one device's
        # step reports them (`keras_xla`), which the stages' calls would change.
        return None
    arguments = list(graph.inputs)
    stage_ops = _stage_ops(graph, cuts, {t.op for t in arguments})
    if stage_ops is None:
        return None
    where = object_identity.ObjectIdentityDictionary()  # trace tensor -> its stage
    for i, stage in enumerate(stage_ops):
        for op in stage:
            for t in op.outputs:
                where[t] = i
    for i, cut in enumerate(cuts):
        for t in cut.marker.outputs:
            where[t] = ("cut", i)
    outputs = [t for t in nest.flatten(graph.structured_outputs, expand_composites=True)
               if isinstance(t, tf.Tensor)]
    imports = [object_identity.ObjectIdentityDictionary() for _ in stage_ops]
    exports = [object_identity.ObjectIdentityDictionary() for _ in stage_ops]
    for i, stage in enumerate(stage_ops):
        for op in stage:
            for t in op.inputs:
                source = where.get(t)
                if source is None or source == i:
                    continue  # an argument, or this stage's
                imports[i][t] = True
                if isinstance(source, int):
                    exports[source][t] = True
    for i, cut in enumerate(cuts):
        for v in cut.values:
            if where.get(v) != i:
                return None  # a cut's value from elsewhere than its stage
            exports[i][v] = True
    for t in outputs:
        source = where.get(t)
        if isinstance(source, int):
            exports[source][t] = True
    imports = [list(d) for d in imports]
    exports = [list(d) for d in exports]
    feeds = [[*arguments, *stage_imports] for stage_imports in imports]
    functions = optimized_stages(graph, stage_ops, feeds, exports) if optimized_stages else None
    optimized_once = functions is not None
    if functions is None:
        functions = [_stage_function(graph, arguments, stage_ops[i], imports[i], exports[i])
                     for i in range(len(stage_ops))]
    return Stages(functions, imports, exports, cuts, arguments, graph.structured_outputs, optimized_once)


def _stage_function(graph, arguments: list, stage: list, imports: list, exports: list):
    functions = list(graph._functions.values())

    def stage_fn(*args):
        for f in functions:
            ops.get_default_graph()._add_function_recursive(f)
        op_map = object_identity.ObjectIdentityDictionary()
        for old, new in zip([*arguments, *imports], args):
            exhausted_step.copy_handle(old, new)
            op_map[old] = new
            if old.op.type == "Placeholder":
                op_map[old.op] = new.op
        exhausted_step.copy_ops(stage, op_map)
        return [op_map[t] for t in exports]

    specs = [tf.TensorSpec(t.shape, t.dtype) for t in [*arguments, *imports]]
    return tf.function(stage_fn, autograph=False, experimental_attributes={"_noinline": True}
                       ).get_concrete_function(*specs)


def call_stages(stages: Stages, replicas: list, reduce_batch: Callable, calls: list) -> list:
    """Calls `stages` on every replica, reducing each cut between them: the replicas' outputs.

    `replicas`: per replica, (device, its replica id tensor, its argument
    tensors: inputs then captures). `reduce_batch(reduce_op, per_replica_lists)`:
    the cut's values reduced, one list per replica. The call ops made are
    appended to `calls`.
    """
    n = len(replicas)
    known = [object_identity.ObjectIdentityDictionary() for _ in range(n)]
    for d, (_, rid, args) in enumerate(replicas):
        for old, new in zip(stages.arguments, [rid, *args]):
            known[d][old] = new
    previous: list[list] = [[] for _ in range(n)]
    for i, function in enumerate(stages.functions):
        for d, (device, _, _) in enumerate(replicas):
            feed = [known[d][t] for t in [*stages.arguments, *stages.imports[i]]]
            with ops.device(device), ops.control_dependencies(previous[d]), exhausted_step.calls_made([]) as made:
                results = function._call_flat(feed, []) or []
            previous[d] = made
            calls.extend(made)
            for old, new in zip(stages.exports[i], nest.flatten(results)):
                known[d][old] = new
        if i < len(stages.cuts):
            cut = stages.cuts[i]
            reduced = reduce_batch(cut.reduce_op, [[known[d][v] for v in cut.values] for d in range(n)])
            for d in range(n):
                for old, new in zip(cut.marker.outputs, reduced[d]):
                    known[d][old] = new
    return [
        nest.pack_sequence_as(
            stages.structured_outputs,
            [known[d][t] if isinstance(t, tf.Tensor) else t
             for t in nest.flatten(stages.structured_outputs, expand_composites=True)],
            expand_composites=True)
        for d in range(n)
    ]


def reducer(cross_device_ops, devices: list) -> Callable:
    """`reduce_batch` for `call_stages` by `cross_device_ops` over `devices`."""

    def reduce_batch(reduce_op, per_replica: list[list]) -> list[list]:
        pairs = []
        for j in range(len(per_replica[0])):
            value = tf_values.PerReplica([per_replica[d][j] for d in range(len(devices))])
            pairs.append((value, value))
        mirrored = cross_device_ops.batch_reduce(reduce_op, pairs)
        return [[m.values[d] for m in mirrored] for d in range(len(devices))]

    return reduce_batch
