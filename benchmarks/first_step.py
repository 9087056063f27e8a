"""Time to the first training step against the number of replicas.

``python -m benchmarks.first_step [--models resnet50 sngan] [--replicas 1 2 4 8] [--rounds 3]``

Models: ``resnet50``, ``sngan`` (the default), ``cnn`` (the small CNN) and ``lm`` (the peers'
transformer LM, ``benchmarks.peers_worker``, whose first step is the furthest from Keras on
JAX's). For each model and replica count, a fresh interpreter (the simulated device
count is fixed when TensorFlow starts) builds and compiles the model and runs
``model.fit`` for 2 steps, timing where the first step's time goes:

* ``prepare``: from ``fit``'s call to the first call of its train function
  (Keras's data adapter, the symbolic build of the model, the callbacks);
* ``trace``: Python tracing of the train function, made by its first call as in ``fit``
  (to the traced Python function's return);
* ``first_call``: the rest of the first call: the traced graph made a function, graph optimisation
  (Grappler), partitioning over the devices, creating the kernels, and the step;
* ``grappler``: the part of it (and of the input pipeline's functions) spent in
  Grappler's passes, summed from TensorFlow's own log of them
  (``TF_CPP_VMODULE=meta_optimizer=1``), with the largest passes named. These are
  the log's wall times: on a loaded machine they overstate Grappler's share (turning
  the whole meta optimizer off for the train function saved 5.5-10 CPU s of a
  4-replica ResNet-50 first step whose log summed 31-220 s of passes);
* ``step``: the second step (a steady step), so that ``first_call - grappler -
  step`` is what instantiating the function costs besides optimising it.

Each phase is also timed in the process's CPU seconds (``*_cpu``), which a
loaded machine changes much less than wall time (tracing and Grappler run on
one thread), but still changes: threads that spin while they wait count too
(ResNet-50's one-device first step measured 22.2 CPU s at load average 0.4,
25.9-27.2 at 7-12), so compare rows measured at similar loads.

``first_step`` is ``prepare + trace + first_call``: what a user waits between
``fit`` and its first step (the model's build and compile, ``build``, come before).
Configurations: one device without a strategy, ``ReplicatorStrategy`` on
each replica count (simulated CPU devices), and ``ReplicatorStrategy(trace_once=False)``
(the step traced per replica, the engine before) on the ``--per-replica`` counts. Each
row also counts the traced graph's nodes (``graph_nodes``). Writes ``first_step.json`` and
``first_step.md`` to the output directory and the plot to ``docs/assets/first_step.png``.

With ``--rounds R``, every configuration runs R times, the order of the configurations rotating
from round to round so that a drift in the machine's load does not fall on one of them. Each row
is then the round whose first step is the median of its R (its phases are that round's, so they
add up), with all R first steps beside it: one-device first steps of the same machine varied by
up to 45% from one process to the next.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import subprocess
import sys
import time
from typing import Any

from benchmarks.protocol import ROOT, finish_worker, read_result

OUTPUT_DIR = os.path.join(ROOT, "benchmarks", "results")
DOCS_PLOT = os.path.join(ROOT, "docs", "assets", "first_step.png")
# lm: the peers' transformer LM (benchmarks/peers_worker.py, AdamW), at its batch there.
GLOBAL_BATCH = {"resnet50": 64, "sngan": 32, "cnn": 128, "lm": 32}
_PASS = re.compile(r"meta_optimizer\.cc:\d+\] ([\w-]+)(?:\{.*\})?: Graph size after: .*time = ([\d.]+)ms")
_ITEM = re.compile(r"Starting optimization for grappler item: (\S+)")


def _pass_runs(log: str):
    """(function, pass, seconds) for each pass run in a TensorFlow log of Grappler's items."""
    item = "?"
    for line in log.splitlines():
        found = _ITEM.search(line)
        if found:
            item = found.group(1)
        elif found := _PASS.search(line):
            yield item, found.group(1), float(found.group(2)) / 1000


def grappler_seconds(log: str) -> tuple[float, dict[str, float], dict[str, float]]:
    """Seconds in Grappler's passes in a TensorFlow log: the total, per pass and per function."""
    per_pass: collections.Counter = collections.Counter()
    per_item: collections.Counter = collections.Counter()
    for item, name, seconds in _pass_runs(log):
        per_pass[name] += seconds
        per_item[item] += seconds
    return sum(per_pass.values()), dict(per_pass), dict(per_item)


def passes_of(log: str, function_prefix: str) -> list[str]:
    """The Grappler passes a TensorFlow log shows run on the functions named `function_prefix...`."""
    return sorted({name for item, name, _ in _pass_runs(log) if item.startswith(function_prefix)})


def _traced_function(function):
    """The `tf.function` inside Keras's train function.

    Keras 3.15 wraps its tf.function (multi_step_on_iterator) in a plain function, and
    ours wraps that again (`_compat.exhausted_step`): the closures are searched, nearest first.
    """
    frontier = [function]
    for _ in range(4):
        cells = [c.cell_contents for f in frontier for c in (getattr(f, "__closure__", None) or ())
                 if callable(c.cell_contents)]
        found = next((c for c in cells if hasattr(c, "get_concrete_function")), None)
        if found is not None:
            return found
        frontier = cells
    raise RuntimeError(f"no tf.function found inside the train function {function!r}")


def _mark_trace_end(traced, marks: dict, cpu: dict) -> None:
    """Marks the end of `traced`'s first Python trace (`marks["trace"]`), made by its first call.

    The trace is made inside the train function's call, not by `get_concrete_function`
    before it: our wrapper of that call (`replica_call_options`) chooses its Grappler
    settings from what the call's traces found, as in `fit`. The harness's one private
    read: `tf.function`'s `_python_function` (TF 2.16-2.21), wrapped before the first trace.
    """
    python_function = traced.python_function

    @functools.wraps(python_function)
    def marked(*args, **kwargs):
        out = python_function(*args, **kwargs)
        if "trace" not in marks:
            marks["trace"], cpu["trace"] = time.perf_counter(), time.process_time()
        return out

    traced._python_function = marked


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """In the worker process: one model, one strategy, ``fit`` for 2 steps, timed by phase."""
    from benchmarks.devices import build_in_scope, device_names, make_strategy, setup_devices
    from benchmarks.models import build_model, build_sngan
    from benchmarks.synthetic_data import sngan_dataset, synthetic_dataset, token_dataset

    setup_devices(spec["replicas"])
    import keras

    strategy = None if spec["strategy"] == "one" else make_strategy(
        spec["strategy"], device_names(spec["replicas"]))

    def build():
        if spec["model"] == "sngan":
            return build_sngan()
        if spec["model"] == "lm":
            from benchmarks.peers_worker import SIZES, compiled

            keras.utils.set_random_seed(0)
            return compiled(keras, "lm", SIZES["full"]["lm"])
        model = build_model(spec["model"])
        model.compile(keras.optimizers.SGD(0.01, momentum=0.9),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    t0 = time.perf_counter()
    model = build_in_scope(strategy, build)
    times: dict[str, float] = {"build": time.perf_counter() - t0}
    batch = GLOBAL_BATCH[spec["model"]]
    dataset = {"sngan": sngan_dataset, "lm": token_dataset}.get(spec["model"], synthetic_dataset)(batch)
    marks: dict[str, float] = {}
    cpu: dict[str, float] = {}  # the same marks in this process's CPU time
    make = model.make_train_function

    def make_train_function(force=False):
        make(force)
        function = model.train_function
        traced = _traced_function(function)
        _mark_trace_end(traced, marks, cpu)

        def timed(iterator):
            if "trace" not in marks:
                marks["called"], cpu["called"] = time.perf_counter(), time.process_time()
                out = function(iterator)  # traced inside the call, as in `fit`
                marks["first_call"], cpu["first_call"] = time.perf_counter(), time.process_time()
                marks["nodes"] = graph_nodes(traced.get_concrete_function(iterator))
                return out
            start = time.perf_counter()
            out = function(iterator)
            marks["step"] = time.perf_counter() - start
            return out

        model.train_function = timed
        return timed

    model.make_train_function = make_train_function

    class FirstBatch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            marks.setdefault("first_batch_end", time.perf_counter())

    t0, cpu0 = time.perf_counter(), time.process_time()
    model.fit(dataset, epochs=1, steps_per_epoch=2, verbose=0, callbacks=[FirstBatch()])
    times.update(prepare=marks["called"] - t0, trace=marks["trace"] - marks["called"],
                 first_call=marks["first_call"] - marks["trace"], step=marks["step"],
                 first_step=marks["first_batch_end"] - t0,
                 prepare_cpu=cpu["called"] - cpu0, trace_cpu=cpu["trace"] - cpu["called"],
                 first_call_cpu=cpu["first_call"] - cpu["trace"])
    return {"model": spec["model"], "strategy": spec["strategy"], "replicas": spec["replicas"],
            "global_batch": batch, "nodes": marks["nodes"], **times}


def graph_nodes(concrete) -> int:
    """Nodes of a traced function's graph and of every function in its library, each once."""
    graph_def = concrete.graph.as_graph_def()
    return len(graph_def.node) + sum(len(f.node_def) for f in graph_def.library.function)


def measure(model: str, strategy: str, replicas: int, timeout: float = 1800.0) -> dict[str, Any]:
    """Runs :func:`run_one` in a fresh interpreter with Grappler's log on; adds its figures."""
    spec = {"model": model, "strategy": strategy, "replicas": replicas}
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="meta_optimizer=1",
               PYTHONUNBUFFERED="1")
    env.pop("TF_CONFIG", None)
    env.pop("KR_TEST_DEVICES", None)
    try:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.first_step", "--worker", json.dumps(spec)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(spec, error=f"timed out after {timeout:.0f} s")
    result = read_result(proc.stdout.splitlines()) if proc.returncode == 0 else None
    if result is None:
        return dict(spec, error=f"exit {proc.returncode}: {proc.stderr[-1500:]}")
    total, per_pass, per_item = grappler_seconds(proc.stderr)
    result["grappler"] = total
    result["grappler_passes"] = {k: round(v, 3) for k, v in
                                 sorted(per_pass.items(), key=lambda kv: -kv[1])[:6]}
    result["grappler_functions"] = {k: round(v, 3) for k, v in
                                    sorted(per_item.items(), key=lambda kv: -kv[1])[:3]}
    result["instantiate"] = result["first_call"] - min(result["first_call"], total) - result["step"]
    # Keras's train function's own graph (the calls of the step; for one device, the step)
    result["train_function_passes"] = passes_of(proc.stderr, "__inference_multi_step_on_iterator")
    return result


def rotated(runs: list, round_index: int) -> list:
    """The configurations of round ``round_index``: the list rotated by one more each round."""
    shift = round_index % len(runs) if runs else 0
    return runs[shift:] + runs[:shift]


def median_round(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Of one configuration's rounds, the one whose first step is the median (the lower of the two
    middle ones for an even count), with every round's first step as ``first_step_rounds``."""
    done = [r for r in results if "error" not in r]
    if not done:
        return results[0]
    ordered = sorted(done, key=lambda r: r["first_step"])
    chosen = dict(ordered[(len(ordered) - 1) // 2])
    chosen["first_step_rounds"] = [r["first_step"] for r in done]
    if len(done) < len(results):
        chosen["failed_rounds"] = len(results) - len(done)
    return chosen


NAMES = {"one": "one device", "ours": "ours, traced once", "ours_per_replica": "ours, per replica"}
# The targets: the first step against one device's, by replicas; graph nodes at 8.
FIRST_STEP_TARGETS = {4: 1.5, 8: 2.0}
NODES_TARGET = (8, 2.0)


def _one(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((r for r in rows if r["strategy"] == "one" and "error" not in r), None)


def targets(doc: dict[str, Any]) -> list[str]:
    """One line per target and model: measured, and whether it is met."""
    lines = []
    for model in doc["models"]:
        rows = [r for r in doc["results"] if r["model"] == model and "error" not in r]
        one = _one(rows)
        if one is None:
            continue
        for k, limit in FIRST_STEP_TARGETS.items():
            row = next((r for r in rows if r["strategy"] == "ours" and r["replicas"] == k), None)
            if row is not None:
                ratio = row["first_step"] / one["first_step"]
                lines.append(f"- {model}, first step on {k} replicas <= {limit}x one device's: "
                             f"{ratio:.2f}x ({'met' if ratio <= limit else 'not met'})")
        k, limit = NODES_TARGET
        row = next((r for r in rows if r["strategy"] == "ours" and r["replicas"] == k), None)
        if row is not None and one.get("nodes"):
            ratio = row["nodes"] / one["nodes"]
            lines.append(f"- {model}, graph nodes on {k} replicas <= {limit}x one device's: "
                         f"{row['nodes']:,} against {one['nodes']:,}, {ratio:.2f}x "
                         f"({'met' if ratio <= limit else 'not met'})")
    return lines


def markdown(doc: dict[str, Any]) -> str:
    """The table of a run: seconds per phase, and the first step against one device's."""
    rounds = doc.get("rounds", 1)
    lines = [f"Time to the first `fit` step (s), {doc['date']}, {doc['environment']}; "
             + ("one fresh process per row." if rounds == 1 else
                f"{rounds} rounds, one fresh process per configuration and round, the order rotating; each row is "
                "the round with the median first step, all rounds' first steps beside it."), "",
             "| model | strategy | replicas | prepare | trace | first call | of which Grappler "
             "| first step | / one device | graph nodes | steady step | CPU s: prepare, trace, first call "
             "| first step of each round |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for model in doc["models"]:
        rows = [r for r in doc["results"] if r["model"] == model]
        one = _one(rows)
        for r in rows:
            name = NAMES.get(r["strategy"], r["strategy"])
            if "error" in r:
                lines.append(f"| {model} | {name} | {r['replicas']} | failed: "
                             f"{r['error'].splitlines()[0][:80]} | | | | | | | | | |")
                continue
            ratio = f"{r['first_step'] / one['first_step']:.2f}x" if one else "n/a"
            cpu = (", ".join(f"{r[k]:.1f}" for k in ("prepare_cpu", "trace_cpu", "first_call_cpu"))
                   if "trace_cpu" in r else "n/a")
            nodes = f"{r['nodes']:,}" if r.get("nodes") else "n/a"
            each = ", ".join(f"{t:.1f}" for t in r.get("first_step_rounds", [r["first_step"]]))
            if r.get("failed_rounds"):
                each += f" ({r['failed_rounds']} failed)"
            lines.append(f"| {model} | {name} | {r['replicas']} | {r['prepare']:.1f} | {r['trace']:.1f} "
                         f"| {r['first_call']:.1f} | {r['grappler']:.1f} | **{r['first_step']:.1f}** "
                         f"| {ratio} | {nodes} | {r['step']:.2f} | {cpu} | {each} |")
    found = targets(doc)
    if found:
        lines += ["", "Targets:", "", *found]
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: str) -> None:
    """First step against replicas: traced once, per replica, and one device's as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = doc["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = [r for r in doc["results"] if r["model"] == model and "error" not in r]
        for strategy, style in (("ours_per_replica", "s--"), ("ours", "o-")):
            line = sorted((r["replicas"], r["first_step"]) for r in rows if r["strategy"] == strategy)
            if line:
                ax.plot(*zip(*line), style, label=NAMES[strategy])
        one = _one(rows)
        if one is not None:
            ax.axhline(one["first_step"], color="grey", linestyle=":", label="one device")
            for k, limit in FIRST_STEP_TARGETS.items():
                ax.plot([k], [limit * one["first_step"]], "v", color="red",
                        label="target" if k == min(FIRST_STEP_TARGETS) else None)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{model}, global batch {GLOBAL_BATCH[model]}")
        ax.set_xlabel("replicas (simulated CPU devices)")
        ax.set_ylabel("seconds to the first step")
        ax.set_ylim(bottom=0)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet50", "sngan"], choices=sorted(GLOBAL_BATCH))
    parser.add_argument("--replicas", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--per-replica", nargs="*", type=int, default=[2, 4, 8],
                        help="replica counts also measured with trace_once=False (the old engine)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of each configuration; each row is the run with the median first step")
    parser.add_argument("--output-dir", default=OUTPUT_DIR)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        finish_worker(run_one(json.loads(args.worker)))
    if any(k < 1 for k in args.replicas + args.per_replica):
        parser.error("--replicas must be at least 1")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    os.makedirs(args.output_dir, exist_ok=True)  # before the runs: a folder that cannot be made fails now
    from benchmarks.machine import onednn_setting, run_description

    doc: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "environment": f"{run_description()}, {onednn_setting()}; configurations one after the other",
                           "models": args.models, "rounds": args.rounds, "results": []}
    runs = [(model, strategy, k) for model in args.models
            for strategy, k in ([("one", 1)] + [("ours", k) for k in args.replicas]
                                + [("ours_per_replica", k) for k in args.per_replica])]
    measured: dict[tuple, list] = {run: [] for run in runs}
    for i in range(args.rounds):
        for run in rotated(runs, i):
            result = measure(*run)
            measured[run].append(result)
            print(json.dumps({key: (round(v, 2) if isinstance(v, float) else v)
                              for key, v in dict(result, round=i + 1).items()}), flush=True)
    doc["results"] = [median_round(measured[run]) for run in runs]
    with open(os.path.join(args.output_dir, "first_step.json"), "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    table = markdown(doc)
    with open(os.path.join(args.output_dir, "first_step.md"), "w") as f:
        f.write(table)
    plot_path = os.path.join(args.output_dir, "first_step.png")
    plot(doc, plot_path)
    if os.path.abspath(args.output_dir) == os.path.abspath(OUTPUT_DIR):
        import shutil

        os.makedirs(os.path.dirname(DOCS_PLOT), exist_ok=True)
        shutil.copyfile(plot_path, DOCS_PLOT)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
