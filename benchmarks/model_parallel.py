"""Tensor parallelism from a Keras LayoutMap: bytes per device and step time, against replicated.

``python -m benchmarks.model_parallel [--quick] [--out DIR]`` (not run in the suite)

On 8 simulated CPU devices, a GPT-style transformer (token and position embeddings,
pre-norm blocks of `MultiHeadAttention` and a GELU FFN, an output projection) with
AdamW, under four configurations, each in a fresh interpreter:

* ``replicated``: `ReplicatorStrategy()`, 8 replicas;
* ``zero1``: `ReplicatorStrategy(shard_optimizer_state=True)`, 8 replicas;
* ``tp1x8`` and ``tp2x4``: `ReplicatorStrategy(layout_map=...)` with Megatron's
  layout (embeddings by vocabulary, Q/K/V by heads, the attention output and the
  FFN's second kernel row-parallel, its first and the output projection
  column-parallel) on meshes (1, 8) and (2, 4);
* ``fsdp8``: FSDP over 8 replicas, mesh (8, 1): every embedding and kernel split over
  the data axis (`fsdp_layout`).

Two models:

* ``large`` (about 110M parameters): bytes per device of weights, gradients at rest
  and AdamW's state, summed from where each variable lives
  (`kr.model_parallel.training_bytes_per_device`) after the optimizer is built, no
  step. Its replicated and ZeRO-1 rows would hold 8 copies of every weight (about
  10 GB for replicated): on this shared 24 GB machine they are computed from the
  parameter count instead (every variable on every device; ZeRO-1's slots 1/8 each),
  and the ``small`` model checks that formula against the measured bytes.
* ``small`` (about 5M parameters): the same bytes, all measured, and the median
  step time of `fit` (global batch 16, sequence 64) of each configuration, the
  configurations' processes taking turns (replicated first and last).

Writes ``model_parallel.json`` and ``model_parallel.md`` to ``--out``.

``--pairing`` measures Megatron's pairing instead (`pairing_step_times`): the small
model's median `fit` step under ``tp1x8`` and ``tp2x4`` with each row-parallel layer
reading its column-parallel layer's parts and with the gather between them
(`parallel_layers.PAIRING = False`), both traced in one process and timed in
alternating windows, and the forward pass's bytes between devices of each
(`forward_bytes_moved`); writes ``model_parallel_pairing.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ("replicated", "zero1", "tp1x8", "tp2x4", "fsdp8")
MODELS = {
    # vocabulary, d_model, layers, heads, FFN width, sequence
    "large": dict(vocab=16384, d=768, layers=12, heads=16, ffn=3072, seq=64),  # 16 heads: 8 divides them
    "small": dict(vocab=4096, d=256, layers=4, heads=8, ffn=1024, seq=64),
}
MIB = 2**20


def transformer(vocab: int, d: int, layers: int, heads: int, ffn: int, seq: int):
    """A GPT-style transformer of Keras layers (causal attention, pre-norm)."""
    import keras

    ids = keras.Input((seq,), dtype="int32")
    positions = keras.ops.zeros_like(ids) + keras.ops.arange(seq, dtype="int32")
    x = keras.layers.Embedding(vocab, d, name="token")(ids)
    x = x + keras.layers.Embedding(seq, d, name="position")(positions)
    for i in range(layers):
        h = keras.layers.LayerNormalization(name=f"block{i}_norm1")(x)
        x = x + keras.layers.MultiHeadAttention(heads, d // heads, name=f"block{i}_mha")(
            h, h, use_causal_mask=True)
        h = keras.layers.LayerNormalization(name=f"block{i}_norm2")(x)
        h = keras.layers.Dense(ffn, activation="gelu", name=f"block{i}_ffn_in")(h)
        x = x + keras.layers.Dense(d, name=f"block{i}_ffn_out")(h)
    x = keras.layers.LayerNormalization(name="final_norm")(x)
    return keras.Model(ids, keras.layers.Dense(vocab, name="logits")(x))


def megatron_layout(mesh):
    """Megatron's splits as a Keras LayoutMap."""
    import keras

    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["token/embeddings"] = ("model", None)
    layout_map[".*mha/(query|key|value)/kernel"] = (None, "model", None)
    layout_map[".*mha/(query|key|value)/bias"] = ("model", None)
    layout_map[".*mha/attention_output/kernel"] = ("model", None, None)
    layout_map[".*ffn_in/kernel"] = (None, "model")
    layout_map[".*ffn_in/bias"] = ("model",)
    layout_map[".*ffn_out/kernel"] = ("model", None)
    layout_map["logits/kernel"] = (None, "model")
    layout_map["logits/bias"] = ("model",)
    return layout_map


def fsdp_layout(mesh):
    """Every embedding and kernel split over the 8 replicas, on a dimension 8 divides."""
    import keras

    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["token/embeddings"] = ("batch", None)
    layout_map["position/embeddings"] = (None, "batch")
    layout_map[".*mha/(query|key|value)/kernel"] = ("batch", None, None)
    layout_map[".*mha/attention_output/kernel"] = (None, None, "batch")
    layout_map[".*ffn_(in|out)/kernel"] = ("batch", None)
    layout_map["logits/kernel"] = ("batch", None)
    return layout_map


def strategy_for(config: str):
    import keras

    import keras_replicator as kr

    if config == "replicated":
        return kr.ReplicatorStrategy()
    if config == "zero1":
        return kr.ReplicatorStrategy(shard_optimizer_state=True)
    if config == "fsdp8":
        mesh = keras.distribution.DeviceMesh((8, 1), ["batch", "model"], [f"cpu:{i}" for i in range(8)])
        return kr.ReplicatorStrategy(layout_map=fsdp_layout(mesh))
    data, model = (1, 8) if config == "tp1x8" else (2, 4)
    mesh = keras.distribution.DeviceMesh((data, model), ["batch", "model"], [f"cpu:{i}" for i in range(8)])
    return kr.ReplicatorStrategy(layout_map=megatron_layout(mesh))


def run_config(config: str, model_name: str, steps: int) -> dict:
    """In a fresh interpreter with 8 devices: bytes per device, then (steps > 0) step times."""
    import keras
    import numpy as np

    import keras_replicator as kr

    spec = MODELS[model_name]
    strategy = strategy_for(config)
    with strategy.scope():
        model = transformer(**spec)
        model.compile(keras.optimizers.AdamW(1e-4),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.optimizer.build(model.trainable_variables)
    parts = kr.model_parallel.training_bytes_per_device(model)
    out = {"config": config, "model": model_name,
           "params": int(sum(np.prod(v.shape) for v in model.trainable_weights)),
           "bytes": {name: sorted(part.values()) for name, part in parts.items()}}
    if steps:
        times = []

        class Clock(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                self.start = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                times.append(time.perf_counter() - self.start)

        rng = np.random.default_rng(0)
        n = 16 * (steps + 2)
        x = rng.integers(0, spec["vocab"], (n, spec["seq"]))
        model.fit(x, np.roll(x, -1, axis=1), batch_size=16, epochs=1, shuffle=False, verbose=0,
                  callbacks=[Clock()])
        out["step_seconds"] = statistics.median(times[2:])
    return out


def forward_bytes_moved(config: str, model_name: str) -> dict:
    """MiB of the forward pass's tensors read on another device than the one that made them,
    paired and gathered, counted in the traced graph of one replica (its share of the global
    batch 16): each tensor once per device reading it, devices as the ops request them (none:
    logical device 0). Forward only: outside a strategy the tape's ops request no device."""
    import keras
    import tensorflow as tf

    from keras_replicator.model_parallel import parallel_layers
    from keras_replicator.model_parallel.sharding import ModelSharding

    data, k = (1, 8) if config == "tp1x8" else (2, 4)
    mesh = keras.distribution.DeviceMesh((data, k), ["batch", "model"], [f"cpu:{i}" for i in range(8)])
    with ModelSharding(megatron_layout(mesh)).scope():
        model = transformer(**MODELS[model_name])
    spec = tf.TensorSpec((16 // data, MODELS[model_name]["seq"]), tf.int32)
    out = {}
    for paired in (True, False):
        parallel_layers.PAIRING = paired
        graph = tf.function(lambda ids: model(ids)).get_concrete_function(spec).graph
        home = tf.DeviceSpec.from_string(mesh.devices[0, 0]).to_string()

        def device(op, home=home):
            return tf.DeviceSpec.from_string(op.device).to_string() if op.device else home

        moved, stack, seen = {}, [t.op for t in graph.outputs], set()
        while stack:
            op = stack.pop()
            if op.name in seen:
                continue
            seen.add(op.name)
            stack += [t.op for t in op.inputs]
            for t in op.inputs:
                if t.dtype not in (tf.resource, tf.variant) and device(t.op) != device(op):
                    moved[(t.name, device(op))] = t.shape.num_elements() * t.dtype.size
        out["paired" if paired else "unpaired"] = sum(moved.values()) / MIB
    parallel_layers.PAIRING = True
    return out


def pairing_step_times(config: str, model_name: str, steps: int, rounds: int) -> dict:
    """One process: the train function traced paired and unpaired, timed in alternating windows
    of `steps` steps (ABBA order), `rounds` times each."""
    import keras
    import numpy as np

    from keras_replicator.model_parallel import parallel_layers

    moved = forward_bytes_moved(config, model_name)
    spec = MODELS[model_name]
    with strategy_for(config).scope():
        model = transformer(**spec)
        model.compile(keras.optimizers.AdamW(1e-4), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).integers(0, spec["vocab"], (16 * steps, spec["seq"]))
    times: list[float] = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self.start)

    pairs, column_parts, functions = [], parallel_layers.column_parts, {}

    def counted(*args):                                      # whether each row layer took the parts
        parts = column_parts(*args)
        pairs.append(parts is not None)
        return parts

    parallel_layers.column_parts = counted

    def window(paired: bool) -> float:
        parallel_layers.PAIRING = paired
        model.train_function = functions.get(paired)        # each mode keeps its own trace
        del times[:]
        model.fit(x, np.roll(x, -1, axis=1), batch_size=16, epochs=1, shuffle=False, verbose=0,
                  callbacks=[Clock()])
        functions[paired] = model.train_function
        return statistics.median(times)

    for paired in (True, False):                             # trace both (first steps not kept)
        del pairs[:]
        window(paired)
        assert any(pairs) == paired, "the pairing did not run as configured"
    out: dict = {"config": config, "model": model_name, "steps_per_window": steps,
                 "forward_mib_between_devices": moved, "paired": [], "unpaired": []}
    for r in range(rounds):
        for paired in ((True, False) if r % 2 == 0 else (False, True)):
            out["paired" if paired else "unpaired"].append(window(paired))
    out["ratio"] = statistics.median(p / u for p, u in zip(out["paired"], out["unpaired"]))
    out["load_average_1min"] = os.getloadavg()[0]           # the machine is shared: say how busy
    return out


def pairing(out_dir: str, rounds: int, steps: int) -> None:
    """`pairing_step_times` for tp1x8 and tp2x4 (one fresh process each); writes the results."""
    rows = [_child(config, "small", steps, rounds) for config in ("tp1x8", "tp2x4")]
    with open(os.path.join(out_dir, "model_parallel_pairing.json"), "w") as f:
        json.dump(rows, f, indent=1)
    md = pairing_table(rows)
    with open(os.path.join(out_dir, "model_parallel_pairing.md"), "w") as f:
        f.write(md)
    print(md)


def pairing_table(rows: list[dict]) -> str:
    """The Markdown page of `pairing`'s rows."""
    spec = MODELS["small"]
    md = ["<!-- written by python -m benchmarks.model_parallel --pairing: do not edit -->",
          "# Megatron's pairing: step time with and without the gather between a column- and a "
          "row-parallel layer\n",
          f"Small model (vocabulary {spec['vocab']}, d {spec['d']}, {spec['layers']} layers, {spec['heads']} "
          f"heads, FFN {spec['ffn']}, sequence {spec['seq']}), AdamW, global batch 16, 8 simulated CPU "
          f"devices; the median step of each window of {rows[0]['steps_per_window']} steps, "
          f"{len(rows[0]['paired'])} windows per mode, alternating, in one process per mesh.\n",
          "Forward MiB between devices: tensors read on another device than the one that made them, "
          "in one replica's traced forward pass (`forward_bytes_moved`).\n",
          "| mesh | forward MiB between devices, paired | gathered | paired: median step s | gathered s "
          "| paired / gathered, median of windows | window ratios min - max | load average |",
          "|---|---:|---:|---:|---:|---:|---|---:|"]
    for row in rows:
        ratios = [p / u for p, u in zip(row["paired"], row["unpaired"])]
        moved = row["forward_mib_between_devices"]
        md.append(f"| {row['config']} | {moved['paired']:.1f} MiB | {moved['unpaired']:.1f} MiB | "
                  f"{statistics.median(row['paired']):.3f} | {statistics.median(row['unpaired']):.3f} | "
                  f"{row['ratio']:.2f}x | {min(ratios):.2f}x - {max(ratios):.2f}x | {row['load_average_1min']:.1f} |")
    return "\n".join(md) + "\n"


_CHILD = r"""
import json, sys
import keras_replicator as kr
kr.simulate_devices(8)
from benchmarks.model_parallel import pairing_step_times, run_config
args = sys.argv[1], sys.argv[2], int(sys.argv[3])
result = pairing_step_times(*args, int(sys.argv[4])) if len(sys.argv) > 4 else run_config(*args)
print("RESULT " + json.dumps(result))
"""


def _child(config: str, model_name: str, steps: int, rounds: int | None = None) -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    extra = [] if rounds is None else [str(rounds)]
    result = subprocess.run([sys.executable, "-c", _CHILD, config, model_name, str(steps), *extra], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=3600)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode or not lines:
        raise RuntimeError(f"{config}/{model_name} failed:\n{result.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def formula(params: int, config: str, devices: int = 8) -> dict:
    """Replicated / ZeRO-1 bytes per device from the parameter count (float32, AdamW's 2 slots)."""
    weights = 4 * params
    slots = 8 * params if config == "replicated" else 8 * params / devices
    return {"weights": weights, "gradients": weights, "optimizer": slots, "total": 2 * weights + slots}


def table(rows: list[dict], params: int) -> str:
    lines = ["| configuration | weights MiB (max/device) | gradients MiB | AdamW state MiB | total MiB (max) "
             "| total / (replicated / 8) | source |", "|---|---:|---:|---:|---:|---:|---|"]
    replicated_total = formula(params, "replicated")["total"]
    for row in rows:
        b = row["bytes"]
        got = {k: max(v) for k, v in b.items()} if b else None
        source = row.get("source", "measured")
        lines.append(
            f"| {row['config']} | {got['weights'] / MIB:.1f} | {got['gradients'] / MIB:.1f} | "
            f"{got['optimizer'] / MIB:.1f} | {got['total'] / MIB:.1f} | "
            f"{got['total'] / (replicated_total / 8):.2f} | {source} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model only, 3 timed steps")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--pairing", action="store_true",
                        help="only Megatron's pairing: tp1x8 and tp2x4 with and without (model_parallel_pairing.*)")
    parser.add_argument("--rounds", type=int, default=4, help="--pairing: windows per mode")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.pairing:
        pairing(args.out, args.rounds, args.steps)
        return
    steps = 3 if args.quick else args.steps
    results: dict = {"small": [], "large": []}
    for config in (*CONFIGS, "replicated"):                      # replicated first and last
        results["small"].append(_child(config, "small", steps))
        print(results["small"][-1], flush=True)
    if not args.quick:
        for config in ("tp1x8", "tp2x4", "fsdp8"):
            results["large"].append(_child(config, "large", 0))
            print(results["large"][-1], flush=True)
        params = results["large"][0]["params"]
        for config in ("zero1", "replicated"):
            f = formula(params, config)
            results["large"].insert(0, {"config": config, "params": params, "source": "formula",
                                        "bytes": {k: [v] for k, v in f.items()}})
    with open(os.path.join(args.out, "model_parallel.json"), "w") as f:
        json.dump(results, f, indent=1)
    small = results["small"]
    base = statistics.mean([small[0]["step_seconds"], small[-1]["step_seconds"]])
    md = ["# Tensor parallelism: bytes per device and step time (8 simulated CPU devices, AdamW)\n",
          f"## small model ({small[0]['params']:,} parameters), all measured\n",
          table(small[:-1], small[0]["params"]), "",
          "| configuration | median step s | / replicated |", "|---|---:|---:|"]
    for row in small:
        md.append(f"| {row['config']} | {row['step_seconds']:.3f} | {row['step_seconds'] / base:.2f} |")
    if results["large"]:
        params = results["large"][0]["params"]
        md += ["", f"## large model ({params:,} parameters)\n", table(results["large"], params)]
    with open(os.path.join(args.out, "model_parallel.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
