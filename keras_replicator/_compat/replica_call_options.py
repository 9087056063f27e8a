"""Grappler's settings for the calls of a step traced once: one per replica's device, and the
call of the function that holds them (Keras's train and test functions).

What it sets: `context.function_call_options` (its `config_proto`), while the
replica calls are made, so that each call's `PartitionedCall` carries them:
one round of passes, no memory optimiser on CPUs, or no Grappler at all for
calls of functions `grappler_once` optimised already. And, while Keras calls
its train or test function eagerly, lean settings for that call
alone (`outer_call_config`; a patch of `TensorFlowTrainer._make_function`,
stacked on `keras_xla`'s): the calls Keras's trace makes in its graph keep the
thread's own settings.
Checked on TensorFlow 2.16-2.21, Keras 3.8-3.15.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import tensorflow as tf
from keras.src.backend.tensorflow import trainer as tf_trainer
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context

from keras_replicator._compat.patching import ScopedPatch, ours


def on_cpus(devices: list[str]) -> bool:
    """Whether every one of `devices` is a CPU."""
    return all(tf.DeviceSpec.from_string(d).device_type == "CPU" for d in devices)


def call_config(devices: list[str]) -> tuple[config_pb2.ConfigProto, bool]:
    """The `config_proto` of the replica calls on `devices`, and whether it differs from the context's.

    Why: Grappler runs each time a device instantiates the replica's function
    (`PartitionedCallOp` optimises what it instantiates), so once per replica,
    where a step traced per replica had it run once on the whole graph. Measured
    on ResNet-50 (4 replicas, TF 2.21): a second round of every pass changed
    under 2% of the nodes and took 30% of Grappler's time; the memory optimiser
    (which saves accelerator memory) took 10% more. So, unless the user set them:
    one round, and no memory optimiser where every device is a CPU. The first
    call fell from 10.3 s to 8.2 s; the steady step did not change. The same
    settings serve `grappler_once`, which runs Grappler once for all the calls.
    """
    ctx = context.context()
    config = ctx.config
    rewrite = config.graph_options.rewrite_options
    changed = False
    if rewrite.meta_optimizer_iterations == rewriter_config_pb2.RewriterConfig.DEFAULT_NUM_ITERS:
        rewrite.meta_optimizer_iterations = rewriter_config_pb2.RewriterConfig.ONE
        changed = True
    if on_cpus(devices) and rewrite.memory_optimization == rewriter_config_pb2.RewriterConfig.DEFAULT_MEM_OPT:
        rewrite.memory_optimization = rewriter_config_pb2.RewriterConfig.NO_MEM_OPT
        changed = True
    return config, changed


def _place_softly_as_tensorflow_does(ctx, config: config_pb2.ConfigProto) -> None:
    """Soft placement unless the user chose, as TensorFlow's own function call options have it."""
    if ctx._soft_device_placement is None:
        config.allow_soft_placement = True


@contextlib.contextmanager
def grappler_settings(devices: list[str], optimized_once: bool = False) -> Iterator[None]:
    """Grappler's settings for the replica calls made meanwhile (their `config_proto`).

    `call_config`'s settings; with `optimized_once` (the calls' functions were
    optimised by `grappler_once`), the meta optimizer off instead.
    """
    ctx = context.context()
    config, changed = call_config(devices)
    if optimized_once:
        config.graph_options.rewrite_options.disable_meta_optimizer = True
        changed = True
    if not changed:
        yield
        return
    _place_softly_as_tensorflow_does(ctx, config)
    saved = ctx._thread_local_data.function_call_options
    ctx.function_call_options = context.FunctionCallOptions(
        executor_type=ctx.function_call_options.executor_type, config_proto=config)
    try:
        yield
    finally:
        ctx._thread_local_data.function_call_options = saved


# What Grappler still does for the function holding the replica calls: its passes that
# shrink a graph of many small ops (the per-device copies' reads and updates).
_OUTER_PASSES = ("pruning", "common_subgraph_elimination", "dependency")


def outer_call_config(strategy) -> config_pb2.ConfigProto | None:
    """The `config_proto` of the eager call of a function holding the calls of a step traced once;
    None to call it with the thread's own.

    Why: that function's graph holds, besides one call per device, every device's
    reads of its variables' copies and their updates, all-reduces and metrics:
    19,352 nodes on 8 replicas of ResNet-50, where Grappler's default passes took
    11.5 s of the first call (TF 2.21, 2 CPUs) and changed it only by pruning,
    merging common subgraphs and removing redundant control edges (the replica
    calls' functions are optimised apart). So, where every device is a CPU, with
    2 or more of them, and the user left Grappler's pass list and meta optimizer
    alone: those three passes, one round, no TFG pass (1.3 s there; the steady
    step paired against the default passes 0.98x-1.11x, the weights bitwise equal:
    `benchmarks/results/partial_runs.md`).
    Applied to a call only if its function's steps were all traced once
    (`outer_call_traced`): a step traced per replica is that function's graph.
    """
    extended = getattr(strategy, "extended", None)
    devices = list(getattr(extended, "worker_devices", ()))
    if not (ours(strategy) and getattr(extended, "trace_once", False) and len(devices) >= 2
            and on_cpus(devices)):
        return None
    ctx = context.context()
    config = ctx.config
    rewrite = config.graph_options.rewrite_options
    if rewrite.disable_meta_optimizer or rewrite.optimizers or rewrite.custom_optimizers:
        return None
    rewrite.optimizers.extend(_OUTER_PASSES)
    if rewrite.meta_optimizer_iterations == rewriter_config_pb2.RewriterConfig.DEFAULT_NUM_ITERS:
        rewrite.meta_optimizer_iterations = rewriter_config_pb2.RewriterConfig.ONE
    if "disable_tfg_optimizer" in rewrite.DESCRIPTOR.fields_by_name:
        rewrite.disable_tfg_optimizer = True  # its import and export alone: it changes nothing here
    _place_softly_as_tensorflow_does(ctx, config)
    return config


class _OuterCall:
    """What the traces made while one Keras function was called found: steps traced once, or per replica."""

    __slots__ = ("once", "per_replica")

    def __init__(self):
        self.once = self.per_replica = False


_outer = threading.local()  # the record of the Keras function being called in this thread


def outer_call_traced(once: bool) -> None:
    """Records, for the Keras function being called (if any), a step traced once or per replica.

    A function with any step traced per replica is that step's whole graph: it keeps
    every Grappler pass (see `outer_call_config`)."""
    record = getattr(_outer, "record", None)
    if record is not None:
        if once:
            record.once = True
        else:
            record.per_replica = True


class _EagerCallOptions(context.FunctionCallOptions):
    """`config` for a function called eagerly whose steps were all traced once; else, and for
    calls traced into a graph, `graph_calls`'s."""

    __slots__ = ["_graph_calls", "_record"]

    def __init__(self, graph_calls: context.FunctionCallOptions, config: config_pb2.ConfigProto,
                 record: _OuterCall):
        super().__init__(executor_type=graph_calls.executor_type, config_proto=config)
        self._graph_calls, self._record = graph_calls, record

    def as_attrs(self):
        if context.executing_eagerly() and self._record.once and not self._record.per_replica:
            return super().as_attrs()
        return self._graph_calls.as_attrs()


def _with_outer_call_config(function, config: config_pb2.ConfigProto):
    record = _OuterCall()  # kept from call to call: the traces of the first calls decide

    @functools.wraps(function)
    def call(*args, **kwargs):
        ctx = context.context()
        saved, outer = ctx._thread_local_data.function_call_options, getattr(_outer, "record", None)
        ctx.function_call_options = _EagerCallOptions(ctx.function_call_options, config, record)
        _outer.record = record
        try:
            return function(*args, **kwargs)
        finally:
            ctx._thread_local_data.function_call_options = saved
            _outer.record = outer

    return call


def _outer_call_make_function(original):
    @functools.wraps(original)
    def _make_function(self, step_function):
        function = original(self, step_function)
        config = None if self.run_eagerly else outer_call_config(self._distribute_strategy)
        return function if config is None else _with_outer_call_config(function, config)

    return _make_function


# Installed by keras_replicator._compat.install(), undone by uninstall(); after keras_xla's.
PATCHES = (ScopedPatch(tf_trainer.TensorFlowTrainer, "_make_function", _outer_call_make_function),)
