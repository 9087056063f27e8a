"""What a step on an exhausted iterator does, reproduced for the step traced once.

Why: TensorFlow inlines a `tf.function` called inside another, and an inlined
call is not strict: an op of the callee that does not depend on the call's
inputs runs even when they never arrive (`inline_function_utils.cc` wires the
inputs to their consumers only). Keras's `fit` on one device (`steps_per_execution=1`)
reads the last step of an epoch of unknown length (a generator, `filter`) from
an exhausted iterator: `IteratorGetNext` fails, but the step's ops that need no
data run anyway, chiefly `optimizer.iterations.assign_add(1)` and AdamW's weight
decay. One device then counts one `iterations` more per epoch than it has
batches. The step traced once is called per replica without inlining
(`_noinline`, so that each device optimises its own copy), and such a call is
strict: it never starts on a failed input, so those ops did not run, and every
optimizer or schedule that reads `iterations` drifted from one device (issue 39).

What we do: while Keras's train function is traced, the step traced once
records, for each replica, a function of the step's side effects that depend on
no input (nor on anything that does), with what they read (`input_free_effects`).
When a call of that train function fails with `OutOfRangeError` (the exhausted
iterator: nothing of the strict step ran), the recorded functions run once per
replica, then the error goes on to Keras, which ends the epoch. The effects run
after the failure rather than beside it: a call started beside the failing fetch
raced its cancellation, separately on each replica (measured: an epoch's
increment lost in 2 runs of 3 on an idle machine, AdamW's decay on some replicas
only), where running them after is deterministic, reads the same state (nothing
else ran in between) and writes the same values.

A custom loop that calls `strategy.run` beside `next(iterator)` in its own
`tf.function` until `OutOfRangeError` (nothing of ours sees that error) runs
them before the fetch instead (`effects_before_fetch`). Not covered:
TensorFlow's own per-replica tracing (`trace_once=False`, `devices_per_replica
> 1`), whose inlined step is cut short at a moment that varies. docs/input.md
says so.

What it reads, checked on TensorFlow 2.21 / Keras 3.15: a `ConcreteFunction`'s
`graph` (`inputs`, `control_outputs`, ops' `inputs` and `control_inputs`),
`captured_inputs`, `Graph._functions` and `_add_function_recursive` (the
functions the step calls), `Graph._create_op_internal` (`create_op` without its argument check), an op's `_set_device_from_string`,
`handle_data_util.copy_handle_data`; Keras's `TensorFlowTrainer.make_train_function`
(patched: `self.train_function` wrapped) and its `steps_per_execution`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import tensorflow as tf
from keras.src.backend.tensorflow import trainer as tf_trainer
from tensorflow.python.framework import ops
from tensorflow.python.ops import handle_data_util
from tensorflow.python.util import object_identity

from keras_replicator._compat import patching
from keras_replicator._compat.patching import ScopedPatch, ours


@dataclass(frozen=True)
class ReplicaEffects:
    """One replica's input-free effects: `function(replica_id, *captures)` on `device`."""

    function: Callable  # () -> the ConcreteFunction (built on first use, shared by the replicas)
    device: str
    replica_id: int
    captures: tuple

    def run(self) -> None:
        function = self.function()  # built outside the device scope, as in the trace
        with tf.device(self.device):
            function(tf.constant(self.replica_id, tf.int32), *self.captures)


def dependents(graph, sources: set) -> set:
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


def ancestors(ops_: list) -> set:
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


def copy_ops(source_ops: list, op_map: dict) -> None:
    """Copies `source_ops` (in order) into the default graph, inputs through `op_map`."""
    graph = ops.get_default_graph()
    for op in source_ops:
        controls = [op_map[c] for c in op.control_inputs if c in op_map]
        with ops.control_dependencies(controls):
            # create_op without its deprecated-argument wrapper (a third of the copy's time).
            copied = graph._create_op_internal(
                op.type, [op_map[t] for t in op.inputs], [t.dtype for t in op.outputs],
                attrs={k: v for k, v in op.node_def.attr.items() if not k.startswith("_class")},
                name=op.name)
        copied._set_device_from_string(op.device)
        op_map[op] = copied
        for old, new in zip(op.outputs, copied.outputs):
            op_map[old] = new
            copy_handle(old, new)


@contextlib.contextmanager
def calls_made(into: list) -> Iterator[list]:
    """Appends to `into` the function calls (`PartitionedCall` ops) the default graph gains meanwhile."""
    graph = ops.get_default_graph()
    before = len(graph.get_operations())
    yield into
    into.extend(op for op in graph.get_operations()[before:] if op.type.endswith("PartitionedCall"))


def compiled_by_xla(graph) -> bool:
    """Whether `graph` calls a function compiled by XLA (`jit_compile=True`)."""
    return any(op.type.endswith("PartitionedCall") and "_XlaMustCompile" in op.node_def.attr
               for op in graph.get_operations())


def copy_handle(old: tf.Tensor, new: tf.Tensor) -> None:
    """A resource's or variant's handle data (its dtype and shape) copied to its copy."""
    if old.dtype in (tf.resource, tf.variant):
        handle_data_util.copy_handle_data(old, new)


def input_free_ops(traced, stays: Callable[[tf.Tensor], bool]) -> list:
    """The side effects (control outputs) of `traced` (replica_id, *inputs) that need
    no input (nor anything that does), but for writes `stays` keeps (see below)."""
    graph = traced.graph
    n_captures = len(traced.captured_inputs)
    inputs = graph.inputs[1:len(graph.inputs) - n_captures]
    captures = graph.inputs[len(graph.inputs) - n_captures:]
    staying = {id(t) for t, c in zip(captures, traced.captured_inputs) if stays(c)}
    dependent = dependents(graph, {t.op for t in inputs})
    return [op for op in graph.control_outputs if op not in dependent
            and not any(id(t) in staying for t in op.inputs)]


def input_free_effects(traced, stays: Callable[[tf.Tensor], bool]) -> tuple[object, list[int]] | None:
    """The side effects of `traced` (replica_id, *inputs) that need no input, as a function.

    Returns `(function, used)`: `function()` is the `ConcreteFunction` whose call
    `(replica_id, *[captures[i] for i in used])` runs those effects (and the ops they
    depend on) as the step would; or None when every side effect of the step depends
    on its inputs. It is built on its first call, not with the trace: most calls never
    find the iterator exhausted, and it copies every op those effects need (AdamW's
    weight decay of every variable: 10% of a transformer LM's trace on 4 replicas).

    `stays(capture)`: whether writes to a captured resource are left out even when
    they need no input. For a metric's variables: a count can need no data
    (Keras's loss tracker adds `tf.shape(x)[0]`, a constant when the batch shape
    is static), and one device then counts a batch that never came (it logs 8/9
    of the mean of 8 batches' losses): the mean of the batches is kept. For a
    collective launcher's key counter and ordering token: they go with the
    collectives that read them.
    """
    graph = traced.graph
    n_captures = len(traced.captured_inputs)
    replica_id = graph.inputs[0]
    captures = graph.inputs[len(graph.inputs) - n_captures:]
    effects = input_free_ops(traced, stays)
    if not effects:
        return None
    needed = ancestors(effects)
    used = [i for i, t in enumerate(captures) if t.op in needed]
    arguments = {replica_id.op, *(t.op for t in captures)}
    order = [op for op in graph.get_operations() if op in needed and op not in arguments]
    functions = list(graph._functions.values())

    def exhausted_step_effects(rid, *capture_args):
        for f in functions:
            ops.get_default_graph()._add_function_recursive(f)
        op_map = object_identity.ObjectIdentityDictionary()
        for old, new in zip([replica_id, *(captures[i] for i in used)], [rid, *capture_args]):
            copy_handle(old, new)
            op_map[old] = new
            op_map[old.op] = new.op
        copy_ops(order, op_map)
        return []

    specs = [tf.TensorSpec([], tf.int32), *(tf.TensorSpec(captures[i].shape, captures[i].dtype) for i in used)]

    @functools.cache
    def function():
        return tf.function(exhausted_step_effects, autograph=False).get_concrete_function(*specs)

    return function, used


# --- recording while Keras's train function is traced ---------------------------------

_recording = threading.local()


def recording() -> bool:
    """Whether a train function wrapped here is being called (and maybe traced) in this thread."""
    return getattr(_recording, "sink", None) is not None


def record(traced, replicas: list[tuple[str, int, list]], stays: Callable[[tf.Tensor], bool]) -> None:
    """Records the input-free effects of `traced` for `replicas` ((device, replica id, captures)
    each) if a train function wrapped here is being traced in this thread; else does nothing.

    A capture that is not an eager tensor (a value of the caller's graph) cannot be
    passed after the call failed: then nothing is recorded, and the step counts as
    before (docs/input.md)."""
    if not recording():
        return
    sink = _recording.sink
    found = input_free_effects(traced, stays)
    if found is None:
        return
    function, used = found
    for device, replica_id, captures in replicas:
        chosen = tuple(captures[i] for i in used)
        if not all(isinstance(c, ops.EagerTensor) for c in chosen):
            sink[_UNRUNNABLE] = None  # some replica's effects cannot run on their own: none run
            return
        # Keyed by replica: a function traced twice in one call records its last trace once.
        sink[replica_id] = ReplicaEffects(function, device, replica_id, chosen)


_UNRUNNABLE = "unrunnable"


def _with_exhausted_step_effects(train_function):
    """`train_function`, which runs the recorded effects when its call finds the iterator exhausted."""
    recorded: dict = {}

    @functools.wraps(train_function)
    def call(*args, **kwargs):
        sink: dict = {}
        _recording.sink = sink
        try:
            return train_function(*args, **kwargs)
        except tf.errors.OutOfRangeError:
            _keep(recorded, sink)
            if _UNRUNNABLE not in recorded:
                for effects in recorded.values():
                    effects.run()
            raise
        finally:
            _recording.sink = None
            _keep(recorded, sink)

    call._kr_exhausted_step_effects = recorded
    return call


def _keep(recorded: dict, sink: dict) -> None:
    if sink:  # traced during this call: keep the newest trace's effects
        recorded.clear()
        recorded.update(sink)
        sink.clear()


def _make_train_function(original):
    @functools.wraps(original)
    def make_train_function(self, force=False):
        result = original(self, force)
        function = self.train_function
        if (function is not None and not hasattr(function, "_kr_exhausted_step_effects")
                and ours(self.distribute_strategy) and not self.run_eagerly
                and self.steps_per_execution == 1):
            self.train_function = _with_exhausted_step_effects(function)
        return self.train_function if result is not None else result

    return make_train_function


# The attributes of the probe's inner step (a test makes it strict, `_noinline`, to see the refusal).
_PROBE_STEP_ATTRIBUTES: dict = {}


def _inlined_step_runs_input_free_effects() -> str | None:
    """The behaviour this module reproduces, checked on one device: a `tf.function` called in
    another, fed from an exhausted iterator, still runs its ops that need no input."""
    ran = []
    with tf.init_scope():

        @tf.function(experimental_attributes=_PROBE_STEP_ATTRIBUTES or None)
        def step(x):
            tf.py_function(lambda: ran.append(1) or 0, [], tf.int32)
            return x + 1

        @tf.function
        def train(iterator):
            return step(next(iterator))

        try:
            train(iter(tf.data.Dataset.range(0)))
        except tf.errors.OutOfRangeError:
            pass
    if ran:
        return None
    return ("a step called on an exhausted iterator no longer runs its input-free ops on one "
            "device (non-strict inlining); the effects this module adds would be one step too many")


# Checked once per process, before the patch applies (`effects_before_fetch` checks it too).
NON_STRICT_INLINING = patching.behaves(
    "tensorflow's inlined tf.function on an exhausted iterator (runs its input-free ops)",
    _inlined_step_runs_input_free_effects, key=lambda: dict(_PROBE_STEP_ATTRIBUTES) or None)

# Installed by keras_replicator._compat.install(), undone by uninstall().
PATCHES = (ScopedPatch(tf_trainer.TensorFlowTrainer, "make_train_function", _make_train_function,
                       guards=[NON_STRICT_INLINING]),)
