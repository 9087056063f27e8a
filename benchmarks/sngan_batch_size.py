"""The SN-GAN large-batch study (tutorial 2): digits, 4 simulated replicas, global batch 32, 128
and 256, the same generator updates and learning rate; FID and class accuracy of the samples
against generator updates and against training time.

Run ``python -m benchmarks.sngan_batch_size`` (``make bench-sngan``; about 20 minutes on 2 busy
cores). Each batch size is one run of the product's own command,
``python -m keras_replicator.applications.sngan --dataset digits --config small16 ...``, in a
fresh interpreter, into ``OUT/batch{B}``; a run whose ``metrics.json`` already reaches
``--steps`` is reused, an unfinished one resumes (the command continues from its checkpoint),
so an interrupted study is continued by running it again. Per evaluation interval the command
records FID on the digits classifier's 64-d features, ``class_accuracy`` (the classifier's
prediction of each of ``--eval-samples`` samples, drawn from latents the training never used,
against the class it was asked for) and ``train_seconds`` (time in training steps, without the
evaluations, checkpoints and the graph-building first step).

Writes ``RESULTS/sngan_batch_size.json`` (settings, commands and every run's metrics),
``.md`` (the table) and ``.png`` (the four curves); writing to the default results directory
also copies the plot to ``docs/assets/sngan_batch_size.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
NAME = "sngan_batch_size"
ACCURACY_TARGET = 0.8  # the learning test's bar


def command(args: argparse.Namespace, batch: int) -> list[str]:
    """The command line of one run (without the interpreter)."""
    out = os.path.join(args.out, f"batch{batch}")
    if os.path.abspath(out).startswith(ROOT + os.sep):  # the command runs in ROOT
        out = os.path.relpath(out, ROOT)
    return ["-m", "keras_replicator.applications.sngan", "--dataset", "digits",
            "--config", "small16", "--out", out,
            "--global-batch-size", str(batch), "--steps", str(args.steps),
            "--eval-every", str(args.eval_every), "--eval-samples", str(args.eval_samples),
            "--replicas", str(args.replicas), "--n-dis", str(args.n_dis),
            "--learning-rate", str(args.learning_rate), "--ema-decay", "-1",
            "--seed", str(args.seed), "--verbose", "0"]


def _history(out: str) -> list[dict[str, Any]]:
    path = os.path.join(out, "metrics.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)


def run(args: argparse.Namespace, batch: int) -> dict[str, Any]:
    """Runs (or reuses, or resumes) one batch size; its metrics and process time."""
    out = os.path.join(args.out, f"batch{batch}")
    log_path = os.path.join(out, "study.json")  # this script's own record of the run
    log = {"process_seconds": 0.0, "invocations": []}
    if os.path.exists(log_path):
        with open(log_path) as f:
            log = json.load(f)
    history = _history(out)
    if not history or history[-1]["step"] < args.steps:
        os.makedirs(out, exist_ok=True)
        cmd = [sys.executable, *command(args, batch)]
        print(f"batch {batch}: {' '.join(cmd[1:])}", flush=True)
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
        started, load = time.perf_counter(), os.getloadavg()[0]
        with open(os.path.join(out, "log.txt"), "a") as f:
            result = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        seconds = time.perf_counter() - started
        log["process_seconds"] += seconds
        # The machine's 1-minute load average around the run: other jobs slow it down.
        log["invocations"].append({"seconds": seconds, "load_before": load,
                                   "load_after": os.getloadavg()[0],
                                   "returncode": result.returncode})
        with open(log_path, "w") as f:
            json.dump(log, f)
        if result.returncode:
            raise SystemExit(f"batch {batch}: the command failed ({result.returncode}); "
                             f"see {out}/log.txt")
        history = _history(out)
    else:
        print(f"batch {batch}: reusing {out} (step {history[-1]['step']})", flush=True)
    history = [h for h in history if h["step"] <= args.steps]
    return {"batch": batch, "command": "python " + " ".join(command(args, batch)),
            "metrics": history, **log}


def _at(history: list[dict[str, Any]], step: int) -> dict[str, Any] | None:
    return next((h for h in history if h["step"] == step), None)


def summarize(entry: dict[str, Any]) -> dict[str, Any]:
    """Per run: seconds per update, the first evaluation reaching the accuracy target, finals."""
    h = entry["metrics"]
    steps = np.array([r["step"] for r in h], float)
    seconds = np.array([r["train_seconds"] for r in h], float)
    # Intervals after the first (which lacks the graph-building first step).
    per_update = np.diff(seconds) / np.diff(steps) if len(h) > 1 else np.array([np.nan])
    reached = next((r for r in h if r["class_accuracy"] >= ACCURACY_TARGET), None)
    best = min(h, key=lambda r: r["fid"])
    return {
        "batch": entry["batch"],
        "seconds_per_update": float(np.median(per_update)),
        "reached_step": reached["step"] if reached else None,
        "reached_seconds": reached["train_seconds"] if reached else None,
        "final": h[-1],
        "best_fid": best["fid"], "best_fid_step": best["step"],
        "process_seconds": entry.get("process_seconds"),
    }


def table(doc: dict[str, Any], at_steps: list[int]) -> str:
    """The Markdown table: one row per batch size."""
    s = doc["settings"]
    lines = [
        f"SN-GAN `small16` on digits, {s['replicas']} simulated replicas, n_dis {s['n_dis']}, "
        f"Adam({s['learning_rate']:g}, 0, 0.9), no EMA, {s['steps']} generator updates; "
        f"FID on the digits classifier's features and class accuracy of {s['eval_samples']} "
        "held-out samples.",
        "",
        "| global batch | " + " | ".join(f"FID / acc. @{k}" for k in at_steps)
        + f" | best FID (@update) | updates to acc. {ACCURACY_TARGET:g} "
        f"| training s to acc. {ACCURACY_TARGET:g} | training s per update | training s, total "
        "| run's wall s |",
        "|---:|" + "---:|" * (len(at_steps) + 6),
    ]
    for entry in doc["runs"]:
        m = summarize(entry)
        cells = []
        for k in at_steps:
            r = _at(entry["metrics"], k)
            cells.append(f"{r['fid']:.1f} / {r['class_accuracy']:.2f}" if r else "-")
        reached = (f"{m['reached_step']}", f"{m['reached_seconds']:.0f}") if m["reached_step"] \
            else ("not reached", "-")
        wall = f"{m['process_seconds']:.0f}" if m["process_seconds"] else "-"
        lines.append(
            f"| {entry['batch']} | " + " | ".join(cells)
            + f" | {m['best_fid']:.1f} (@{m['best_fid_step']}) | {reached[0]} | {reached[1]} "
            f"| {m['seconds_per_update']:.3f} | {m['final']['train_seconds']:.0f} | {wall} |")
    lines += [
        "",
        "Training s: time in training steps (`train_seconds` of `metrics.json`), without the "
        "evaluations, checkpoints and the graph-building first step; per update: the median over "
        "evaluation intervals. Run's wall s: the whole command (classifier, graph building, "
        "evaluations, checkpoints).",
    ]
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: str) -> None:
    """FID and class accuracy against generator updates and against training time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharey="row")
    s = doc["settings"]
    fig.suptitle(f"SN-GAN small16 on digits, {s['replicas']} simulated replicas on "
                 f"{doc['environment']['cpu_count']} CPU cores: global batch size")
    for entry in doc["runs"]:
        h = entry["metrics"]
        steps = [r["step"] for r in h]
        seconds = [r["train_seconds"] for r in h]
        for row, key in enumerate(("fid", "class_accuracy")):
            values = [r[key] for r in h]
            axes[row][0].plot(steps, values, marker="o", ms=3, label=f"batch {entry['batch']}")
            axes[row][1].plot(seconds, values, marker="o", ms=3, label=f"batch {entry['batch']}")
    for col, xlabel in enumerate(("generator updates", "training seconds (this machine)")):
        axes[0][col].set_yscale("log")
        axes[0][col].yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        axes[0][col].yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        axes[1][col].axhline(ACCURACY_TARGET, color="grey", lw=0.8, ls=":")
        axes[1][col].set_xlabel(xlabel)
        for row in range(2):
            axes[row][col].grid(alpha=0.3)
    axes[0][0].set_ylabel("FID (digits classifier features; lower is better)")
    axes[1][0].set_ylabel("class accuracy of samples")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write(doc: dict[str, Any], results: str) -> list[str]:
    """Writes the JSON, the Markdown table and the plot; returns their paths."""
    os.makedirs(results, exist_ok=True)
    s = doc["settings"]
    candidates = [2 * s["eval_every"], s["steps"] // 2, s["steps"]]
    at_steps = sorted({k - k % s["eval_every"] for k in candidates if k >= s["eval_every"]})
    paths = [os.path.join(results, f"{NAME}.{ext}") for ext in ("json", "md", "png")]
    with open(paths[0], "w") as f:
        json.dump(doc, f, indent=1)
    with open(paths[1], "w") as f:
        f.write(table(doc, at_steps) + "\n")
    plot(doc, paths[2])
    if os.path.abspath(results) == RESULTS:
        shutil.copy(paths[2], os.path.join(ROOT, "docs", "assets", f"{NAME}.png"))
    return paths


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sngan_batch_size",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "runs", NAME),
                   help="the runs' directory (reused and resumed)")
    p.add_argument("--results", default=RESULTS, help="where the JSON, table and plot go")
    p.add_argument("--batch-sizes", type=_positive_int, nargs="+", default=[32, 128, 256])
    p.add_argument("--steps", type=_positive_int, default=600,
                   help="generator updates of every run")
    p.add_argument("--eval-every", type=_positive_int, default=50)
    p.add_argument("--eval-samples", type=_positive_int, default=1000)
    p.add_argument("--replicas", type=_positive_int, default=4)
    p.add_argument("--n-dis", type=_positive_int, default=1)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    for b in args.batch_sizes:
        if b % args.replicas:
            parser.error(f"--batch-sizes {b} is not divisible by --replicas {args.replicas}")
    runs = [run(args, b) for b in args.batch_sizes]
    doc = {
        "settings": {k: getattr(args, k) for k in (
            "steps", "eval_every", "eval_samples", "replicas", "n_dis", "learning_rate", "seed")}
        | {"config": "small16", "dataset": "digits", "ema": None},
        "environment": {"cpu_count": os.cpu_count(), "python": sys.version.split()[0]},
        "runs": runs,
    }
    for path in write(doc, args.results):
        print("wrote", os.path.relpath(path, ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
