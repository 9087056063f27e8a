"""Asynchronous vs synchronous throughput, with and without a straggler.

Runs the same small model for the same number of steps of the same per-worker batch:

* async: `AsyncReplicatorStrategy`, a chief, 2 workers and 1 parameter server;
* sync: `ReplicatorStrategy` on 2 workers (one device each).

Each regime runs twice: with equal workers, then with worker 1 made a straggler
by the driver, which stops and continues its process (SIGSTOP / SIGCONT) in
turns, so that it gets about half of the time it would otherwise: about 2x
slower, as when a machine is shared. Reports examples/s of training (the timed
part: `fit` after one warm-up epoch, measured on the chief / worker 0) and the
fraction of its equal-workers throughput each regime keeps with the straggler.
Every process runs on 127.0.0.1 and is killed at the end.

Usage::

    python benchmarks/async_throughput.py [--steps 300] [--period 0.05] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

BATCH = 64  # per worker and step
FEATURES = 32


def _model():
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(256, activation="relu"),
         keras.layers.Dense(256, activation="relu"), keras.layers.Dense(1)]
    )


def _data(n: int = 8192):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    return x, x.sum(axis=1, keepdims=True).astype("float32")


def task_main(regime: str, steps: int, out: str) -> None:
    """One task of a job (run by the driver with TF_CONFIG set)."""
    import keras
    import tensorflow as tf

    import keras_replicator as kr

    x, y = _data()
    if regime == "async":
        strategy = kr.AsyncReplicatorStrategy(shutdown_grace=1.0, startup_timeout=120)
        with strategy.scope():
            model = _model()
            model.compile(keras.optimizers.SGD(0.01), "mse", steps_per_execution=10)
        train = strategy.distribute_dataset(
            lambda ctx: tf.data.Dataset.from_tensor_slices((x, y)).shuffle(8192), per_replica_batch_size=BATCH
        )
        model.fit(train, epochs=1, steps_per_epoch=50, verbose=0)  # warm-up: traces, connects
        started = time.perf_counter()
        model.fit(train, epochs=1, steps_per_epoch=steps, verbose=0)
        seconds = time.perf_counter() - started
        examples = steps * BATCH
    else:
        strategy = kr.ReplicatorStrategy(startup_timeout=120)
        with strategy.scope():
            model = _model()
            model.compile(keras.optimizers.SGD(0.01), "mse", steps_per_execution=10)
        batch = BATCH * strategy.num_workers
        n = batch * steps // strategy.num_workers
        model.fit(x[: batch * 50], y[: batch * 50], batch_size=batch, epochs=1, verbose=0)
        xs, ys = (x.repeat(1 + n // len(x), axis=0)[:n], y.repeat(1 + n // len(y), axis=0)[:n])
        started = time.perf_counter()
        model.fit(xs, ys, batch_size=batch, epochs=1, verbose=0, shuffle=False)
        seconds = time.perf_counter() - started
        examples = n
        if not strategy.is_chief:
            return
    with open(out, "w") as f:
        json.dump({"examples": examples, "seconds": seconds}, f)


def _straggle(pid: int, stop: threading.Event, period: float = 0.05) -> None:
    """Halves a process's share of time: stopped for `period`, running for `period`."""
    while not stop.is_set():
        try:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(period)
            os.kill(pid, signal.SIGCONT)
            time.sleep(period)
        except ProcessLookupError:
            return
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def run(regime: str, steps: int, straggler: bool, period: float = 0.05) -> dict:
    from keras_replicator.launch import free_ports

    if regime == "async":
        ports = free_ports(4)
        spec = {"chief": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{p}" for p in ports[1:3]],
                "ps": [f"127.0.0.1:{ports[3]}"]}
        tasks = [("ps", 0), ("worker", 0), ("worker", 1), ("chief", 0)]
        main, slow = ("chief", 0), ("worker", 1)
    else:
        ports = free_ports(2)
        spec = {"worker": [f"127.0.0.1:{p}" for p in ports]}
        tasks = [("worker", 0), ("worker", 1)]
        main, slow = ("worker", 0), ("worker", 1)
    out = tempfile.mktemp(suffix=".json")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT)
    env.pop("KR_TEST_DEVICES", None)
    processes = {}
    stop = threading.Event()
    try:
        for task in tasks:
            config = json.dumps({"cluster": spec, "task": {"type": task[0], "index": task[1]}})
            processes[task] = subprocess.Popen(
                [sys.executable, __file__, "--task", regime, "--steps", str(steps), "--out", out],
                env=dict(env, TF_CONFIG=config), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                start_new_session=True,
            )
        if straggler:
            threading.Thread(target=_straggle, args=(processes[slow].pid, stop, period), daemon=True).start()
        code = processes[main].wait(timeout=900)
        if code != 0:
            raise RuntimeError(f"{regime}: {main} failed:\n{processes[main].stderr.read().decode()[-3000:]}")
        with open(out) as f:
            result = json.load(f)
    finally:
        stop.set()
        for p in processes.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        if os.path.exists(out):
            os.unlink(out)
    result["examples_per_second"] = result["examples"] / result["seconds"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json")
    parser.add_argument("--period", type=float, default=0.05,
                        help="the straggler is stopped, then runs, for this many seconds in turn")
    parser.add_argument("--task", choices=["async", "sync"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.task:
        task_main(args.task, args.steps, args.out)
        return
    results = {}
    for regime in ("sync", "async"):
        for straggler in (False, True):
            r = run(regime, args.steps, straggler, args.period)
            key = f"{regime}{'_straggler' if straggler else ''}"
            results[key] = r
            print(f"{key:16s} {r['examples_per_second']:9.0f} examples/s ({r['examples']} in {r['seconds']:.1f} s)",
                  flush=True)
    for regime in ("sync", "async"):
        kept = results[f"{regime}_straggler"]["examples_per_second"] / results[regime]["examples_per_second"]
        results[f"{regime}_kept"] = kept
        print(f"{regime}: keeps {kept:.2f} of its throughput with one worker 2x slower")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
