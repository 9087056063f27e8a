"""The default engine's steady step against ``trace_once=False`` and one device, paired in one process.

``python -m benchmarks.engine_steady [--devices 4] [--model cnn|resnet50|resnet50v2] [--windows 9] [--steps 4]
[--output-dir DIR]``

Four models live in one process on ``--devices`` simulated CPU devices and take turns, one
``fit`` window of ``--steps`` steps at a time, their order rotating: one device without a
strategy, ``ReplicatorStrategy()`` (the default, the step traced once),
``ReplicatorStrategy(trace_once=False)`` (traced per replica) and the replica-work reference (one
device without a strategy running ``--devices`` steps at the global batch / ``--devices`` for each
step of the others: the replicas' work with no replication cost, the best simulated replicas that
share one CPU's cores can do; ``benchmarks/replica_work.py``). Prints one JSON line: the median
seconds per step of each, the paired speed ratios (the median of the window-by-window ratios of
windows measured seconds apart) and the load average. Every window is a new epoch over one
cached dataset, as ``fit`` is called by users. With ``--output-dir`` (``benchmarks/results`` for
the docs), the line also replaces its (model, devices) row in ``engine_steady.json`` there, and
``engine_steady.md`` is written again from all the rows.

Two clocks: the whole window divided by its steps (``median_s_per_step``, the ``speed_*``
ratios), which includes each epoch's start (and Keras's own iterators' stall at some epochs'
ends, for the model without a strategy); and the median interval between the window's batch ends
after its first (``steady_s_per_step``, the ``steady_speed_*`` ratios), the steady step alone.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import time

# Global batch per model: ResNet50V2 at 128 as in issue 54's table; ResNet-50 at 64 as in `make bench`.
GLOBAL_BATCH = {"cnn": 128, "resnet50": 64, "resnet50v2": 128}


def measure(devices: int, model: str, windows: int, steps: int) -> dict:
    import keras_replicator as kr

    kr.simulate_devices(devices)
    import keras
    import numpy as np
    import tensorflow as tf

    from benchmarks.models import IMAGE_SIZE, NUM_CLASSES, build_model
    from keras_replicator._compat import onednn

    batch = GLOBAL_BATCH[model]
    rng = np.random.default_rng(0)
    x = rng.random((batch * 4, IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.float32)
    y = rng.integers(0, NUM_CLASSES, batch * 4)

    def dataset(size):
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(size).cache().repeat()

    def make(strategy, steps_per_execution=1):
        with strategy.scope() if strategy else contextlib.nullcontext():
            m = build_model(model)
            m.compile(keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=steps_per_execution)
        return m

    # The replica-work reference: one device, no strategy, `devices` steps at batch / devices in one
    # execution for each step of the others, so each batch end it reports is one global batch's work.
    models = {"one": make(None), "default": make(kr.ReplicatorStrategy()),
              "per_replica": make(kr.ReplicatorStrategy(trace_once=False)),
              "reference": make(None, steps_per_execution=devices)}
    data = {k: dataset(batch // devices if k == "reference" else batch) for k in models}
    calls = {k: devices if k == "reference" else 1 for k in models}  # batches per reported step
    for k, m in models.items():  # warm-up: trace, compile, first steps
        m.fit(data[k], steps_per_epoch=2 * calls[k], epochs=1, verbose=0)
    times: dict[str, list[float]] = {k: [] for k in models}
    steady: dict[str, list[float]] = {k: [] for k in models}
    order = list(models)
    for w in range(windows):
        for k in order[w % len(order):] + order[:w % len(order)]:
            clock = _batch_clock_class()()
            start = time.perf_counter()
            models[k].fit(data[k], steps_per_epoch=steps * calls[k], epochs=1, verbose=0, callbacks=[clock])
            times[k].append((time.perf_counter() - start) / steps)
            steady[k].append(statistics.median(b - a for a, b in zip(clock.ends[1:], clock.ends[2:])))

    def speed(a: str, b: str, of: dict) -> float:
        return statistics.median(tb / ta for ta, tb in zip(of[a], of[b], strict=True))

    return {"devices": devices, "model": model, "steps": steps, "global_batch": batch,
            "load_average": os.getloadavg(), "onednn": onednn.enabled(),
            "median_s_per_step": {k: statistics.median(v) for k, v in times.items()},
            "speed_default_over_per_replica": speed("default", "per_replica", times),
            "speed_default_over_one_device": speed("default", "one", times),
            "speed_per_replica_over_one_device": speed("per_replica", "one", times),
            "steady_s_per_step": {k: statistics.median(v) for k, v in steady.items()},
            "steady_speed_default_over_per_replica": speed("default", "per_replica", steady),
            "steady_speed_default_over_one_device": speed("default", "one", steady),
            "steady_speed_default_over_reference": speed("default", "reference", steady),
            "steady_speed_reference_over_one_device": speed("reference", "one", steady),
            "windows_s_per_step": times, "windows_steady_s_per_step": steady}


@functools.cache
def _batch_clock_class():
    import keras

    class BatchClock(keras.callbacks.Callback):
        """The time at the start of `fit` and at each batch's end."""

        def on_train_begin(self, logs=None):
            self.ends = [time.perf_counter()]

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())

    return BatchClock


def record(result: dict, output_dir: str) -> tuple[str, str]:
    """Put ``result`` in ``output_dir``'s ``engine_steady.json`` (replacing its model's and device
    count's row) and write ``engine_steady.md`` from all the rows; the two paths."""
    os.makedirs(output_dir, exist_ok=True)
    json_path = os.path.join(output_dir, "engine_steady.json")
    md_path = os.path.join(output_dir, "engine_steady.md")
    rows = []
    if os.path.exists(json_path):
        with open(json_path) as f:
            rows = json.load(f)["rows"]
    key = (result["model"], result["devices"])
    rows = [r for r in rows if (r["model"], r["devices"]) != key]
    rows.append(dict(result, written=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())))
    rows.sort(key=lambda r: (r["model"], r["devices"]))
    with open(json_path, "w") as f:
        json.dump({"rows": rows}, f, indent=1)
    with open(md_path, "w") as f:
        f.write(table(rows))
    return json_path, md_path


def table(rows: list[dict]) -> str:
    """The Markdown table of ``engine_steady.json``'s rows."""
    head = ("| model | global batch | devices | windows x steps | steady s/step: one device | default "
            "| `trace_once=False` | replica-work reference | default / `trace_once=False` | default / one device "
            "| `trace_once=False` / one device | default / reference | reference / one device "
            "| whole windows: default / `trace_once=False` | oneDNN | load average (1, 5, 15 min) at the end "
            "| written |")
    lines = ["Steady step of one device, the default engine (`trace_once=True`), `trace_once=False` and the "
             "replica-work reference (one device running the replicas' work: K steps at B/K for each step), the "
             "four models taking turns in one process (`python -m benchmarks.engine_steady`). Steady: the median "
             "interval between a window's batch ends after its first; the ratios are speeds (higher is faster), "
             "paired window by window; oneDNN: whether TensorFlow's oneDNN CPU kernels ran "
             "(`python -m benchmarks.onednn`); rows from before the reference joined say \"-\" for it.", "",
             head, "|---|---:|---:|---|" + "---:|" * 11 + "---|---|"]
    for r in rows:
        steady, by_window = r["steady_s_per_step"], r["windows_steady_s_per_step"]
        per_replica_over_one = statistics.median(
            one / pr for one, pr in zip(by_window["one"], by_window["per_replica"], strict=True))
        windows = len(r["windows_s_per_step"]["one"])
        batch = r.get("global_batch", GLOBAL_BATCH[r["model"]])  # rows from before it was recorded
        reference = "reference" in steady
        cells = [r["model"], str(batch), str(r["devices"]), f"{windows} x {r.get('steps', '?')}",
                 f"{steady['one']:.3f}", f"{steady['default']:.3f}", f"{steady['per_replica']:.3f}",
                 f"{steady['reference']:.3f}" if reference else "-",
                 f"**{r['steady_speed_default_over_per_replica']:.2f}x**",
                 f"**{r['steady_speed_default_over_one_device']:.2f}x**", f"{per_replica_over_one:.2f}x",
                 f"**{r['steady_speed_default_over_reference']:.2f}x**" if reference else "-",
                 f"{r['steady_speed_reference_over_one_device']:.2f}x" if reference else "-",
                 f"{r['speed_default_over_per_replica']:.2f}x",
                 {True: "on", False: "off"}.get(r.get("onednn"), "not recorded"),
                 ", ".join(f"{x:.1f}" for x in r["load_average"]), r["written"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine_steady", description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--model", default="cnn", choices=sorted(GLOBAL_BATCH))
    parser.add_argument("--windows", type=int, default=9)
    parser.add_argument("--steps", type=int, default=4, help="steps per window (at least 3)")
    parser.add_argument("--output-dir", help="also record the result there (benchmarks/results for the docs)")
    args = parser.parse_args(argv)
    if GLOBAL_BATCH[args.model] % args.devices:
        parser.error(f"--devices must divide {args.model}'s global batch {GLOBAL_BATCH[args.model]} "
                     "(the replica-work reference runs steps of global batch / devices)")
    if args.steps < 3 or args.windows < 1:
        parser.error("--steps must be at least 3 (the steady clock skips each window's first step) and --windows at least 1")
    result = measure(args.devices, args.model, args.windows, args.steps)
    print(json.dumps(result), flush=True)
    if args.output_dir:
        for path in record(result, args.output_dir):
            print("engine_steady: wrote", path, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
