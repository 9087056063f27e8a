"""A custom loop's step traced once runs its input-free effects before the batch is fetched.

Why: as `exhausted_step` says, one device's inlined step runs its ops that need
no data (`optimizer.iterations.assign_add(1)`, AdamW's decay) even on the call
whose fetch fails on an exhausted iterator, and our strict call per replica does
not. In a custom loop (`@tf.function def train(it): return strategy.run(step,
args=(next(it),))`, called until `OutOfRangeError`) the error goes to the user,
not through anything of ours, so `exhausted_step`'s run-after-the-failure cannot
apply; but the fetch is in the graph that calls `strategy.run`.

What we do: when the step's inputs come, in that same graph, from an iterator's
fetch ops (`IteratorGetNext`, `IteratorGetNextAsOptional`,
`MultiDeviceIteratorGetNextFromShard`, ...: found by walking back from the
inputs), the one trace is split in two functions, each called per replica:
`first`, the step's side effects that depend on no input (nor on anything that
does), with what they read, taking only the replica id and the captures; `rest`,
every other op, taking the inputs and what it reads from `first`. Every
replica's `first` is called in the caller's graph and made a control input of
every fetch op: the fetch starts only once every replica's effects completed, so
a failing fetch cannot cancel any of them (deterministic: a call started beside
the fetch raced its failure per replica, measured in an earlier attempt). Both
together run the step's ops in an order its graph allows (automatic control
dependencies order no input-free effect after an op that needs an input).

Not taken, today's behaviour kept: the inputs come from no fetch op of that
graph (a `for batch in dataset` loop, whose step runs only on a batch that
came; a step `tf.function` called from another); the split finds no input-free
effect; an op of the graph that already depends on the fetch uses a resource the
effects use (automatic control dependencies would then order it before them: a
cycle); and Keras's train function, whose step `exhausted_step` records instead
(its effects must not run twice).

What it reads, checked on TensorFlow 2.21: a `ConcreteFunction`'s `graph`
(`inputs`, `control_outputs`, `structured_outputs`, ops' `inputs` and
`control_inputs`), `captured_inputs`, `_call_flat`; `FuncGraph.captures`;
`Operation._add_control_inputs`, the `_noinline` function attribute; the helpers of `exhausted_step`
(`Graph._functions`, `_create_op_internal`, `handle_data_util`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import tensorflow as tf
from tensorflow.python.framework import ops
from tensorflow.python.util import nest, object_identity

from keras_replicator._compat import exhausted_step

# The ops that read an element from a tf.data iterator (and fail on an exhausted one).
FETCH_OPS = frozenset({
    "IteratorGetNext", "IteratorGetNextSync", "IteratorGetNextAsOptional",
    "MultiDeviceIteratorGetNextFromShard", "AnonymousIteratorGetNext",
})


@dataclass(frozen=True)
class SplitStep:
    """The two functions of a split replica step."""

    first: object  # ConcreteFunction(replica_id, *captures) -> the tensors `rest` reads from it
    rest: object  # ConcreteFunction(replica_id, *inputs, *from_first, *captures) -> the step's outputs


def _map_arguments(placeholders: list, arguments: list, op_map: dict) -> None:
    """The traced step's tensors `placeholders` read as the copy's `arguments`."""
    for old, new in zip(placeholders, arguments):
        exhausted_step.copy_handle(old, new)
        op_map[old] = new
        if old.op.type == "Placeholder":
            op_map[old.op] = new.op


def _spec(t: tf.Tensor) -> tf.TensorSpec:
    return tf.TensorSpec(t.shape, t.dtype)


def split_step(traced, stays: Callable[[tf.Tensor], bool]) -> SplitStep | None:
    """`traced` (replica_id, *inputs) split in two (see the module docstring), or None
    when every side effect of the step depends on its inputs. `stays`: as for
    `exhausted_step.input_free_effects` (writes that stay with the inputs)."""
    graph = traced.graph
    n_captures = len(traced.captured_inputs)
    replica_id, *inputs = graph.inputs[:len(graph.inputs) - n_captures]
    captures = graph.inputs[len(graph.inputs) - n_captures:]
    effects = exhausted_step.input_free_ops(traced, stays)
    if not effects:
        return None
    arguments = {replica_id.op, *(t.op for t in inputs), *(t.op for t in captures)}
    first_ops = exhausted_step.ancestors(effects)
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
        exhausted_step.copy_ops([op for op in order if op in first_ops], op_map)
        return [op_map[t] for t in from_first]

    def replica_step_rest(rid, *args):
        add_functions()
        op_map = object_identity.ObjectIdentityDictionary()
        _map_arguments([replica_id, *inputs, *from_first, *captures], [rid, *args], op_map)
        exhausted_step.copy_ops(rest_ops, op_map)  # a control input of `first`'s is dropped: it ran before
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


def fetch_ops(tensors: list) -> list:
    """The iterator fetch ops of the current graph that `tensors` come from (by data)."""
    graph = ops.get_default_graph()
    found, seen, stack = [], set(), [t.op for t in tensors if getattr(t, "graph", None) is graph]
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        if op.type in FETCH_OPS:
            found.append(op)
        stack.extend(t.op for t in op.inputs)
    return found


def _would_cycle(fetches: list, captures: list) -> bool:
    """Whether an op already depending on `fetches` uses a resource of `captures`:
    automatic control dependencies would order it before the effects, which the
    fetches then wait for."""
    graph = ops.get_default_graph()
    internal = {id(inner): outer for outer, inner in getattr(graph, "captures", [])}
    used = object_identity.ObjectIdentitySet(c for c in captures if c.dtype == tf.resource)
    for op in exhausted_step.dependents(graph, set(fetches)) - set(fetches):
        for t in op.inputs:
            if t.dtype == tf.resource and (t in used or internal.get(id(t)) in used):
                return True
    return False


def replica_calls(traced, replicas: list[tuple[str, int, list]], inputs: list[list],
                  stays: Callable[[tf.Tensor], bool]) -> list[Callable]:
    """Per replica of `replicas` ((device, replica id, captures) each), its call of the
    step, `(replica_id, inputs, captures) -> outputs`, with `inputs` its tensors.

    The step's `rest`, once every replica's `first` was called here before the
    fetch ops its `inputs` come from; where that does not apply (the module
    docstring), the whole step, its input-free effects recorded for Keras's
    train function (`exhausted_step.record`).
    """
    calls = split_calls(traced, replicas, inputs, stays)
    return calls if calls is not None else [call_whole(traced)] * len(replicas)


def split_calls(traced, replicas: list[tuple[str, int, list]], inputs: list[list],
                stays: Callable[[tf.Tensor], bool]) -> list[Callable] | None:
    """As `replica_calls`, or None where the step runs whole (its input-free
    effects then recorded for Keras's train function)."""
    # What both modules reproduce: one device's inlined step on an exhausted iterator.
    exhausted_step.NON_STRICT_INLINING.verify("keras_replicator._compat.effects_before_fetch")
    calls = _calls_after_effects(traced, replicas, inputs, stays)
    if calls is None:
        exhausted_step.record(traced, replicas, stays)
    return calls


def call_whole(traced) -> Callable:
    """The call of the whole step: `(replica_id, inputs, captures) -> outputs`."""

    def call(replica_id, inputs: list, captures: list):
        return traced._call_flat([replica_id, *inputs], captures)

    return call


def _calls_after_effects(traced, replicas: list, inputs: list[list], stays) -> list[Callable] | None:
    if exhausted_step.recording() or not ops.inside_function():
        return None
    fetches = fetch_ops([t for replica_inputs in inputs for t in replica_inputs])
    if not fetches or _would_cycle(fetches, [c for _, _, cs in replicas for c in cs]):
        return None
    split = split_step(traced, stays)
    if split is None:
        return None
    from_first, first_calls = [], []
    for device, replica_id, captures in replicas:
        with ops.device(device), exhausted_step.calls_made(first_calls):
            rid = tf.raw_ops.PlaceholderWithDefault(input=tf.constant(replica_id, tf.int32), shape=[])
            from_first.append(nest.flatten(split.first._call_flat([rid, *captures], [])))
    for fetch in fetches:
        fetch._add_control_inputs(first_calls)

    def call(read: list):
        def rest(replica_id, replica_inputs: list, captures: list):
            with ops.control_dependencies(first_calls):
                return split.rest._call_flat([replica_id, *replica_inputs, *read, *captures], [])

        return rest

    return [call(read) for read in from_first]
