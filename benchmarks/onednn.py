"""TensorFlow's CPU kernels with oneDNN off and on: the convolutions and one training step.

``python -m benchmarks.onednn [--steps 5] [--devices 4] [--model resnet50] [--output-dir DIR]``

TensorFlow turns its oneDNN kernels on by itself only on x86 CPUs with AVX-512 VNNI, AVX-VNNI
or AMX; ``TF_ENABLE_ONEDNN_OPTS`` overrides it either way, read when TensorFlow starts. So each
setting runs in a fresh interpreter: the machine's default, then ``TF_ENABLE_ONEDNN_OPTS=0``
and ``=1``. Each times, as the median of ``--steps`` calls after one:

* the convolutions of ResNet-50's stages at 32x32 (global batch 128): a 3x3 one on 8x8x256
  maps and a 1x1 one on 2x2x512 to 2048 channels, forward, the gradient to the input
  (``Conv2DBackpropInput``) and to the filter;
* a ``fit`` call of one step (its epoch's start included) of ``--model`` (ResNet-50 at 32x32, or the small CNN; global batch 64, SGD)
  on one device, and of the same under ``ReplicatorStrategy`` on ``--devices`` simulated devices.

Writes ``onednn.json`` and ``onednn.md`` to the output directory (``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from benchmarks.protocol import ROOT, finish_worker, read_result

OUTPUT_DIR = os.path.join(ROOT, "benchmarks", "results")
SETTINGS = ("default", "0", "1")  # the machine's default, then TF_ENABLE_ONEDNN_OPTS=0 and =1
# (name, input shape NHWC, filter HWIO) at global batch 128.
CONVOLUTIONS = (("3x3, 8x8x256 to 256", (128, 8, 8, 256), (3, 3, 256, 256)),
                ("1x1, 2x2x512 to 2048", (128, 2, 2, 512), (1, 1, 512, 2048)))
MODEL_NAMES = {"resnet50": "ResNet-50", "cnn": "small CNN"}


def _median_seconds(call, steps: int) -> float:
    call()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _convolutions(steps: int) -> dict[str, float]:
    import tensorflow as tf

    seconds = {}
    for name, x_shape, w_shape in CONVOLUTIONS:
        x, w = tf.random.normal(x_shape), tf.random.normal(w_shape)
        dy = tf.random.normal(x_shape[:3] + w_shape[3:])
        calls = {
            "forward": tf.function(lambda x=x, w=w: tf.nn.conv2d(x, w, 1, "SAME")),
            "input gradient": tf.function(lambda dy=dy, w=w, s=x_shape: tf.raw_ops.Conv2DBackpropInput(
                input_sizes=s, filter=w, out_backprop=dy, strides=[1, 1, 1, 1], padding="SAME")),
            "filter gradient": tf.function(lambda x=x, dy=dy, s=w_shape: tf.raw_ops.Conv2DBackpropFilter(
                input=x, filter_sizes=s, out_backprop=dy, strides=[1, 1, 1, 1], padding="SAME")),
        }
        for kind, fn in calls.items():
            seconds[f"Conv2D {name}, {kind}"] = _median_seconds(lambda fn=fn: fn().numpy(), steps)
    return seconds


def _fit_step(model_name: str, steps: int, devices: int) -> float:
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_replicator as kr
    from benchmarks.models import IMAGE_SIZE, NUM_CLASSES, build_model

    batch = 64
    rng = np.random.default_rng(0)
    x = rng.random((batch * 2, IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.float32)
    y = rng.integers(0, NUM_CLASSES, batch * 2)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).cache().repeat()
    strategy = kr.ReplicatorStrategy() if devices > 1 else tf.distribute.get_strategy()
    with strategy.scope():
        model = build_model(model_name)
        model.compile(keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return _median_seconds(lambda: model.fit(data, steps_per_epoch=1, epochs=1, verbose=0), steps)


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """In the worker process (its ``TF_ENABLE_ONEDNN_OPTS`` set): every timing of one setting."""
    import keras_replicator as kr

    kr.simulate_devices(spec["devices"])
    from keras_replicator._compat import onednn

    seconds = _convolutions(spec["steps"])
    name = MODEL_NAMES[spec["model"]]
    seconds[f"{name} fit step, one device"] = _fit_step(spec["model"], spec["steps"], 1)
    seconds[f"{name} fit step, ReplicatorStrategy on {spec['devices']} devices"] = _fit_step(
        spec["model"], spec["steps"], spec["devices"])
    return {"setting": spec["setting"], "onednn": onednn.enabled(), "seconds": seconds}


def measure(setting: str, steps: int, devices: int, model: str, timeout: float = 1800.0) -> dict[str, Any]:
    """:func:`run_one` in a fresh interpreter with ``TF_ENABLE_ONEDNN_OPTS`` as ``setting`` says."""
    env = {k: v for k, v in os.environ.items() if k not in ("TF_ENABLE_ONEDNN_OPTS", "TF_CONFIG")}
    if setting != "default":
        env["TF_ENABLE_ONEDNN_OPTS"] = setting
    spec = {"setting": setting, "steps": steps, "devices": devices, "model": model}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.onednn", "--worker", json.dumps(spec)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    result = read_result(proc.stdout.splitlines()) if proc.returncode == 0 else None
    if result is None:
        raise RuntimeError(f"the {setting!r} worker failed (exit {proc.returncode}): {proc.stderr[-1500:]}")
    return result


def markdown(doc: dict[str, Any]) -> str:
    """The table: each timing with oneDNN off and on, and the speed of on against off."""
    by = {r["setting"]: r for r in doc["results"]}
    default = "on" if by["default"]["onednn"] else "off"
    lines = [f"TensorFlow's CPU kernels with oneDNN off and on (`python -m benchmarks.onednn`), {doc['date']}, "
             f"{doc['environment']}; the machine's default: oneDNN **{default}**. Median seconds of "
             f"{doc['steps']} calls after one, each setting in a fresh process.", "",
             "| what | oneDNN off (s) | on (s) | on / off: speed |", "|---|---:|---:|---:|"]
    for name, off in by["0"]["seconds"].items():
        on = by["1"]["seconds"][name]
        lines.append(f"| {name} | {off:.4f} | {on:.4f} | {off / on:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--model", default="resnet50", choices=sorted(MODEL_NAMES))
    parser.add_argument("--output-dir", default=OUTPUT_DIR)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        finish_worker(run_one(json.loads(args.worker)))
    if args.steps < 1 or args.devices < 2:
        parser.error("--steps must be at least 1 and --devices at least 2")
    from benchmarks.machine import cpu_model, run_description

    doc: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "environment": f"{cpu_model()}, {run_description()}",
                           "steps": args.steps, "results": []}
    for setting in SETTINGS:
        doc["results"].append(measure(setting, args.steps, args.devices, args.model))
        print(json.dumps(doc["results"][-1]), flush=True)
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "onednn.json"), "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    with open(os.path.join(args.output_dir, "onednn.md"), "w") as f:
        f.write(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
