"""``python -m benchmarks``: the command line, the run, and its output files (JSON, Markdown, PNG).

Every configuration runs in a fresh interpreter (``python -m benchmarks.worker``)
because the number of simulated CPU devices is fixed when TensorFlow starts.

The training configurations that are compared with each other (one device,
stock and ours on the same devices; the two batch norms; ``steps_per_execution``
1 and 8) form a *group*: their processes start together, warm up (trace,
compile) side by side, and then take turns: one timed window each, in
alternating order, while the others wait. Every comparison in the tables is
thus between windows measured within seconds of each other, so that the
machine's drift (other tenants of a shared machine, thermal state) hits both
sides alike; and tracing, which runs on one core, overlaps across the group.

Other configurations run one at a time. A round runs every group once; odd
rounds run the plan in reverse order. A configuration's figure is the median of
all its windows over all rounds. Round 1 has a time limit: each group stops
timing windows at its deadline (``rounds.group_deadline``), down to half of them.

Modules: ``plan`` (the configurations), ``rounds`` (running them),
``processes`` (the worker processes), ``results`` (the JSON), ``tables`` and
``plot`` (the Markdown and the PNG, from the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from typing import Any

from benchmarks.models import GAN_MODELS
from benchmarks.plan import Settings, plan
from benchmarks.plot import plot
from benchmarks.processes import run_worker
from benchmarks.protocol import ROOT
from benchmarks.results import collect, invalid_figures
from benchmarks.rounds import execute
from benchmarks.tables import markdown
from benchmarks.targets import summary

DEFAULT_OUTPUT_DIR = os.path.join(ROOT, "benchmarks", "results")
DOCS_PLOT = os.path.join(ROOT, "docs", "assets", "benchmarks.png")
JSON_NAME, TABLE_NAME, PLOT_NAME = "benchmarks.json", "benchmarks.md", "benchmarks.png"


def write_outputs(doc: dict[str, Any], output_dir: str, publish_docs: bool) -> list[str]:
    """Writes the JSON, the Markdown table and the PNG plot; returns their paths."""
    os.makedirs(output_dir, exist_ok=True)
    json_path = os.path.join(output_dir, JSON_NAME)
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=2, sort_keys=False)
        f.write("\n")
    table_path = os.path.join(output_dir, TABLE_NAME)
    with open(table_path, "w") as f:
        f.write(markdown(doc))
    plot_path = os.path.join(output_dir, PLOT_NAME)
    plot(doc, plot_path)
    paths = [json_path, table_path, plot_path]
    if publish_docs:
        os.makedirs(os.path.dirname(DOCS_PLOT), exist_ok=True)
        shutil.copyfile(plot_path, DOCS_PLOT)
        paths.append(DOCS_PLOT)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="keras_replicator against stock TensorFlow, side by side in one run.")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run (about a minute): 2 devices, small CNN, 1 round")
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR,
                        help="where to write benchmarks.json/.md/.png (default: benchmarks/results; "
                             "writing there also copies the plot to docs/assets/)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved rounds of the small configurations (default 1)")
    parser.add_argument("--resnet-rounds", type=int, default=None,
                        help="rounds of the ResNet-50 configurations (default 1)")
    parser.add_argument("--devices", type=int, nargs="+", default=None, metavar="K",
                        help="simulated CPU device counts to compare (default 2 4; quick 2)")
    parser.add_argument("--models", nargs="+", default=None,
                        choices=("cnn", "resnet50") + GAN_MODELS,
                        help="training models (default cnn resnet50 sngan; quick cnn); "
                             "sngan runs on the largest device count only")
    parser.add_argument("--sections", nargs="+", default=None, metavar="SECTION",
                        help="run only these sections of the plan, e.g. training (default all)")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="per-process time limit (default 900; quick 300)")
    parser.add_argument("--replot", action="store_true",
                        help="only rebuild the table and plot from the existing JSON")
    args = parser.parse_args(argv)
    output_dir = os.path.abspath(args.output_dir)
    publish = output_dir == os.path.abspath(DEFAULT_OUTPUT_DIR)
    if args.replot:
        with open(os.path.join(output_dir, JSON_NAME)) as f:
            doc = json.load(f)
        for path in write_outputs(doc, output_dir, publish):
            print("wrote", os.path.relpath(path, ROOT))
        return 0

    started = time.time()
    settings = Settings.for_mode(args.quick, args.rounds, args.resnet_rounds,
                                 tuple(args.devices) if args.devices else None,
                                 tuple(args.models) if args.models else None)
    if args.timeout:
        settings.timeout = args.timeout
    settings.sections = tuple(args.sections or ())
    print(f"benchmarks ({'quick' if args.quick else 'full'} mode): environment ...", flush=True)
    env = run_worker({"kind": "env"}, settings.timeout)
    env.pop("wall_seconds", None)
    configs = plan(settings, env)
    if args.sections:
        configs = [c for c in configs if c.section in args.sections]
    print(f"{len(configs)} configurations, up to "
          f"{max(c.rounds for c in configs)} interleaved round(s)", flush=True)
    execute(configs, settings, log=lambda msg: print(msg, flush=True))
    doc = collect(configs, settings, env, started, time.time() - started)
    for path in write_outputs(doc, output_dir, publish):
        print("wrote", os.path.relpath(path, ROOT) if path.startswith(ROOT) else path)
    print(summary(doc))
    print(f"total {doc['wall_seconds'] / 60:.1f} min")
    bad = invalid_figures(doc)
    if doc["failures"] or bad:
        for failure in doc["failures"]:
            print(f"FAILED {failure['config']}: {failure['error'].splitlines()[0]}",
                  file=sys.stderr)
        for name in bad:
            print(f"not a positive finite figure: {name}", file=sys.stderr)
        return 1
    return 0
