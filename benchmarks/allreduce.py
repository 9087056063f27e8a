"""All-reduce bandwidth: in-replica sums of float32 tensors of each size, across the replicas."""

from __future__ import annotations

import statistics
import time
from typing import Any

from benchmarks.devices import describe_cross_device_ops, device_names, make_strategy, setup_devices
from benchmarks.protocol import take_turn

# Each call to an all-reduce step reduces at least this many megabytes, as separate
# all-reduces of distinct tensors (so neither packing nor common-subexpression
# elimination can merge them). Like nccl-tests' back-to-back operations, this
# spreads the fixed cost of calling a function on K devices (about 0.15-0.25 ms
# on this 2-core VM, more than a 1 MB sum) over several all-reduces, so the
# figure is the all-reduce's bandwidth. Sizes it amortizes are also timed one
# all-reduce per call ("one_per_call").
MB_PER_CALL = 8


def all_reduces_per_call(mb: float) -> int:
    """How many all-reduces of ``mb`` megabytes one timed call makes."""
    return max(1, round(MB_PER_CALL / mb))


def run_allreduce(spec: dict[str, Any]) -> dict[str, Any]:
    """Algorithm bandwidth (tensor bytes / time per all-reduce) of in-replica sums
    of float32 tensors of each size, across the replicas.

    A timed call reduces ``all_reduces_per_call(mb)`` distinct tensors, each by its
    own all-reduce; sizes where that is more than one are also timed one
    all-reduce per call. Every step is warmed up first; then each window times
    every step once. With ``turns`` (``processes.run_group``) the process waits for
    its turn before each window, so the implementations of a group are timed one
    window at a time.
    """
    setup_devices(spec["devices"])
    import tensorflow as tf

    import keras_replicator as kr

    devices = device_names(spec["devices"])
    strategy = make_strategy(spec["impl"], devices, spec.get("cross_device_ops"))
    turns = bool(spec.get("turns"))

    def sync(result):
        for r in strategy.experimental_local_results(result):
            r.numpy()

    def make_step(tensors):
        @tf.function
        def step():
            def replica_fn():
                # One all-reduce per tensor; the sums' first elements are returned
                # (returning whole tensors would time their hand-over to Python).
                firsts = [kr.all_reduce(v.read_value(), "sum")[:1] for v in tensors]
                return tf.math.add_n(firsts) if len(firsts) > 1 else firsts[0]

            return strategy.run(replica_fn)

        for _ in range(3):
            sync(step())
        return step

    # (series, size) -> (megabytes, elements, all-reduces per call, step)
    steps: dict[tuple[str, str], tuple[float, int, int, Any]] = {}
    for mb in spec["sizes_mb"]:
        n = int(mb * 2**20) // 4
        per_call = all_reduces_per_call(mb)
        with strategy.scope():
            tensors = [tf.Variable(tf.random.normal([n]), trainable=False)
                       for _ in range(per_call)]
        steps[("sizes", str(mb))] = (mb, n, per_call, make_step(tensors))
        if per_call > 1:
            steps[("one_per_call", str(mb))] = (mb, n, 1, make_step(tensors[:1]))
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in steps}
    wall = []
    for _ in range(spec["windows"]):
        if turns and not take_turn():
            break
        start = time.time()
        for key, (mb, n, per_call, step) in steps.items():
            calls = max(3, int(spec.get("calls_mb", 128) / (mb * per_call)))
            t = time.perf_counter()
            for _ in range(calls):
                result = step()
            sync(result)
            samples[key].append(n * 4 * per_call * calls / (time.perf_counter() - t) / 1e9)
        wall.append([start, time.time()])
    else:
        if turns:
            take_turn()  # the runner's end of the group
    out: dict[str, Any] = {"sizes": {}, "one_per_call": {}}
    for (series, mb), x in samples.items():
        out[series][mb] = {"gbps": statistics.median(x), "samples": x}
    return {**out, "all_reduces_per_call": {mb: per_call for (series, mb), (_, _, per_call, _)
                                            in steps.items() if series == "sizes"},
            "cross_device_ops": describe_cross_device_ops(strategy),
            "replicas": len(devices), "window_intervals": wall}
