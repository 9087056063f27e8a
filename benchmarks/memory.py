"""Optimizer-state sharding (ZeRO-1): memory per device and step time, sharded against unsharded.

``python -m benchmarks.memory [--quick]``

Four measurements, each in fresh interpreters (the simulated device count is
fixed when TensorFlow starts):

* ``state_bytes``: the optimizer-state bytes on each device, summed from where
  the optimizer's variables live (`kr.optimizers.state_bytes_per_device`), for
  ResNet-50 and a transformer of about 29M parameters with AdamW, on 2, 4 and 8
  replicas; the largest device's share against ``unsharded / N``.
* ``rss`` and ``step``: the peak resident memory of one process (all replicas'
  slots live in one process on a CPU) and the median step time of the same
  ``fit`` of an MLP of 8 x 1024 x 1024 with AdamW on 4 replicas, sharded and
  unsharded, alternating processes (``--pairs`` of each); the RSS saved against
  the slot bytes that sharding should save, ``(N - 1) / N`` of them.
* ``largest_fit``: the deepest transformer (d_model 512) whose weights,
  gradients and AdamW state fit a per-device budget on 4 replicas, counted from
  the measured bytes per device of each depth (weights and gradients are
  mirrored: 8 bytes a parameter on every device).

Writes ``memory.json`` and ``memory.md`` to the output directory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 2**20

_STATE_BYTES = r"""
import json, sys
import keras_replicator as kr
kr.simulate_devices(8)
import keras
from benchmarks.memory import build_model

out = {}
for name in ("resnet50", "transformer"):
    for n in (2, 4, 8):
        row = {}
        for shard in (False, True):
            strategy = kr.ReplicatorStrategy([f"/cpu:{i}" for i in range(n)], shard_optimizer_state=shard)
            with strategy.scope():
                model = build_model(name)
                optimizer = keras.optimizers.AdamW(1e-3)
                optimizer.build(model.trainable_variables)
            per_device = kr.optimizers.state_bytes_per_device(optimizer)
            row["sharded" if shard else "unsharded"] = sorted(per_device.values())
            row["params"] = int(sum(v.numpy().size for v in model.trainable_variables))
        out[f"{name}/{n}"] = row
json.dump(out, sys.stdout)
"""

_FIT = r"""
import json, resource, sys, time
import keras_replicator as kr
kr.simulate_devices(4)
import keras, numpy as np
shard, steps = sys.argv[1] == "1", int(sys.argv[2])
strategy = kr.ReplicatorStrategy(shard_optimizer_state=shard)
with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1024,))] + [keras.layers.Dense(1024) for _ in range(8)])
    model.compile(keras.optimizers.AdamW(1e-4), "mse")
x = np.random.default_rng(0).normal(size=(64 * (steps + 2), 1024)).astype("float32")

class Times(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        self.t = time.perf_counter()
    def on_train_batch_end(self, batch, logs=None):
        times.append(time.perf_counter() - self.t)

times = []
model.fit(x, x, batch_size=64, epochs=1, verbose=0, callbacks=[Times()])
slot_bytes = sum(int(np.prod(v.shape)) * 4 for v in model.optimizer.variables if len(v.shape))
json.dump({"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "step": statistics.median(times[2:]), "slot_bytes": slot_bytes}, sys.stdout)
""".replace("import json, resource, sys, time", "import json, resource, statistics, sys, time")


def build_model(name: str, depth: int = 8):
    """ResNet-50 (224 x 224, 1000 classes) or a transformer encoder (d_model 512, ``depth`` blocks)."""
    import keras

    if name == "resnet50":
        return keras.applications.ResNet50(weights=None, input_shape=(224, 224, 3))
    d, vocab, length = 512, 8000, 128
    inputs = keras.Input((length,), dtype="int32")
    h = keras.layers.Embedding(vocab, d)(inputs)
    for _ in range(depth):
        a = keras.layers.MultiHeadAttention(8, d // 8)(h, h)
        h = keras.layers.LayerNormalization()(h + a)
        f = keras.layers.Dense(4 * d, activation="gelu")(h)
        h = keras.layers.LayerNormalization()(h + keras.layers.Dense(d)(f))
    return keras.Model(inputs, keras.layers.Dense(vocab)(h))


def run_fresh(code: str, *args: str) -> dict:
    """Runs `code` in a fresh interpreter (its own device count, its own peak RSS); its last
    line of output, JSON."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                            env=env, cwd=ROOT, timeout=3600)
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def paired_runs_arguments(argv, description: str, quick: str, pairs: int) -> argparse.Namespace:
    """The options of a benchmark of alternating fresh processes: --quick, --pairs, --out."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--pairs", type=int, default=pairs)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    return parser.parse_args(argv)


def state_bytes() -> dict:
    rows = run_fresh(_STATE_BYTES)
    for row in rows.values():
        n = len(row["unsharded"])
        row["ratio_to_ideal"] = max(row["sharded"]) / (max(row["unsharded"]) / n)
    return rows


def rss_and_step(pairs: int, steps: int) -> dict:
    runs = {"unsharded": [], "sharded": []}
    for _ in range(pairs):
        for shard in ("0", "1"):
            runs["sharded" if shard == "1" else "unsharded"].append(run_fresh(_FIT, shard, str(steps)))
    slot_bytes = runs["unsharded"][0]["slot_bytes"]
    rss = {k: statistics.median(r["peak_rss"] for r in v) for k, v in runs.items()}
    step = {k: statistics.median(r["step"] for r in v) for k, v in runs.items()}
    expected = slot_bytes * 4 * 3 / 4  # N copies before, one after: (N - 1) / N of N copies
    return {
        "runs": runs, "slot_bytes_per_copy": slot_bytes, "peak_rss": rss,
        "rss_saved": rss["unsharded"] - rss["sharded"], "rss_saved_expected": expected,
        "rss_saved_fraction": (rss["unsharded"] - rss["sharded"]) / expected,
        "step": step, "speed_sharded_over_unsharded": step["unsharded"] / step["sharded"],
    }


def largest_fit(rows: dict, budget_gib: float = 1.0) -> dict:
    """Deepest transformer fitting `budget_gib` per device on 4 replicas, from measured bytes."""
    per_block = 12 * 512 * 512 + 13 * 512  # attention + feed-forward + norms, measured below
    base = rows["transformer/4"]["params"] - 8 * per_block
    out = {}
    for label in ("unsharded", "sharded"):
        state_per_param = max(rows["transformer/4"][label]) / rows["transformer/4"]["params"]
        per_param = 8 + state_per_param  # weights and gradients on every device, plus the state
        params = budget_gib * 2**30 / per_param
        out[label] = {"bytes_per_param": per_param, "max_params": params,
                      "max_depth": int((params - base) // per_block)}
    return out


def main(argv=None) -> None:
    args = paired_runs_arguments(argv, __doc__.splitlines()[0], "1 pair of 8-step fits", pairs=3)
    pairs, steps = (1, 8) if args.quick else (args.pairs, 20)
    rows = state_bytes()
    results = {"state_bytes": rows, "fit": rss_and_step(pairs, steps), "largest_fit": largest_fit(rows)}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "memory.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out, "memory.md"), "w") as f:
        f.write(report(results))
    print(report(results))


def report(results: dict) -> str:
    lines = ["| model | replicas | params | unsharded per device (MiB) | sharded, largest device (MiB) "
             "| sharded / (unsharded / N) |", "|---|---:|---:|---:|---:|---:|"]
    for key, row in results["state_bytes"].items():
        name, n = key.split("/")
        lines.append(f"| {name} | {n} | {row['params'] / 1e6:.1f}M | {max(row['unsharded']) / MIB:.1f} "
                     f"| {max(row['sharded']) / MIB:.1f} | {row['ratio_to_ideal']:.3f} |")
    fit = results["fit"]
    lines += ["", "| MLP 8 x 1024², AdamW, 4 replicas | unsharded | sharded |", "|---|---:|---:|",
              f"| peak RSS (MiB) | {fit['peak_rss']['unsharded'] / MIB:.0f} | {fit['peak_rss']['sharded'] / MIB:.0f} |",
              f"| median step (ms) | {fit['step']['unsharded'] * 1e3:.1f} | {fit['step']['sharded'] * 1e3:.1f} |",
              "", f"RSS saved: {fit['rss_saved'] / MIB:.0f} MiB of the {fit['rss_saved_expected'] / MIB:.0f} MiB "
              f"of slots sharding removes ({fit['rss_saved_fraction']:.2f}); step time sharded over "
              f"unsharded: speed {fit['speed_sharded_over_unsharded']:.2f}x.", ""]
    big = results["largest_fit"]
    lines += [f"Largest transformer (d_model 512) in 1 GiB per device on 4 replicas with AdamW: "
              f"{big['unsharded']['max_params'] / 1e6:.0f}M parameters ({big['unsharded']['max_depth']} blocks) "
              f"unsharded, {big['sharded']['max_params'] / 1e6:.0f}M ({big['sharded']['max_depth']} blocks) sharded."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
