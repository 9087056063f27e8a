"""Model parallelism's levers against a memory budget: peak RSS, the largest model in 1 GiB per device, step time.

``python -m benchmarks.model_parallel_budget [--quick] [--out DIR]`` (``make bench``; not run in the suite)

On 8 simulated CPU devices, a GPT-style transformer of d_model 512 (16 heads, FFN 2048,
vocabulary 8192, sequence 64, global batch 16) with AdamW, ``layers`` pre-norm blocks,
under six levers, each in a fresh interpreter (``python -m benchmarks.worker``):
``replicated``, ``zero1`` (``shard_optimizer_state=True``), ``tp1x8`` and ``tp2x4``
(Megatron's layout, `benchmarks.model_parallel.megatron_layout`), ``fsdp8`` (every
embedding and kernel split over the 8 replicas, `benchmarks.model_parallel.fsdp_layout`)
and ``fsdp8_remat`` (the same, each block made under ``keras.RematScope(mode="full")``).

* **memory**: for each lever at two depths, a few steps of ``fit``; the bytes of weights and
  optimizer state on each device, summed from where each variable lives, and the process's
  peak RSS (the kernel's high-water mark, ``ru_maxrss``) against its RSS before the model
  was built (TensorFlow and the devices started). All 8 devices share the process, so a
  device's memory is defined as its own weights and optimizer state plus 1/8 of the rest of
  the peak (gradients, activations, gathered weights, buffers: the transient part).
* **largest model in 1 GiB per device**: that per-device figure is linear in the depth (each
  block adds the same weights and activations), so the two depths give it for every depth;
  the deepest model within 1 GiB is computed from them (at 8 x 1 GiB a process is beyond
  what this shared machine may hold, so those sizes are not run).
* **peak RSS, FSDP against replicated**: at the larger depth, the RSS FSDP saves against the
  weight and slot bytes it removes (replicated's total less FSDP's, from where they live).
* **step time**: each lever and replicated take turns window by window in one run
  (`benchmarks.processes.run_group`), the ratio the median of the windows' ratios with its
  90% interval (`benchmarks.ratios`).

Writes ``model_parallel_budget.json`` and ``model_parallel_budget.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import resource
import statistics
import time
from typing import Any

from benchmarks.processes import run_group, run_worker
from benchmarks.protocol import ROOT
from benchmarks.ratios import speedup, speedup_interval

LEVERS = ("replicated", "zero1", "tp1x8", "tp2x4", "fsdp8", "fsdp8_remat")
SPEC = dict(vocab=8192, d=512, heads=16, ffn=2048, seq=64)
BATCH = 16
DEVICES = 8
GIB, MIB = 2**30, 2**20


def transformer(layers: int, remat: bool):
    """`benchmarks.model_parallel.transformer`'s model, its blocks layers of their own (so that
    ``remat`` can put `keras.RematScope` around each block and nothing else)."""
    import contextlib

    import keras

    class Block(keras.layers.Layer):
        # The inner layers are made in build, outside the RematScope: the block is recomputed whole.
        def build(self, shape):
            d, heads = SPEC["d"], SPEC["heads"]
            self.norm1 = keras.layers.LayerNormalization(name="norm1")
            self.mha = keras.layers.MultiHeadAttention(heads, d // heads, name="mha")
            self.norm2 = keras.layers.LayerNormalization(name="norm2")
            self.ffn_in = keras.layers.Dense(SPEC["ffn"], activation="gelu", name="ffn_in")
            self.ffn_out = keras.layers.Dense(d, name="ffn_out")
            # Built here, not on their first call: that call runs in Keras's scratch graph of the
            # block's output shape, and FSDP's split of a new variable cannot be made there.
            for layer in (self.norm1, self.norm2, self.ffn_in):
                layer.build(shape)
            self.mha.build(shape, shape)
            self.ffn_out.build((*shape[:-1], SPEC["ffn"]))

        def call(self, x):
            h = self.norm1(x)
            x = x + self.mha(h, h, use_causal_mask=True)
            return x + self.ffn_out(self.ffn_in(self.norm2(x)))

    seq = SPEC["seq"]
    ids = keras.Input((seq,), dtype="int32")
    positions = keras.ops.zeros_like(ids) + keras.ops.arange(seq, dtype="int32")
    x = keras.layers.Embedding(SPEC["vocab"], SPEC["d"], name="token")(ids)
    x = x + keras.layers.Embedding(seq, SPEC["d"], name="position")(positions)
    with keras.RematScope(mode="full") if remat else contextlib.nullcontext():
        blocks = [Block(name=f"block{i}") for i in range(layers)]
    for block in blocks:
        x = block(x)
    x = keras.layers.LayerNormalization(name="final_norm")(x)
    return keras.Model(ids, keras.layers.Dense(SPEC["vocab"], name="logits")(x))


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def run_lever(spec: dict[str, Any]) -> dict[str, Any]:
    """The worker kind ``model_parallel``: one lever's ``fit`` at ``spec["layers"]`` blocks.

    ``spec["steps"]``: the memory run (that many steps; bytes per device, RSS); else a timed
    run of ``warmup_steps`` then ``windows`` of ``window_steps`` (in turns with ``turns``).
    """
    from benchmarks.devices import setup_devices

    setup_devices(DEVICES)
    import keras
    import numpy as np

    import keras_replicator as kr
    from benchmarks.model_parallel import strategy_for
    from benchmarks.window_clock import WindowClock

    lever = spec["lever"]
    strategy = strategy_for("fsdp8" if lever == "fsdp8_remat" else lever)
    baseline = _rss()
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = transformer(int(spec["layers"]), lever == "fsdp8_remat")
        model.compile(keras.optimizers.AdamW(1e-4),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.optimizer.build(model.trainable_variables)
    parts = kr.model_parallel.training_bytes_per_device(model)
    at_rest = {d: parts["weights"].get(d, 0) + parts["optimizer"].get(d, 0) for d in parts["total"]}
    steps = int(spec.get("steps", 0))
    clock = None if steps else WindowClock(spec["warmup_steps"], spec["window_steps"], spec["windows"],
                                           bool(spec.get("turns")))

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            clock.tick()
            self.model.stop_training = clock.stopped

    total = steps or clock.total_ticks
    x = np.random.default_rng(0).integers(0, SPEC["vocab"], (BATCH * total, SPEC["seq"]))
    history = model.fit(x, np.roll(x, -1, axis=1), batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                        callbacks=[] if clock is None else [Clock()])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024     # before get_weights' copies
    out = {"lever": lever, "layers": int(spec["layers"]), "replicas": strategy.num_replicas_in_sync,
           # The whole arrays (a variable split over the replicas shows its slice's shape inside).
           "params": int(sum(w.size for w in model.get_weights())),
           "at_rest": sorted(at_rest.values()), "loss": history.history["loss"][-1]}
    if clock is None:
        out.update(baseline_rss=baseline, peak_rss=peak)
    else:
        samples = clock.samples(BATCH)
        out.update(examples_per_second=statistics.median(samples), samples=samples)
    return out


def per_device(run: dict) -> float:
    """A device's memory: its own weights and optimizer state (the most loaded device's) plus 1/8 of
    the rest of the process's peak over its RSS before the model was built."""
    transient = run["peak_rss"] - run["baseline_rss"] - sum(run["at_rest"])
    return max(run["at_rest"]) + transient / DEVICES


def largest(small: dict, large: dict, budget: float = GIB) -> dict:
    """The deepest model within ``budget`` per device, from the per-device figures at two depths."""
    dl = large["layers"] - small["layers"]
    bytes_per_layer = (per_device(large) - per_device(small)) / dl
    params_per_layer = (large["params"] - small["params"]) / dl
    fixed = per_device(small) - bytes_per_layer * small["layers"]
    layers = int((budget - fixed) // bytes_per_layer) if bytes_per_layer > 0 else None
    params = None if layers is None else int(small["params"] + params_per_layer * (layers - small["layers"]))
    state_per_layer = (max(large["at_rest"]) - max(small["at_rest"])) / dl
    return {"bytes_per_layer": bytes_per_layer, "fixed": fixed, "layers": layers, "params": params,
            "bytes_per_param": bytes_per_layer / params_per_layer, "state_per_layer": state_per_layer}


def check_run(runs: dict, lever: str, layers: int, steps: int) -> dict:
    """``lever`` at a third depth: its measured per-device memory against the two depths' line."""
    run = run_worker(dict(kind="model_parallel", lever=lever, layers=layers, steps=steps), 3600)
    line = largest(*runs[lever])
    predicted = line["fixed"] + line["bytes_per_layer"] * layers
    print(f"  check {lever} x{layers}: {per_device(run) / MIB:.0f} MiB, the line {predicted / MIB:.0f}", flush=True)
    return {"run": run, "measured": per_device(run), "predicted": predicted}


def fsdp_rss(runs: dict, lever: str = "fsdp8") -> dict:
    """Peak RSS saved by FSDP against replicated, and the weight and slot bytes it removes."""
    rep, fsdp = runs["replicated"][-1], runs[lever][-1]
    removed = sum(rep["at_rest"]) - sum(fsdp["at_rest"])
    saved = rep["peak_rss"] - fsdp["peak_rss"]
    return {"lever": lever, "layers": rep["layers"], "params": rep["params"], "replicated_peak": rep["peak_rss"],
            "fsdp_peak": fsdp["peak_rss"], "saved": saved, "removed": removed, "fraction": saved / removed}


def memory_runs(depths: tuple[int, int], steps: int, jobs: int) -> dict:
    """Every lever at both depths, ``jobs`` processes at a time (the largest with the smallest)."""
    specs = [dict(kind="model_parallel", lever=lever, layers=layers, steps=steps)
             for layers in depths for lever in LEVERS]
    order = [s for pair in zip(specs[len(LEVERS):], specs[:len(LEVERS)]) for s in pair]
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        results = list(pool.map(lambda s: run_worker(s, 3600), order))
    runs: dict = {lever: [] for lever in LEVERS}
    for result in sorted(results, key=lambda r: r["layers"]):
        runs[result["lever"]].append(result)
        print(f"  memory {result['lever']} x{result['layers']}: peak {result['peak_rss'] / MIB:.0f} MiB, "
              f"per device {per_device(result) / MIB:.0f} MiB", flush=True)
    return runs


def step_runs(layers: int, windows: int, window_steps: int) -> dict:
    """Each lever and replicated taking turns window by window: their paired step-time ratio."""
    out = {}
    for lever in LEVERS[1:]:
        specs = [dict(kind="model_parallel", lever=name, layers=layers, warmup_steps=2,
                      window_steps=window_steps, windows=windows) for name in ("replicated", lever)]
        base, other = run_group(specs, timeout=3600)
        for result in (base, other):
            if isinstance(result, RuntimeError):
                raise result
        entries = [dict(r, group=lever, window_samples=[r["samples"]]) for r in (base, other)]
        interval = speedup_interval(entries[0], entries[1])       # replicated's speed over the lever's
        out[lever] = {"replicated": base, "lever": other, "step_ratio": speedup(entries[0], entries[1]),
                      "interval": interval,
                      "ratios": [b / o for b, o in zip(base["samples"], other["samples"])]}
        print(f"  step {lever}: {out[lever]['step_ratio']:.2f} x replicated", flush=True)
    return out


def loss_gap(runs: dict) -> float:
    """The largest difference between two levers' last losses at the same depth."""
    by_depth: dict[int, list[float]] = {}
    for lever_runs in runs.values():
        for r in lever_runs:
            by_depth.setdefault(r["layers"], []).append(r["loss"])
    return max(max(losses) - min(losses) for losses in by_depth.values())


def report(doc: dict) -> str:
    runs, big = doc["memory"], doc["largest"]
    lines = ["<!-- Written by python -m benchmarks.model_parallel_budget: do not edit. -->", "",
             f"**Memory per device** ({DEVICES} simulated CPU devices in one process, AdamW, transformer "
             f"d_model {SPEC['d']}, global batch {BATCH}, {doc['steps']} steps of `fit`). A device's memory: "
             "its own weights and optimizer state, from where each variable lives, plus 1/8 of the rest "
             "of the process's peak RSS over its RSS before the model was built. Every lever starts from "
             "the same weights and reads the same batches; the largest difference between two levers' last "
             f"losses at the same depth: {loss_gap(runs):.1e}.", "",
             "| lever | blocks | parameters | peak RSS MiB | RSS before build MiB | weights + state, "
             "most loaded device MiB | per device MiB | last loss |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for lever in LEVERS:
        for r in runs[lever]:
            lines.append(f"| {lever} | {r['layers']} | {r['params']:,} | {r['peak_rss'] / MIB:.0f} | "
                         f"{r['baseline_rss'] / MIB:.0f} | {max(r['at_rest']) / MIB:.1f} | "
                         f"{per_device(r) / MIB:.0f} | {r['loss']:.4f} |")
    lines += ["", "**Largest model in 1 GiB per device** (8 devices; the deepest model of d_model 512 whose "
              "per-device memory, linear in the depth between the two measured depths, is within 1 GiB; "
              "computed, not run: 8 x 1 GiB is beyond what this shared machine may hold in one process).", "",
              "| lever | MiB per block per device | of which weights and state | MiB fixed per device "
              "| bytes per parameter per device | blocks | parameters | source |",
              "|---|---:|---:|---:|---:|---:|---:|---|"]
    for lever in LEVERS:
        b = big[lever]
        lines.append(f"| {lever} | {b['bytes_per_layer'] / MIB:.1f} | {b['state_per_layer'] / MIB:.1f} | "
                     f"{b['fixed'] / MIB:.0f} | "
                     f"{b['bytes_per_param']:.2f} | {b['layers']} | {b['params'] / 1e6:.0f}M | "
                     f"computed from the {runs[lever][0]['layers']}- and {runs[lever][1]['layers']}-block runs |")
    c = doc["check"]
    lines += ["", f"The line checked at a third depth: {c['run']['lever']} at {c['run']['layers']} blocks "
              f"({c['run']['params']:,} parameters) measured {c['measured'] / MIB:.0f} MiB per device, the line "
              f"through the two depths gives {c['predicted'] / MIB:.0f} MiB."]
    f = doc["fsdp_rss"][0]
    lines += ["", f"**Peak RSS, FSDP against replicated** ({f['layers']} blocks, {f['params']:,} parameters, the "
              "same `fit`): replicated's weight and optimizer-state bytes over all devices less FSDP's are "
              "what FSDP removes; the target is a saving of at least 0.8 of them.", "",
              "| lever | replicated peak MiB | lever's peak MiB | RSS saved MiB | weight and slot bytes "
              "removed MiB | saved / removed |", "|---|---:|---:|---:|---:|---:|"]
    for f in doc["fsdp_rss"]:
        lines.append(f"| {f['lever']} | {f['replicated_peak'] / MIB:.0f} | {f['fsdp_peak'] / MIB:.0f} | "
                     f"{f['saved'] / MIB:.0f} | {f['removed'] / MIB:.0f} | {f['fraction']:.2f} |")
    step = doc["step"]
    if step:
        lines += ["", f"**Step time against replicated** ({doc['step_layers']} block{'s' * (doc['step_layers'] > 1)}; each lever and "
                  "replicated took turns window by window in one run; the ratio is the median of the "
                  "windows' ratios with its 90% interval; the 8 devices share 2 CPU cores).", "",
                  "| lever | replicated step ms | lever step ms | step time / replicated | 90% interval |",
                  "|---|---:|---:|---:|---|"]
        for lever, s in step.items():
            lo_hi = s["interval"]
            lines.append(f"| {lever} | {1e3 * BATCH / s['replicated']['examples_per_second']:.0f} | "
                         f"{1e3 * BATCH / s['lever']['examples_per_second']:.0f} | {s['step_ratio']:.2f} | "
                         + (f"{lo_hi[0]:.2f} to {lo_hi[1]:.2f}" if lo_hi else "too few windows") + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="depths 1 and 2, 2 steps, 2 timed windows")
    parser.add_argument("--jobs", type=int, default=2, help="memory runs at a time (RSS is per process)")
    parser.add_argument("--reuse", choices=("memory", "all"),
                        help="take the memory runs (or all runs) from --out's JSON, measure the rest")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = parser.parse_args(argv)
    depths, steps, windows = ((1, 2), 2, 2) if args.quick else ((1, 5), 4, 8)
    path = os.path.join(args.out, "model_parallel_budget.json")
    old = {}
    if args.reuse:
        with open(path) as f:
            old = json.load(f)
    os.makedirs(args.out, exist_ok=True)
    started = time.perf_counter()
    doc = {"devices": DEVICES, "model": SPEC, "batch": BATCH, "steps": old.get("steps", steps),
           "memory": old["memory"] if args.reuse else memory_runs(depths, steps, args.jobs), "step_layers": 1}
    runs = doc["memory"]
    doc["largest"] = {lever: largest(*runs[lever]) for lever in LEVERS}
    doc["fsdp_rss"] = [fsdp_rss(runs, lever) for lever in ("fsdp8", "fsdp8_remat")]
    doc["check"] = old.get("check") or check_run(runs, "fsdp8", 3 if args.quick else 9, doc["steps"])
    doc["step"] = old.get("step", {}) if args.reuse == "all" else {}
    with open(path, "w") as f:                      # the memory runs kept if the timed ones fail
        json.dump(doc, f, indent=1)
    if args.reuse != "all":
        doc["step"] = step_runs(1, windows, 2)
    doc["seconds"] = time.perf_counter() - started + old.get("seconds", 0.0)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    text = report(doc)
    with open(os.path.join(args.out, "model_parallel_budget.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
