"""The replica step traced once, split so that what needs no input runs without it.

Why: TensorFlow inlines a `tf.function` called inside another, and an inlined
call is not strict: an op of the callee that does not depend on the call's
inputs runs even when they never arrive (`inline_function_utils.cc` wires the
inputs to their consumers only). Keras's `fit` on one device reads the last
step of an epoch of unknown length (a generator, `filter`) from an exhausted
iterator: `IteratorGetNext` fails, but the step's ops that need no data run
anyway, chiefly `optimizer.iterations.assign_add(1)`. One device then counts one
`iterations` more per epoch than it has batches, and so does TensorFlow's
per-replica tracing (the replicas' steps are inlined ops of the caller). The
step traced once is called per replica without inlining (`_noinline`, so that
each device optimises its own copy), and such a call is strict: it never starts
on a failed input, so those ops did not run, and every optimizer or schedule
that reads `iterations` drifted from one device.

So the one trace is split in two functions, each called per replica: `first`,
the step's side effects that depend on no input (nor on anything that does),
with what they read, taking only the replica id and the captures; `rest`, every
other op, taking the inputs and what it reads from `first`, called after it.
`first` starts without the inputs, as the same ops do in an inlined call; both
together run the step's ops in an order its graph allows, as one call would.

What it reads, checked on TensorFlow 2.21: a `ConcreteFunction`'s `graph`
(`inputs`, `control_outputs`, `structured_outputs`, ops' `inputs` and
`control_inputs`), `captured_inputs`, `Graph._functions` and
`_add_function_recursive` (the functions the step calls), `create_op`, an op's
`_set_device_from_string`, `handle_data_util.copy_handle_data`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import tensorflow as tf
from tensorflow.python.framework import ops
from tensorflow.python.ops import handle_data_util
from tensorflow.python.util import nest, object_identity

# Off: measured at the end of the session that built it, the input-free call races the
# exhausted iterator's failure (which cancels the step) on each replica on its own: on an idle
# machine one epoch's increment was lost in 2 runs of 3, and AdamW's decay ran on some replicas
# only (replicas no longer identical: 5.3e-6 on a BERT embedding). Without it a step traced once
# counts no step for the cut-short last one (deterministic, replicas identical), one fewer per
# epoch of unknown length than one device: issue 39 stays open until the call is ordered before
# the iterator's fetch (which is in Keras's outer function, not reachable from the replica step).
ENABLED = False


@dataclass(frozen=True)
class SplitStep:
    """The two functions of a split replica step and how to call them."""

    first: object  # ConcreteFunction(replica_id, *captures) -> the tensors `rest` reads from it
    rest: object  # ConcreteFunction(replica_id, *inputs, *from_first, *captures) -> the step's outputs

    def call(self, replica_id, inputs: list, captures: list):
        """Calls both on one replica (under its device scope); returns the step's outputs."""
        graph = ops.get_default_graph()
        before = len(graph.get_operations())
        from_first = self.first._call_flat([replica_id, *captures], [])
        first_calls = [op for op in graph.get_operations()[before:] if op.type.endswith("PartitionedCall")]
        with ops.control_dependencies(first_calls):
            return self.rest._call_flat([replica_id, *inputs, *nest.flatten(from_first), *captures], [])


def _dependents(graph, sources: set) -> set:
    """Every op of `graph` that depends on an op of `sources`, by data or control."""
    found = set(sources)
    changed = True
    while changed:  # ops are created after their inputs: one pass, unless control inputs were added late
        changed = False
        for op in graph.get_operations():
            if op not in found and (any(t.op in found for t in op.inputs)
                                    or any(c in found for c in op.control_inputs)):
                found.add(op)
                changed = True
    return found


def _ancestors(ops_: list) -> set:
    """`ops_` and every op they depend on, by data or control."""
    found, stack = set(), list(ops_)
    while stack:
        op = stack.pop()
        if op in found:
            continue
        found.add(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return found


def _copy_ops(source_ops: list, op_map: dict) -> None:
    """Copies `source_ops` (in order) into the default graph, inputs through `op_map`.

    A control input not in `op_map` is dropped: it is an op of `first`, which
    `rest` is called after.
    """
    graph = ops.get_default_graph()
    for op in source_ops:
        controls = [op_map[c] for c in op.control_inputs if c in op_map]
        with ops.control_dependencies(controls):
            copied = graph.create_op(
                op.type, [op_map[t] for t in op.inputs], [t.dtype for t in op.outputs],
                attrs={k: v for k, v in op.node_def.attr.items() if not k.startswith("_class")},
                name=op.name)
        copied._set_device_from_string(op.device)
        op_map[op] = copied
        for old, new in zip(op.outputs, copied.outputs):
            op_map[old] = new
            if old.dtype in (tf.resource, tf.variant):
                handle_data_util.copy_handle_data(old, new)


def _map_arguments(placeholders: list, arguments: list, op_map: dict) -> None:
    """The traced step's tensors `placeholders` read as the copy's `arguments`."""
    for old, new in zip(placeholders, arguments):
        if old.dtype in (tf.resource, tf.variant):
            handle_data_util.copy_handle_data(old, new)
        op_map[old] = new
        if old.op.type == "Placeholder":
            op_map[old.op] = new.op


def _spec(t: tf.Tensor) -> tf.TensorSpec:
    return tf.TensorSpec(t.shape, t.dtype)


def split_step(traced, stays: Callable[[tf.Tensor], bool]) -> SplitStep | None:
    """`traced` (replica_id, *inputs) split in two (see the module docstring), or None
    when every side effect of the step depends on its inputs (nothing to split).

    `stays(capture)`: whether writes to a captured resource stay with the inputs
    (in `rest`) even when they need none. For a metric's variables: a count can
    need no data (Keras's loss tracker adds `tf.shape(x)[0]`, a constant when the
    batch shape is static), and one device then counts a batch that never came
    (it logs 8/9 of the mean of 8 batches' losses): the mean of the batches is
    kept. For a collective launcher's key counter and ordering token: they go
    with the collectives that read them.
    """
    graph = traced.graph
    n_captures = len(traced.captured_inputs)
    replica_id, *inputs = graph.inputs[:len(graph.inputs) - n_captures]
    captures = graph.inputs[len(graph.inputs) - n_captures:]
    staying = {id(t) for t, c in zip(captures, traced.captured_inputs) if stays(c)}
    dependent = _dependents(graph, {t.op for t in inputs})
    effects = [op for op in graph.control_outputs if op not in dependent
               and not any(id(t) in staying for t in op.inputs)]
    if not effects:
        return None
    arguments = {replica_id.op, *(t.op for t in inputs), *(t.op for t in captures)}
    first_ops = _ancestors(effects)
    order = [op for op in graph.get_operations() if op not in arguments]
    rest_ops = [op for op in order if op not in first_ops]
    outputs = nest.flatten(graph.structured_outputs, expand_composites=True)
    read = [t for op in rest_ops for t in op.inputs] + [t for t in outputs if isinstance(t, tf.Tensor)]
    from_first = list({id(t): t for t in read if t.op in first_ops and t.op not in arguments}.values())
    functions = list(graph._functions.values())

    def add_functions():
        for f in functions:
            ops.get_default_graph()._add_function_recursive(f)

    def replica_step_first(rid, *capture_args):
        add_functions()
        op_map = object_identity.ObjectIdentityDictionary()
        _map_arguments([replica_id, *captures], [rid, *capture_args], op_map)
        _copy_ops([op for op in order if op in first_ops], op_map)
        return [op_map[t] for t in from_first]

    def replica_step_rest(rid, *args):
        add_functions()
        op_map = object_identity.ObjectIdentityDictionary()
        _map_arguments([replica_id, *inputs, *from_first, *captures], [rid, *args], op_map)
        _copy_ops(rest_ops, op_map)
        return nest.pack_sequence_as(
            graph.structured_outputs,
            [op_map[t] if isinstance(t, tf.Tensor) else t for t in outputs], expand_composites=True)

    def concrete(fn, specs):
        return tf.function(fn, autograph=False, experimental_attributes={"_noinline": True}
                           ).get_concrete_function(*specs)

    capture_specs = [_spec(t) for t in captures]
    return SplitStep(
        first=concrete(replica_step_first, [_spec(replica_id), *capture_specs]),
        rest=concrete(replica_step_rest, [_spec(replica_id), *(_spec(t) for t in inputs),
                             *(_spec(t) for t in from_first), *capture_specs]),
    )
