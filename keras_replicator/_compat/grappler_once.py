"""Grappler run once for the function every replica's device calls alike.

Why: a step traced once is one function called on every device, and each
device's `PartitionedCall` instantiates it and runs Grappler on it
(`PartitionedCallOp` optimises what it instantiates): N identical runs of the
same passes over the same graph, where one device runs one. Measured on
ResNet-50's first `fit` step, 4 simulated CPU devices, TF 2.21: Grappler's
passes summed 9.45 s and the first call took 20.7 s; with the stages optimised
here once and their calls not optimised again, 4.19 s and 12.0 s, the weights
after the step bitwise the same.

What we do, on one machine's CPU devices: the function's graph goes through
Grappler's meta optimizer once, offline (`tf_optimizer.OptimizeGraph`, on a
virtual cluster of one CPU, with the settings the calls would have had, see
`replica_call_options`), its inputs, outputs and control outputs kept; the
optimised graph is imported into a new function with the same flat inputs and
outputs; the calls of that function are made with the meta optimizer off. The
stages of a trace split at its all-reduces (`reduce_between_calls`) are built
the same way, from the trace's serialised nodes, with no copy of its ops.
The ops the trace did not place are placed on the first device while Grappler
runs (its CPU rewrites, such as the fused convolutions, look for a CPU) and
left unplaced again, so that each call places them on its own device.

Where it does not apply (a device that is not a CPU, one device, the meta
optimizer turned off by the user, a part compiled by XLA, or Grappler failing
offline) the function is returned as it was and every device optimises its call.

The one run leaves out the passes that cannot change the graph on CPUs (`without_idle_passes`).

What it uses, checked on TensorFlow 2.16-2.21: `tf_optimizer.OptimizeGraph`,
`grappler.cluster.Cluster(devices=...)` (a virtual cluster),
`importer.import_graph_def`, a `ConcreteFunction`'s `graph` (`inputs`,
`outputs`, `control_outputs`, `as_graph_def`), the `_noinline` and `_disable_acd`
function attributes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import (
    config_pb2,
    device_properties_pb2,
    meta_graph_pb2,
    rewriter_config_pb2,
)
from tensorflow.python.framework import importer, ops
from tensorflow.python.grappler import cluster as grappler_cluster
from tensorflow.python.grappler import tf_optimizer
from tensorflow.python.util import nest

from keras_replicator._compat import exhausted_step, replica_call_options

_log = logging.getLogger("keras_replicator")
_failed: set[str] = set()


def applies(devices: list[str], config: config_pb2.ConfigProto) -> bool:
    """Whether the calls on `devices` optimised with `config` can share one run of Grappler."""
    if len(devices) < 2 or config.graph_options.rewrite_options.disable_meta_optimizer:
        return False
    return replica_call_options.on_cpus(devices)


def optimized(function, devices: list[str], config: config_pb2.ConfigProto):
    """`function` optimised once by Grappler, for calls made with the meta optimizer off.

    The result is called as `function` is (`_call_flat(arguments, captures)`,
    its captures the same, in the same order) and returns `function.graph.outputs`
    flat (`structured` gives them `function`'s structure). None where it
    does not apply (see the module's docstring): call `function` as before.
    """
    graph = function.graph
    if not applies(devices, config) or exhausted_step.compiled_by_xla(graph):
        return None
    signature = _Signature([t.name for t in graph.inputs], list(graph.inputs), list(graph.outputs),
                           [op.name for op in graph.control_outputs], list(function.captured_inputs))
    return _or_none(lambda: _function_from(_optimized_graph_def(graph.as_graph_def(), signature, devices, config),
                                           signature))


def optimized_stages(graph, stages: list[list], feeds: list[list], exports: list[list], devices: list[str], config):
    """Each stage of `graph` (`reduce_between_calls`: its ops, the trace tensors it is fed, those it
    exports) as a function optimised once, taking `feeds[i]` and returning `exports[i]`; or None.

    Built from the trace's graph as it was serialised, not from a copy of its ops: a
    stage's graph is its ops' nodes, a placeholder for each tensor it is fed, its
    control inputs from other stages dropped (the calls run the stages in order).
    """
    if not applies(devices, config) or exhausted_step.compiled_by_xla(graph):
        return None
    graph_def = graph.as_graph_def()
    nodes = {node.name: node for node in graph_def.node}
    must_run = {op.name for op in graph.control_outputs}

    def build():
        functions = []
        for stage, stage_feeds, stage_exports in zip(stages, feeds, exports):
            sub = _stage_graph_def(graph_def, nodes, stage, stage_feeds)
            signature = _Signature([f"kr_stage_input_{k}:0" for k in range(len(stage_feeds))], stage_feeds,
                                   stage_exports, [op.name for op in stage if op.name in must_run], [])
            functions.append(_function_from(_optimized_graph_def(sub, signature, devices, config), signature))
        return functions

    return _or_none(build)


@dataclass
class _Signature:
    """What Grappler's one run keeps and the new function takes and returns."""

    input_names: list  # in the graph optimised: its arguments, then its captures
    inputs: list  # the tensors they stand for (their dtype, shape and handle data)
    outputs: list  # tensors, by name in the graph optimised
    control_names: list  # the side effects (control outputs) to run
    captures: list  # the captured tensors the last inputs stand for


def _or_none(build):
    try:
        return build()
    except (tf.errors.OpError, ValueError, TypeError, KeyError) as e:  # refused: each call optimises itself
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        if reason not in _failed:
            _failed.add(reason)
            _log.info("Grappler runs once per replica's call, not once for all: %s", reason)
        return None


def _stage_graph_def(graph_def, nodes: dict, stage: list, feeds: list) -> graph_pb2.GraphDef:
    sub = graph_pb2.GraphDef()
    sub.library.CopyFrom(graph_def.library)
    sub.versions.CopyFrom(graph_def.versions)
    fed = {}  # a NodeDef input naming a fed tensor -> its placeholder
    for k, t in enumerate(feeds):
        node = sub.node.add(name=f"kr_stage_input_{k}", op="Placeholder")
        node.attr["dtype"].type = t.dtype.as_datatype_enum
        node.attr["shape"].shape.CopyFrom(t.shape.as_proto())
        fed[t.op.name if t.value_index == 0 else t.name] = f"kr_stage_input_{k}"
    names = {op.name for op in stage}
    for op in stage:
        node = sub.node.add()
        node.CopyFrom(nodes[op.name])
        inputs = [fed.get(i, i) for i in node.input if not i.startswith("^") or i[1:] in names]
        del node.input[:]
        node.input.extend(inputs)
    return sub


# Functional control flow: where TFG's passes (its control-flow sink) may change the graph.
_CONTROL_FLOW = frozenset({"If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase"})


def without_idle_passes(config, graph_def) -> config_pb2.ConfigProto:
    """`config` for the one run, without the passes that cannot change `graph_def` on CPUs.

    Why: on SN-GAN's replica function (4 replicas, TF 2.21) the layout optimiser took 0.2 s
    and TFG 0.25 s of the run's 0.9 s CPU, and the graph they gave was the same without
    them: the layout one converts no NHWC graph on CPUs; TFG's passes, without functional
    control flow, re-encode constants and spell out default attributes. So: no layout pass
    where no op has an NC... data format, no TFG where no op is an If, While or Case (in the
    graph and its functions), unless the user set the layout optimizer.
    """
    nodes = [*graph_def.node, *(n for f in graph_def.library.function for n in f.node_def)]
    lean = config_pb2.ConfigProto()
    lean.CopyFrom(config)
    rewrite = lean.graph_options.rewrite_options
    channels_first = any(n.attr["data_format"].s.startswith(b"NC") for n in nodes if "data_format" in n.attr)
    if rewrite.layout_optimizer == rewriter_config_pb2.RewriterConfig.DEFAULT and not channels_first:
        rewrite.layout_optimizer = rewriter_config_pb2.RewriterConfig.OFF
    if "disable_tfg_optimizer" in rewrite.DESCRIPTOR.fields_by_name and not any(n.op in _CONTROL_FLOW for n in nodes):
        rewrite.disable_tfg_optimizer = True
    return lean


def _optimized_graph_def(graph_def, signature: _Signature, devices: list[str], config) -> graph_pb2.GraphDef:
    config = without_idle_passes(config, graph_def)
    device = tf.DeviceSpec.from_string(devices[0]).to_string()
    placed = set()
    for node in graph_def.node:
        if not node.device:
            node.device = device
            placed.add(node.name)
    meta_graph = meta_graph_pb2.MetaGraphDef()
    meta_graph.graph_def.CopyFrom(graph_def)
    # Grappler keeps the fetches and what they need: the outputs, the side effects
    # (control outputs) and the arguments, so that the signature stays.
    keep = signature.input_names + [t.name for t in signature.outputs] + signature.control_names
    meta_graph.collection_def["train_op"].node_list.value.extend(keep)
    cpu = device_properties_pb2.DeviceProperties(type="CPU")
    cluster = grappler_cluster.Cluster(devices=[device_properties_pb2.NamedDevice(name=device, properties=cpu)])
    try:
        optimized_def = tf_optimizer.OptimizeGraph(config, meta_graph, verbose=False, cluster=cluster)
    finally:
        cluster.Shutdown()
    arguments = {name.split(":")[0] for name in signature.input_names}
    body = graph_pb2.GraphDef()
    body.library.CopyFrom(optimized_def.library)
    body.versions.CopyFrom(optimized_def.versions)
    for node in optimized_def.node:
        if node.name in arguments:
            continue  # the new function's own arguments stand for them
        if node.name in placed or node.device == device:
            node.device = ""  # each call places it on its own device
        body.node.add().CopyFrom(node)
    kept = {node.name for node in body.node}
    for node in body.node:
        if "_class" in node.attr:  # colocation with an argument: the argument is the new function's
            groups = [g for g in node.attr["_class"].list.s if g.decode()[len("loc:@"):] in kept]
            del node.attr["_class"].list.s[:]
            node.attr["_class"].list.s.extend(groups)
            if not groups:
                del node.attr["_class"]
    return body


def _function_from(body: graph_pb2.GraphDef, signature: _Signature):
    """A function of the signature's arguments (then captures) running `body`, returning its outputs flat."""
    used = {name if ":" in name else name + ":0"
            for node in body.node for name in node.input if not name.startswith("^")}
    output_names = [t.name for t in signature.outputs]
    n_arguments = len(signature.inputs) - len(signature.captures)

    def optimized_step(*args):
        step_graph = ops.get_default_graph()
        # The captures in the same order, so that the call swaps them as the original's.
        tensors = [*args, *(step_graph.capture(c) for c in signature.captures)]
        for old, new in zip(signature.inputs, tensors):
            exhausted_step.copy_handle(old, new)
        imported = importer.import_graph_def(
            body, input_map={name: t for name, t in zip(signature.input_names, tensors) if name in used},
            return_elements=output_names + signature.control_names, name="")
        outputs = imported[:len(output_names)]
        # No automatic control dependencies: the imported graph has the orderings the trace had.
        step_graph.control_outputs.extend(imported[len(output_names):])
        for old, new in zip(signature.outputs, outputs):
            exhausted_step.copy_handle(old, new)
        return outputs

    specs = [tf.TensorSpec(t.shape, t.dtype) for t in signature.inputs[:n_arguments]]
    new = tf.function(optimized_step, autograph=False,
                      experimental_attributes={"_noinline": True, "_disable_acd": True})
    return new.get_concrete_function(*specs)


def structured(function, flat: list):
    """The flat outputs of `optimized(function, ...)` in `function`'s output structure."""
    template = nest.flatten(function.structured_outputs, expand_composites=True)
    results = iter(flat)
    filled = [None if t is None else next(results) for t in template]
    return nest.pack_sequence_as(function.structured_outputs, filled, expand_composites=True)


def whole_call(function, devices: list[str], config):
    """The call of a whole step `(replica_id, inputs, captures) -> outputs`, optimised once; or None."""
    once = optimized(function, devices, config)
    if once is None:
        return None

    def call(replica_id, inputs: list, captures: list):
        return structured(function, nest.flatten(once._call_flat([replica_id, *inputs], captures)))

    return call
