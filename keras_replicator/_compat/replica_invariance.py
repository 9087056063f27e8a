"""Whether a value in the step traced once is the same on every replica, by its graph.

Why: an `ONLY_FIRST_REPLICA` variable takes replica 0's value. A step traced per
replica copies that tensor to the other devices; a step traced once must send it
by a collective (`replica_trace._first_replica_without_broadcast`). Spectral
normalization updates its `u` that way in every forward pass: 22 of the
SN-GAN's 44 collectives a step, each a round of the CPU ring. But `u`'s update
is computed from mirrored variables only, so every replica already holds replica
0's value: nothing needs sending.

A value is the same on every replica when everything it is computed from is:
constants, captures that every replica's call shares, mirrored variables
(synchronised on write: the strategy keeps them equal on every replica, and
`kr.testing.assert_replicas_identical` checks it), and the results of
collectives; through ops that are deterministic functions of their inputs (not
stateful, so not random). The step's inputs and the replica id are
not. Anything else (a nested function call, a stateful op, a loop's variable, a
graph too large to walk) is taken as different, so the broadcast stays.

Bitwise equality also needs kernels that give the same bits for the same inputs
on every device: true of CPU kernels, and of accelerators only with
`tf.config.experimental.enable_op_determinism()`; elsewhere the broadcast stays.

Reads (checked on TensorFlow 2.21): `FuncGraph.captures` (a nested graph's
captures lead to the enclosing graph's tensors), `Operation.op_def.is_stateful`.
"""

from __future__ import annotations

import tensorflow as tf

# Outputs equal on every member of the collective (a ring or NCCL result is
# computed once per chunk and sent to every device).
_SAME_EVERYWHERE_STATEFUL = frozenset({
    "CollectiveReduceV2", "CollectiveGatherV2", "CollectiveBcastRecvV2", "CollectiveBcastSendV2",
})
_WALK_LIMIT = 5_000


def _symbolic(tensor) -> bool:
    try:
        tensor.graph  # noqa: B018 (an eager tensor has none)
    except AttributeError:
        return False
    return True


def deterministic_devices(devices) -> bool:
    """Whether the same op gives the same bits on each of `devices`."""
    if all(tf.DeviceSpec.from_string(d).device_type == "CPU" for d in devices):
        return True
    return tf.config.experimental.is_op_determinism_enabled()


def same_on_every_replica(value: tf.Tensor, trace_graph, shared_capture) -> bool:
    """Whether `value` (a tensor of the one trace, or of a graph nested in it) is
    the same on every replica.

    `trace_graph` is the trace's `FuncGraph`; `shared_capture(tensor)` says whether
    a tensor it captures is the same on every replica's call (not swapped per
    replica, or a mirrored variable's component).
    """
    seen: set[int] = set()
    captures: dict[int, dict[int, tf.Tensor]] = {}
    pending = [value]
    while pending:
        tensor = pending.pop()
        op = tensor.op
        if id(op) in seen:
            continue
        seen.add(id(op))
        if len(seen) > _WALK_LIMIT:
            return False
        if op.type == "Placeholder":
            graph = op.graph
            if id(graph) not in captures:
                captures[id(graph)] = {id(internal): external for external, internal in graph.captures}
            external = captures[id(graph)].get(id(tensor))
            if external is None:
                return False  # an argument: the step's inputs or the replica id, or a loop variable
            if graph is trace_graph:
                if not shared_capture(external):
                    return False
                continue
            if not isinstance(external, tf.Tensor) or not _symbolic(external):
                return False
            pending.append(external)  # the enclosing graph's tensor (a branch's capture)
            continue
        if op.type in _SAME_EVERYWHERE_STATEFUL:
            continue
        if op.type == "ReadVariableOp":
            pending.append(op.inputs[0])  # the same variable everywhere, or not
            continue
        try:
            stateful = op.op_def.is_stateful
        except (AttributeError, ValueError, KeyError):
            return False
        if stateful:
            return False
        pending.extend(op.inputs)
    return True
