"""Two local workers (one CPU device each) training the small CNN, stock against ours.

``multiworker`` starts the two ``mw_task`` workers with ``TF_CONFIG`` and relays
the runner's turns to them; ``mw_task`` is one worker's custom ``strategy.run``
loop.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import threading
from typing import Any

from benchmarks.devices import describe_cross_device_ops, setup_devices
from benchmarks.models import build_model
from benchmarks.protocol import GO, ROOT, STOP, TURN, read_result, take_turn, worker_command
from benchmarks.synthetic_data import synthetic_dataset
from benchmarks.window_clock import WindowClock


def run_multiworker(spec: dict[str, Any]) -> dict[str, Any]:
    """2 local worker processes (one CPU device each) training the small CNN in a
    ``strategy.run`` loop; examples/s of the global batch, measured on the chief.

    Launches ``mw_task`` workers with ``TF_CONFIG``. ``ours`` is reported as not
    available when ``ReplicatorStrategy`` ignores ``TF_CONFIG`` (one replica).
    With ``turns``, this process relays the runner's turns to both workers, which
    pause together at the same step.
    """
    import tempfile

    from keras_replicator.launch import free_ports

    ports = free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    turns = bool(spec.get("turns"))
    procs, logs = [], []
    for index in range(2):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
        # stderr to a file: a full pipe would block a worker that the relay waits for.
        logs.append(tempfile.TemporaryFile(mode="w+"))
        procs.append(subprocess.Popen(
            worker_command(dict(spec, kind="mw_task")),
            cwd=ROOT, env=env, stdin=subprocess.PIPE if turns else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=logs[-1], text=True, bufsize=1,
        ))
    outputs: list[list[str]] = [[] for _ in procs]

    def until_all_turn() -> None:
        for p, out in zip(procs, outputs):
            for line in p.stdout:
                if line.rstrip("\n") == TURN:
                    break
                out.append(line)

    def tell_all(line: str) -> None:
        for p in procs:
            if p.poll() is None:
                p.stdin.write(line + "\n")
                p.stdin.flush()

    timer = None
    try:
        timer = threading.Timer(spec.get("timeout", 300), lambda: [p.kill() for p in procs])
        timer.start()
        if turns:
            until_all_turn()  # both warmed up
            for _ in range(spec["windows"]):
                if not take_turn():
                    break
                tell_all(GO)
                until_all_turn()
            else:
                take_turn()  # the runner's end of the group
            tell_all(STOP)  # both stop after the same step
        for p, out in zip(procs, outputs):
            out.extend(p.stdout)
            p.wait()
    finally:
        timer.cancel()
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = []
    for p, out, log in zip(procs, outputs, logs):
        log.seek(0)
        err = log.read()
        result = read_result(out) if p.returncode == 0 else None
        if result is None:
            raise RuntimeError(f"multi-worker task failed (exit {p.returncode}):\n{err[-3000:]}")
        results.append(result)
    return results[0]


def run_mw_task(spec: dict[str, Any]) -> dict[str, Any]:
    """One worker of :func:`run_multiworker` (reads ``TF_CONFIG``)."""
    setup_devices(1)
    import keras
    import tensorflow as tf

    if spec["strategy"] == "stock":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        import keras_replicator as kr

        strategy = kr.ReplicatorStrategy()
        if strategy.num_replicas_in_sync < 2:
            return {"available": False,
                    "reason": "ReplicatorStrategy does not read TF_CONFIG in this version"}
    batch = int(spec["global_batch"])
    with strategy.scope():
        model = build_model(spec.get("model", "cnn"))
        optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
        optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    dataset = strategy.experimental_distribute_dataset(synthetic_dataset(batch))

    @tf.function
    def train_step(batch_xy):
        def replica_step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True)) / batch
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)
            return loss

        per_replica = strategy.run(replica_step, args=batch_xy)
        return strategy.reduce("SUM", per_replica, axis=None)

    iterator = iter(dataset)
    clock = WindowClock(spec["warmup_steps"], spec["window_steps"], spec["windows"],
                        bool(spec.get("turns")))
    for _ in range(clock.total_ticks):
        float(train_step(next(iterator)))
        clock.tick()
        if clock.stopped:
            break
    samples = clock.samples(batch)
    throughput = statistics.median(samples)
    return {
        "available": True,
        "examples_per_second": throughput,
        "step_ms": 1000.0 * batch / throughput,
        "samples": samples,
        "replicas": strategy.num_replicas_in_sync,
        "cross_device_ops": describe_cross_device_ops(strategy),
        "window_intervals": clock.window_intervals(),
    }
