"""The replica step traced once and called on every replica's device.

TensorFlow's `mirrored_run.call_for_each_replica` (used by `MirroredExtended` and
`CollectiveAllReduceExtended`) traces the replica function once per replica, in a thread per
replica, into one graph with N copies of the step, and joins the threads at every `merge_call`.
Start-up then grows with the replicas (tensorflow/tensorflow#35346, #44698). Here the step is traced
once, as replica 0, into a `ConcreteFunction`; every replica calls it with its own inputs, its own
variables' components and its own collective launcher, as `TPUStrategy` does through
`tpu.replicate`.

What it patches or reads, checked on TensorFlow 2.21:

* subclasses `mirrored_run._MirroredReplicaContext` (the replica id becomes a tensor input;
  `all_gather` by a collective; a `merge_call` means "trace per replica instead");
* `MirroredExtended._use_merge_call` and `_get_cross_device_ops` (overridden by the engines while
  tracing: cross-replica work takes TensorFlow's own merge-call-free path, the collectives of each
  device's launcher, as `MirroredStrategy` does under XLA on GPUs);
* `values.apply_aggregation_replica_context` (scoped to the trace: an `ONLY_FIRST_REPLICA` update
  such as Keras's `iterations.assign_add(1)` needs no broadcast when its value is a constant or is
  the same on every replica by its graph (`replica_invariance`: spectral normalization's `u`), else
  it is replica 0's value, broadcast by an all-reduce);
* `ops.Graph._apply_device_functions` (scoped to the trace: ops the step pins to replica 0's device
  get no device, so that each call places them on its own);
* `ConcreteFunction._call_flat(inputs, captured_inputs)`, with the captures of replica 0 swapped for
  another replica's: variable components, launchers' counters and ordering tokens;
* the `_disable_acd` function attribute: the N calls live in one function without automatic control
  dependencies, so that no two calls are chained through a resource they share (they wait for each
  other in collectives);
* `context.function_call_options` (set while the calls are made): the calls' Grappler settings
  (`replica_call_options`; once for all on CPUs, `grappler_once`);
* the assignments of mean-aggregated moving statistics, all-reduced together at the step's end
  (`deferred_statistics`).

A trace whose side effects include some that need no input runs them as the inlined step of one
device does on an exhausted iterator (`effects_before_fetch`): before the fetch in a custom loop,
else after Keras's train function failed.

What cannot be traced once falls back to TensorFlow's per-replica tracing, logged once with the
reason: a `merge_call` this module does not replace, variables created in the step, per-replica
inputs that are not tensors, and eager execution (nothing to trace).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf
from tensorflow.python.autograph.core import ag_ctx
from tensorflow.python.autograph.impl import api as autograph
from tensorflow.python.distribute import device_util, distribute_utils, mirrored_run
from tensorflow.python.distribute import values as tf_values
from tensorflow.python.framework import auto_control_deps_utils, ops, tensor_util
from tensorflow.python.util import nest

from keras_replicator._compat import (
    collective_launcher,
    deferred_statistics,
    effects_before_fetch,
    exhausted_step,
    grappler_once,
    reduce_between_calls,
    replica_call_options,
    replica_invariance,
)
from keras_replicator._compat.patching import Patches, ScopedPatch
from keras_replicator.model_parallel import fsdp

_log = logging.getLogger("keras_replicator")


class PerReplicaTraceNeeded(Exception):
    """The step does something that needs TensorFlow's per-replica tracing (the reason)."""


# --- the replica context of the single trace ---------------------------------------


class OnceReplicaContext(mirrored_run._MirroredReplicaContext):
    """The replica context of the one trace: replica 0 for lookups, the id a tensor.

    Variables and launchers are looked up as replica 0's (a Python index) and
    swapped per call; `replica_id_in_sync_group` is the function's input, so
    per-replica randomness and `kr.replica_id()` stay per replica.
    """

    def __init__(self, strategy, replica_id_in_sync_group: int, replica_id: tf.Tensor, launcher):
        super().__init__(strategy, replica_id_in_sync_group=replica_id_in_sync_group)
        self._kr_replica_id = replica_id
        self._kr_launcher = launcher

    @property
    def replica_id_in_sync_group(self) -> tf.Tensor:
        return self._kr_replica_id

    def _merge_call(self, fn, args, kwargs):
        name = getattr(fn, "__qualname__", repr(fn))
        raise PerReplicaTraceNeeded(f"the step calls merge_call({name})")

    def all_gather(self, value, axis, options=None):
        options = options or tf.distribute.experimental.CommunicationOptions()
        launcher = self._kr_launcher
        ctx = self

        def one(x):
            @tf.custom_gradient
            def gather(x):
                y = launcher.all_gather(x, axis, options)

                def grad(dy):
                    # Every replica's loss reads the gathered value: sum their
                    # gradients, then keep this replica's slice.
                    total = ctx.all_reduce(tf.distribute.ReduceOp.SUM, dy, options)
                    sizes = launcher.all_gather(tf.shape(x)[axis:axis + 1], 0, options)
                    start = tf.reduce_sum(sizes[: ctx._kr_local_index()])
                    begin = tf.tensor_scatter_nd_update(
                        tf.zeros([tf.rank(dy)], tf.int32), [[axis]], [start])
                    return tf.slice(total, begin, tf.shape(x))

                return y, grad

            return gather(tf.convert_to_tensor(x))

        return nest.map_structure(one, value)

    def _kr_local_index(self) -> tf.Tensor:
        base = self._strategy.extended._get_replica_id_in_sync_group(0)
        return self._kr_replica_id - base


# --- what is swapped per replica --------------------------------------------------


class ComponentRegistry:
    """The components of every distributed variable an engine made, by handle.

    `(variable, i)` for the handle of component `i`: what a traced call on
    replica `d` swaps replica 0's handle for. Weak: a dead variable's entry is
    ignored.
    """

    def __init__(self):
        self._by_handle: dict[int, tuple[weakref.ref, int]] = {}
        self._lock = threading.Lock()

    def add(self, variable) -> None:
        components = getattr(variable, "_values", None)
        if not components:
            return
        with self._lock:
            for i, component in enumerate(components):
                handle = getattr(component, "handle", None)
                if handle is not None:
                    self._by_handle[id(handle)] = (weakref.ref(variable), i)

    def on_read(self, handle) -> bool:
        """Whether `handle` is replica 0's component of a variable synchronised on read."""
        components = self.components(handle)
        variable = self._by_handle[id(handle)][0]() if components is not None else None
        return variable is not None and variable.synchronization == tf.VariableSynchronization.ON_READ

    def replica_slices(self, handle) -> bool:
        """Whether `handle`'s variable holds a different slice on each replica (FSDP)."""
        return fsdp.replica_slices((self._by_handle.get(id(handle)) or (lambda: None,))[0]())

    def components(self, handle) -> tuple | None:
        """The components of the variable `handle` is replica 0's component of, else None."""
        entry = self._by_handle.get(id(handle))
        if entry is None:
            return None
        variable, index = entry[0](), entry[1]
        if variable is None or index != 0 or variable._values[0].handle is not handle:
            return None
        return variable._values


def _launcher_swaps(launchers) -> dict[int, list]:
    """Replica 0's launcher state (key counter, ordering token) -> each replica's."""
    swaps: dict[int, list] = {}
    for attr in ("_executions", "_ordering_token"):
        states = [getattr(launcher, attr, None) for launcher in launchers]
        if states[0] is not None and all(s is not None for s in states):
            swaps[id(states[0].handle)] = [s.handle for s in states]
    return swaps


def _per_replica_captures(captured: list, n: int, registry: ComponentRegistry, swaps: dict) -> list[list]:
    """For each replica, the captured inputs of the trace with replica 0's swapped for its own."""
    per_replica = [[] for _ in range(n)]
    for tensor in captured:
        replacements = swaps.get(id(tensor))
        if replacements is None:
            components = registry.components(tensor)
            if components is not None and len(components) == n:
                replacements = [c.handle for c in components]
        for d in range(n):
            per_replica[d].append(tensor if replacements is None else replacements[d])
    return per_replica


# --- patches active while the one trace runs --------------------------------------

_tracing = threading.local()


def _trace_graphs() -> set:
    return getattr(_tracing, "graphs", set())


def _in_trace(graph) -> bool:
    graphs = _trace_graphs()
    while graph is not None:
        if id(graph) in graphs:
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def _device_free(original):
    def _apply_device_functions(self, op):
        original(self, op)
        pinned = getattr(_tracing, "device", None)
        if pinned and op.device and _in_trace(self) and _canonical(op.device) == pinned:
            op._set_device_from_string("")

    return _apply_device_functions


def _canonical(device: str) -> str:  # memoised per trace: `canonicalize` lists the logical devices per call
    names = _tracing.canonical
    return names[device] if device in names else names.setdefault(device, device_util.canonicalize(device))


def _same_on_every_replica(value) -> bool:
    shared = getattr(_tracing, "shared_capture", None)
    return shared is not None and replica_invariance.same_on_every_replica(value, _tracing.graph, shared)


def _first_replica_without_broadcast(original):
    def apply_aggregation_replica_context(value, aggregation, destinations):
        deferred = deferred_statistics.take(value, aggregation, destinations)
        if deferred is not None:
            return deferred  # the replica's own value now, the mean at the step's end
        if (
            aggregation != tf.VariableAggregation.ONLY_FIRST_REPLICA
            or not _in_trace(ops.get_default_graph())
            or not tensor_util.is_tf_type(value)
            or isinstance(value, tf.distribute.DistributedValues)
        ):
            return original(value, aggregation, destinations)
        if tensor_util.constant_value(value) is not None or _same_on_every_replica(value):
            return value  # every replica holds replica 0's value already: nothing to broadcast
        ctx = tf.distribute.get_replica_context()
        first = tf.equal(ctx.replica_id_in_sync_group, 0)
        masked = tf.where(first, value, tf.zeros_like(value))
        return ctx.strategy.extended._replica_ctx_all_reduce(tf.distribute.ReduceOp.SUM, masked)

    return apply_aggregation_replica_context


_TRACE_PATCHES = Patches([
    ScopedPatch(ops.Graph, "_apply_device_functions", _device_free),
    ScopedPatch(tf_values, "apply_aggregation_replica_context", _first_replica_without_broadcast),
])


def _create_outside_the_trace(next_creator, **kwargs):
    # As replica 0 of TensorFlow's per-replica tracing does, the strategy makes
    # every replica's component; here eagerly, so that the other components'
    # initial values (replica 0's value) need not be lifted out of the trace.
    with ops.init_scope():
        return next_creator(**kwargs)


@contextlib.contextmanager
def _tracing_scope(graph, device: str, shared_capture: Callable | None) -> Iterator[None]:
    """The patches of the trace; `shared_capture(t)`: whether a capture `t` is the
    same on every replica's call (None: take nothing as the same)."""
    graphs = _trace_graphs()
    previous = {name: getattr(_tracing, name, None) for name in ("device", "graph", "shared_capture", "canonical")}
    _tracing.graphs = graphs | {id(graph)}
    _tracing.device, _tracing.canonical = device_util.canonicalize(device), {}
    _tracing.graph, _tracing.shared_capture = graph, shared_capture
    try:
        with _TRACE_PATCHES.scope(), tf.variable_creator_scope(_create_outside_the_trace):
            yield
    finally:
        _tracing.graphs = graphs
        for name, value in previous.items():
            setattr(_tracing, name, value)


# --- the engine -------------------------------------------------------------------


def _split_inputs(args, kwargs, n: int):
    """Each replica's inputs: the structure (replica 0's), where its tensors are, and each replica's tensors.

    A leaf that is a tensor (or a composite tensor, by its components) is an
    input of the traced step; anything else (variables, Python values) must be
    the same object on every replica and is closed over.
    """
    per_replica = [distribute_utils.select_replica(i, (args, kwargs)) for i in range(n)]
    leaves = [nest.flatten(p) for p in per_replica]
    if len({len(f) for f in leaves}) != 1:
        raise PerReplicaTraceNeeded("the replicas' inputs differ in structure")
    layout = []  # per leaf: None (closed over) or the number of its tensor components
    tensors: list[list] = [[] for _ in range(n)]
    for i, leaf in enumerate(leaves[0]):
        if isinstance(leaf, tf.Tensor) or (
            isinstance(leaf, tf.__internal__.CompositeTensor) and not isinstance(leaf, tf.Variable)
        ):
            for d in range(n):
                components = nest.flatten(leaves[d][i], expand_composites=True)
                if not all(isinstance(c, tf.Tensor) for c in components):
                    raise PerReplicaTraceNeeded("a per-replica input is not made of tensors")
                tensors[d].extend(components)
            if len({len(t) for t in tensors}) != 1:
                raise PerReplicaTraceNeeded("the replicas' inputs differ in structure")
            layout.append(len(nest.flatten(leaf, expand_composites=True)))
            continue
        if any(f[i] is not leaf and not _same_constant(f[i], leaf) for f in leaves[1:]):
            raise PerReplicaTraceNeeded("a per-replica input is not a tensor")
        layout.append(None)
    return per_replica[0], leaves[0], layout, tensors


def _pack_inputs(structure, leaves: list, layout: list, inputs) -> tuple:
    """Replica 0's (args, kwargs) with its tensors replaced by the traced step's `inputs`."""
    inputs = list(inputs)
    packed = []
    for leaf, count in zip(leaves, layout):
        if count is None:
            packed.append(leaf)
        else:
            components, inputs = inputs[:count], inputs[count:]
            packed.append(nest.pack_sequence_as(leaf, components, expand_composites=True))
    return nest.pack_sequence_as(structure, packed)


def _same_constant(a, b) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def _shape_groups(tensors: list[list]) -> dict[tuple, list[int]]:
    """The replicas by their inputs' static shapes and dtypes: one trace per group.

    Every replica has the same shapes in a step (one trace), except a short last
    batch split unevenly (at most a few groups). Each trace keeps the exact
    static shapes that TensorFlow's per-replica tracing would have given it.
    """
    groups: dict[tuple, list[int]] = {}
    for d, replica_tensors in enumerate(tensors):
        signature = tuple((tuple(t.shape.as_list()) if t.shape.rank is not None else None, t.dtype)
                          for t in replica_tensors)
        groups.setdefault(signature, []).append(d)
    return groups


def _check_outputs(outputs) -> None:
    for leaf in nest.flatten(outputs, expand_composites=True):
        if isinstance(leaf, (tf.Variable, tf.distribute.DistributedValues)):
            raise PerReplicaTraceNeeded("the step returns a variable or distributed value")


def _refuse_shared_writes(traced, captures: list[list]) -> None:
    """Raises if the step writes a resource every replica shares (not a distributed variable's).

    Per-replica tracing orders the replicas' writes to it (automatic control
    dependencies); calls of one trace run concurrently, so their writes would
    race. Keras's loss tracker is such a variable when `compile` ran outside the
    strategy's scope.
    """
    graph = traced.graph
    read_only = set(auto_control_deps_utils.get_read_only_resource_input_indices_graph(graph))
    first_capture = len(graph.inputs) - len(captures[0])
    for i, tensor in enumerate(captures[0]):
        shared = all(c[i] is tensor for c in captures[1:])
        if shared and tensor.dtype == tf.resource and first_capture + i not in read_only:
            found = re.search(r'name="([^"]+)"', str(tensor)) if isinstance(tensor, ops.EagerTensor) else None
            name = found.group(1) if found else graph.inputs[first_capture + i].op.name
            raise PerReplicaTraceNeeded(
                f"the step writes a variable that is not mirrored ({name}; made outside "
                "strategy.scope()?)"
            )


def _shared_capture(registry: ComponentRegistry, launchers, devices) -> Callable | None:
    """Whether a capture of the trace is the same on every replica's call: not
    swapped per replica (see `_per_replica_captures`), or a mirrored variable's
    component. None where kernels may differ bit by bit across the devices."""
    if not replica_invariance.deterministic_devices(devices):
        return None
    per_replica_state = set(_launcher_swaps(launchers))

    def shared(tensor) -> bool:
        if id(tensor) in per_replica_state:
            return False
        return not registry.on_read(tensor) and not registry.replica_slices(tensor)

    return shared


def trace_replica_step(extended, fn: Callable, structure, leaves, layout, specs, launchers, defer: bool = True):
    """Traces `fn` once, as replica 0, for inputs of `specs`: a `ConcreteFunction`.

    `defer`: moving statistics all-reduced together at the step's end
    (`deferred_statistics`); traced again without where that cannot be.
    """
    strategy = extended._container_strategy()
    devices = extended.worker_devices
    fn = autograph.tf_convert(fn, ag_ctx.control_status_ctx(), convert_by_default=False)
    first_id = extended._get_replica_id_in_sync_group(0)
    shared_capture = _shared_capture(extended._kr_components, launchers, devices)

    between_calls = extended.between_calls_reduction() is not None
    cuts: list = []

    def replica_step(replica_id, *inputs):
        graph = ops.get_default_graph()
        step_args, step_kwargs = _pack_inputs(structure, leaves, layout, inputs)
        with _tracing_scope(graph, devices[0], shared_capture), extended.tracing_once(), OnceReplicaContext(
            strategy, first_id, replica_id, launchers[0]
        ), deferred_statistics.deferring(graph, defer), reduce_between_calls.recording(
            graph, between_calls) as recorded:
            outputs = fn(*step_args, **step_kwargs)
            deferred_statistics.flush()
            cuts[:] = recorded
        _check_outputs(outputs)
        return outputs

    # Not inlined: the caller's graph keeps one call per replica, and each
    # device instantiates (and optimises) one replica's graph.
    try:
        traced = tf.function(
            replica_step, autograph=False, experimental_attributes={"_noinline": True}
        ).get_concrete_function(tf.TensorSpec([], tf.int32), *specs)
    except deferred_statistics.Undeferrable:
        if not defer:
            raise
        return trace_replica_step(extended, fn, structure, leaves, layout, specs, launchers, defer=False)
    traced._kr_cuts = cuts  # its all-reduces to reduce between calls (reduce_between_calls)
    return traced


def call_once_per_replica(extended, fn: Callable, args, kwargs, registry: ComponentRegistry, launchers):
    """`call_for_each_replica` by one trace; raises `PerReplicaTraceNeeded` where it cannot."""
    devices = extended.worker_devices
    n = len(devices)
    structure, leaves, layout, tensors = _split_inputs(args, kwargs, n)
    swaps = _launcher_swaps(launchers)
    call_for: list = [None] * n  # each replica's call of its trace: (inputs, captures) -> outputs
    replica_ids = [extended._get_replica_id_in_sync_group(d) for d in range(n)]
    groups = _shape_groups(tensors)
    staged = None  # the one trace in stages, its all-reduces between the calls
    config, _ = replica_call_options.call_config(devices)
    once_stages = functools.partial(grappler_once.optimized_stages, devices=devices, config=config)
    once = True  # every call's function optimised by Grappler once for all (grappler_once)
    for signature, members in groups.items():
        specs = [tf.TensorSpec(shape, dtype) for shape, dtype in signature]
        traced = trace_replica_step(extended, fn, structure, leaves, layout, specs, launchers)
        captures = _per_replica_captures(list(traced.captured_inputs), n, registry, swaps)
        _refuse_shared_writes(traced, captures)
        # What needs no input runs as one device's inlined step runs it on an exhausted iterator.
        calls = effects_before_fetch.split_calls(
            traced, [(devices[d], replica_ids[d], captures[d]) for d in members], [tensors[d] for d in members],
            lambda capture: id(capture) in swaps or registry.on_read(capture))
        if calls is None and len(groups) == 1:
            staged = reduce_between_calls.split(traced, traced._kr_cuts, once_stages)
        whole = None if calls or staged else grappler_once.whole_call(traced, devices, config)
        once = once and (staged.optimized_once if staged else whole is not None)
        calls = calls or [whole or effects_before_fetch.call_whole(traced)] * len(members)
        for d, call in zip(members, calls):
            call_for[d] = functools.partial(call, captures=captures[d])

    def every_replica():
        graph = ops.get_default_graph()
        outputs, calls = [], []
        with replica_call_options.grappler_settings(devices, optimized_once=once):
            rids = []
            for d, device in enumerate(devices):
                with ops.device(device):
                    # Not a Const: Grappler would specialise the function per replica id.
                    rids.append(tf.raw_ops.PlaceholderWithDefault(
                        input=tf.constant(replica_ids[d], tf.int32), shape=[]))
            if staged is not None:
                outputs = reduce_between_calls.call_stages(
                    staged, [(devices[d], rids[d], [*tensors[d], *captures[d]]) for d in range(n)],
                    reduce_between_calls.reducer(extended.between_calls_reduction(), devices), calls)
            else:
                for d, device in enumerate(devices):
                    with ops.device(device), exhausted_step.calls_made(calls):
                        outputs.append(call_for[d](rids[d], tensors[d]))
        # No automatic control dependencies here (they would order no two calls
        # only if they shared no resource): every call is a control output, so
        # that none is pruned when its outputs are unused, and none waits for another.
        graph.control_outputs.extend(calls)
        return outputs

    every = tf.function(every_replica, autograph=False, experimental_attributes={"_disable_acd": True})
    outputs = every()
    replica_call_options.outer_call_traced(once=True)
    return distribute_utils.regroup(tuple(outputs))


_logged: set[str] = set()
_joined: weakref.WeakSet = weakref.WeakSet()


def _join_collective_group(extended, launchers) -> None:
    """Runs one small all-reduce on every local device, once per engine, before any step.

    Why: TensorFlow cancels for good a collective group that some device has not
    yet joined when a step fails (`CollectiveParamResolverLocal::CancelGroup`:
    "group is cancelled ... Restart your program"). A first step that fails on one
    replica (an error in the user's step, an empty batch) would leave every later
    step of the process failing. A complete group is never cancelled.
    """
    if extended in _joined or extended.num_workers > 1:
        return  # several workers: the group spans them; they join at the first step

    @tf.function(autograph=False)
    def join():
        sums = []
        for launcher, device in zip(launchers, extended.worker_devices):
            with ops.device(device):
                sums.append(launcher.all_reduce(tf.zeros([1]), None, None))
        return sums

    with ops.init_scope():
        join()
    _joined.add(extended)


# A `call_for_each_replica` inside another's `merge_call` (same thread) is part of its step.
_nested = threading.local()


def call_for_each_replica(extended, fn: Callable, args, kwargs, registry, launchers) -> Any:
    """The replica step on every replica: traced once where it can be, else per replica."""
    if launchers and not getattr(_nested, "depth", 0):
        collective_launcher.align_execution_counters(launchers)
        for group in getattr(extended, "logical_device_launchers", lambda: ())():
            collective_launcher.align_execution_counters(group)  # a replica's other devices' groups
    _nested.depth = getattr(_nested, "depth", 0) + 1
    try:
        return _call_for_each_replica(extended, fn, args, kwargs, registry, launchers)
    finally:
        _nested.depth -= 1


def _call_for_each_replica(extended, fn: Callable, args, kwargs, registry, launchers) -> Any:
    reason = _why_per_replica(extended, launchers)
    if reason is None:
        _join_collective_group(extended, launchers)
        try:
            return call_once_per_replica(extended, fn, args, kwargs, registry, launchers)
        except PerReplicaTraceNeeded as e:
            reason = str(e)
    if reason and reason not in _logged and len(extended.worker_devices) > 1:
        _logged.add(reason)
        _log.info("The step is traced once per replica, not once for all: %s.", reason)
    replica_call_options.outer_call_traced(once=False)
    return mirrored_run.call_for_each_replica(extended._container_strategy(), fn, args, kwargs)


def tracing_once() -> bool:
    """Whether the current replica context is the one trace of a step (no `merge_call` there)."""
    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return False
    return bool(getattr(tf.distribute.get_strategy().extended, "is_tracing_once", False))


def _why_per_replica(extended, launchers) -> str | None:
    if not extended.trace_once or len(extended.worker_devices) == 1:
        return ""  # asked for, or one replica (one trace already): nothing to say
    if not ops.inside_function():
        return "it runs eagerly"
    if launchers is None:
        name = type(getattr(extended, "cross_device_ops", None)).__name__
        return f"its all-reduce ({name}, as chosen) goes through merge_call"
    k = getattr(extended, "devices_per_replica", 1)
    if k > 1:
        # One trace would fix replica 0's logical devices in every replica's call.
        return f"a replica spans {k} devices (devices_per_replica={k}): ops are placed per replica"
    if getattr(extended._container_strategy(), "shard_optimizer_state", False):
        return "the optimizer state is sharded (each owner updates its own variables)"
    if extended.is_tracing_once:
        return "a strategy.run inside a traced step"
    return None
