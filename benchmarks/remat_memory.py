"""`keras.RematScope` on TensorFlow: peak RSS of the same ``fit`` with and without it.

``python -m benchmarks.remat_memory [--quick] [--pairs N] [--out DIR]``

The model has big activations and small weights: 4 blocks of 4 ``Dense(512,
relu)`` on a batch of 8,192 (one activation: 16 MiB; the weights: 16 MiB in
all). ``RematScope(mode="full")`` is put around the blocks, whose inner layers
are made in ``build``, so each block keeps only its input for the backward pass
and recomputes its 4 layers there. Each run is a fresh interpreter (peak RSS is
the process's ``ru_maxrss``), on one device and on 4 simulated devices under
``kr.ReplicatorStrategy()`` (the same global batch), runs with and without remat
alternating (``--pairs`` of each). The losses of each pair must be equal.

Writes ``remat_memory.json`` and ``remat_memory.md`` to the output directory.
"""

from __future__ import annotations

import json
import os
import statistics

from benchmarks.memory import MIB, paired_runs_arguments, run_fresh

_RUN = r"""
import contextlib, json, resource, sys
import keras_replicator as kr
devices, remat, width, batch, steps = json.loads(sys.argv[1])
kr.simulate_devices(devices)
import keras, numpy as np


class Block(keras.layers.Layer):
    # Its Dense layers are made in build, outside the RematScope: only the block is recomputed.
    def build(self, shape):
        self.dense = [keras.layers.Dense(width, activation="relu") for _ in range(4)]

    def call(self, x):
        for dense in self.dense:
            x = dense(x)
        return x


keras.utils.set_random_seed(0)
strategy = kr.ReplicatorStrategy() if devices > 1 else None
with strategy.scope() if strategy else contextlib.nullcontext():
    with keras.RematScope(mode="full") if remat else contextlib.nullcontext():
        blocks = [Block() for _ in range(4)]
    model = keras.Sequential([keras.Input((width,)), *blocks, keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(1e-3), "mse")
rng = np.random.default_rng(1)
x = rng.normal(size=(batch * steps, width)).astype("float32")
y = rng.normal(size=(batch * steps, 1)).astype("float32")
losses = [float(model.train_on_batch(x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]))
          for i in range(steps)]
json.dump({"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "losses": losses}, sys.stdout)
"""


def measure(devices: int, pairs: int, width: int, batch: int, steps: int) -> dict:
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(pairs):
        for remat in (False, True):
            runs[remat].append(run_fresh(_RUN, json.dumps([devices, remat, width, batch, steps])))
    loss_gap = max(abs(a - b) for plain, remat in zip(runs[False], runs[True])
                   for a, b in zip(plain["losses"], remat["losses"]))
    rss = {remat: statistics.median(r["peak_rss"] for r in rs) for remat, rs in runs.items()}
    return {"devices": devices, "peak_rss_mib": {"without": rss[False] / MIB, "with": rss[True] / MIB},
            "all_peak_rss_mib": {("with" if k else "without"): [r["peak_rss"] / MIB for r in v]
                                 for k, v in runs.items()},
            "saved_mib": (rss[False] - rss[True]) / MIB, "losses": runs[False][0]["losses"],
            "largest_loss_difference": loss_gap}


def table(results: list[dict], width: int, batch: int) -> str:
    activation = batch * width * 4 / MIB
    lines = [f"Peak RSS of one `fit` process, 4 blocks x 4 Dense({width}, relu), global batch {batch} "
             f"(one activation {activation:.0f} MiB), `RematScope(mode=\"full\")` around the blocks; "
             "median of the runs.", "",
             "| devices | without remat (MiB) | with remat (MiB) | saved (MiB) | largest loss difference |",
             "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['devices']} | {r['peak_rss_mib']['without']:.0f} | {r['peak_rss_mib']['with']:.0f} "
                     f"| {r['saved_mib']:.0f} | {r['largest_loss_difference']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = paired_runs_arguments(argv, __doc__.splitlines()[0], "a small model, 1 pair, one device", pairs=2)
    width, batch, steps = (64, 256, 2) if args.quick else (512, 8192, 3)
    device_counts = (1,) if args.quick else (1, 4)
    pairs = 1 if args.quick else args.pairs
    results = [measure(n, pairs, width, batch, steps) for n in device_counts]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "remat_memory.json"), "w", encoding="utf-8") as f:
        json.dump({"width": width, "batch": batch, "steps": steps, "results": results}, f, indent=1)
    text = table(results, width, batch)
    with open(os.path.join(args.out, "remat_memory.md"), "w", encoding="utf-8") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
