"""Ours against stock `MirroredStrategy` and Keras on JAX, on the same simulated devices.

``python -m benchmarks.peers [--rounds 3] [--devices 1 2 4] [--stacks ours stock jax]``
(``make bench-peers`` creates the JAX venv first).

Every run is a fresh process (``benchmarks.peers_worker``): one stack, one workload, one device
count; ``fit`` for one warm-up epoch, then the timed epochs. Within a round the stacks take
turns at each (workload, device count), their order rotating from round to round, so that the
drift of a shared machine hits them alike; the tables give medians over the rounds.

* ours: ``kr.simulate_devices(n)`` and ``ReplicatorStrategy()``; ``lm_mp`` through
  ``keras.distribution.set_distribution(ModelParallel(layout_map=...))``;
* stock: ``MirroredStrategy`` on n logical CPUs (keras_replicator not imported);
* jax: Keras on JAX (``KERAS_BACKEND=jax``, ``XLA_FLAGS=--xla_force_host_platform_device_count=n``),
  ``DataParallel`` or ``ModelParallel`` with the same ``LayoutMap``. Its interpreter is
  ``--jax-python`` (default ``.venvs/jax/bin/python``: JAX, the same Keras version, NumPy);
  without it the JAX rows are skipped and the outputs say why.

Reported per row: the first step (``fit``'s call to its first batch's end: tracing, compiling
and the step), steady examples/s over the timed epochs, and whether the stack's weights at n
devices equal its own at one device after the same training (``lm_mp`` is compared with the
stack's ``lm`` at one device): the largest absolute difference, "equal" within 1e-4.
Writes ``peers.json`` and ``peers.md`` to ``--output-dir`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.machine import onednn_setting

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTPUT_DIR = os.path.join(ROOT, "benchmarks", "results")
JAX_PYTHON = os.path.join(ROOT, ".venvs", "jax", "bin", "python")
STACKS = ("ours", "stock", "jax")
WORKLOADS = ("cnn", "lm", "lm_mp")
TOLERANCE = 1e-4


def runs_of_round(round_index: int, stacks, workloads, device_counts) -> list[dict]:
    """The runs of one round: at each (workload, devices) every stack, the order rotated by round."""
    runs = []
    for workload in workloads:
        for n in device_counts:
            if workload == "lm_mp" and n < 2:
                continue  # a (1, 1) mesh is the one-device LM
            here = [s for s in stacks if not (workload == "lm_mp" and s == "stock")]
            shift = round_index % len(here) if here else 0
            for stack in here[shift:] + here[:shift]:
                runs.append({"stack": stack, "workload": workload, "devices": n})
    return runs


def _environment(stack: str, devices: int) -> dict[str, str]:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": ROOT}
    env.pop("KR_TEST_DEVICES", None)
    if stack == "jax":
        env.update(KERAS_BACKEND="jax", JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    else:
        env.update(KERAS_BACKEND="tensorflow")
    return env


def run_one(spec: dict, python: str, timeout: float) -> dict:
    """One fresh worker process; its result, or ``{"error": ...}``."""
    started = time.time()
    load = os.getloadavg()[0]
    try:
        done = subprocess.run([python, "-m", "benchmarks.peers_worker", json.dumps(spec)],
                              capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env=_environment(spec["stack"], spec["devices"]))
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "load_average": load}
    lines = [line for line in done.stdout.splitlines() if line.startswith("PEERS_RESULT ")]
    if done.returncode != 0 or not lines:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:300],
                "load_average": load}
    return {**json.loads(lines[-1][len("PEERS_RESULT "):]), "load_average": load,
            "wall_s": time.time() - started}


def _difference(path_n: str, path_1: str) -> float | None:
    import numpy as np

    if not (os.path.exists(path_n) and os.path.exists(path_1)):
        return None
    a, b = np.load(path_n), np.load(path_1)
    return float(np.max(np.abs(a - b))) if a.shape == b.shape else float("inf")


def measure(stacks, workloads, device_counts, rounds: int, size: str, epochs: int,
            jax_python: str, timeout: float, log=print) -> dict:
    """Every run of every round; the stacks without an interpreter are skipped, with the reason."""
    skipped = {}
    if "jax" in stacks and not os.path.exists(jax_python):
        skipped["jax"] = f"no JAX venv at {os.path.relpath(jax_python, ROOT)} (make bench-peers makes it)"
        stacks = [s for s in stacks if s != "jax"]
    records = []
    with tempfile.TemporaryDirectory(prefix="kr-peers-") as folder:
        for r in range(rounds):
            for run in runs_of_round(r, stacks, workloads, device_counts):
                name = f"{run['stack']}-{run['workload']}-{run['devices']}-r{r}"
                spec = {**run, "size": size, "warmup_epochs": 1, "epochs": epochs,
                        "weights_path": os.path.join(folder, name + ".npy")}
                python = jax_python if run["stack"] == "jax" else sys.executable
                result = run_one(spec, python, timeout)
                reference = os.path.join(folder, f"{run['stack']}-lm-1-r{r}.npy"
                                         if run["workload"] == "lm_mp"
                                         else f"{run['stack']}-{run['workload']}-1-r{r}.npy")
                if "error" not in result:
                    result["weights_max_difference"] = _difference(spec["weights_path"], reference)
                records.append({**run, "round": r, **result})
                log(f"peers: {name}: " + (result.get("error") or
                    f"first step {result['first_step_s']:.2f} s, "
                    f"{result['steady_examples_per_s']:.1f} examples/s, load {result['load_average']:.1f}"))
    return {"records": records, "skipped": skipped,
            "settings": {"stacks": list(stacks), "workloads": list(workloads),
                         "devices": list(device_counts), "rounds": rounds, "size": size,
                         "warmup_epochs": 1, "epochs": epochs, "tolerance": TOLERANCE}}


def summarize(records: list[dict]) -> list[dict]:
    """Medians per (workload, devices, stack) over the rounds, and the weights' verdict."""
    rows: dict[tuple, list[dict]] = {}
    for rec in records:
        rows.setdefault((rec["workload"], rec["devices"], rec["stack"]), []).append(rec)
    out = []
    for (workload, n, stack), recs in rows.items():
        good = [r for r in recs if "error" not in r]
        diffs = [r["weights_max_difference"] for r in good if r.get("weights_max_difference") is not None]
        row = {"workload": workload, "devices": n, "stack": stack, "runs": len(good),
               "errors": [r["error"] for r in recs if "error" in r]}
        if good:
            row.update(first_step_s=statistics.median(r["first_step_s"] for r in good),
                       steady_examples_per_s=statistics.median(r["steady_examples_per_s"] for r in good),
                       load_average=statistics.median(r["load_average"] for r in good))
        if diffs:
            row["weights_max_difference"] = max(diffs)
            row["weights_equal_to_one_device"] = max(diffs) <= TOLERANCE
        out.append(row)
    return out


def _cell(row: dict | None, key: str, fmt: str) -> str:
    if row is None:
        return "-"
    if key not in row:
        return "error" if row["errors"] else "-"
    return format(row[key], fmt)


def _weights(row: dict | None) -> str:
    if row is None or "weights_max_difference" not in row:
        return "-"
    verdict = "yes" if row["weights_equal_to_one_device"] else "no"
    return f"{verdict} ({row['weights_max_difference']:.1e})"


def table(summary: list[dict], stacks, skipped: dict) -> str:
    """The Markdown table: per workload and device count, each stack's figures, ours / JAX."""
    by = {(r["workload"], r["devices"], r["stack"]): r for r in summary}
    keys = sorted({(r["workload"], r["devices"]) for r in summary},
                  key=lambda k: (WORKLOADS.index(k[0]), k[1]))
    shown = [s for s in STACKS if s in stacks or s in skipped]
    head = ["workload", "devices"]
    for title in ("steady examples/s", "first step (s)", "weights at n = at 1 (max diff)"):
        head += [f"{title}: {s}" for s in shown]
    head += ["steady ours / jax", "first step ours / jax"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for workload, n in keys:
        rows = {s: by.get((workload, n, s)) for s in shown}
        cells = [workload, str(n)]
        cells += [_cell(rows[s], "steady_examples_per_s", ".1f") for s in shown]
        cells += [_cell(rows[s], "first_step_s", ".2f") for s in shown]
        cells += [_weights(rows[s]) for s in shown]
        ours, jax = rows.get("ours"), rows.get("jax")
        for key in ("steady_examples_per_s", "first_step_s"):
            ok = ours and jax and key in ours and key in jax
            cells.append(f"{ours[key] / jax[key]:.2f}x" if ok else "-")
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"- {stack}: skipped, {why}." for stack, why in skipped.items()]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def write(result: dict, output_dir: str) -> tuple[str, str]:
    """peers.json and peers.md in ``output_dir``."""
    os.makedirs(output_dir, exist_ok=True)
    summary = summarize(result["records"])
    result = {**result, "summary": summary}
    json_path, md_path = os.path.join(output_dir, "peers.json"), os.path.join(output_dir, "peers.md")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    s = result["settings"]
    loads = [r["load_average"] for r in result["records"] if "load_average" in r]
    onednn = sorted({"on" if r["onednn"] else "off" for r in result["records"] if "onednn" in r})
    header = (f"Ours, stock `MirroredStrategy` and Keras on JAX on the same simulated CPU devices: "
              f"{s['rounds']} round(s), sizes `{s['size']}`, each run a fresh process: `fit` for "
              f"{s['warmup_epochs']} warm-up epoch then {s['epochs']} timed; medians over the rounds. "
              f"Load average (1 min) at the runs' starts: {min(loads, default=0):.1f}-"
              f"{max(loads, default=0):.1f}. TensorFlow's stacks: {onednn_setting()}; oneDNN "
              f"{' and '.join(onednn) or 'not reported'} in ours' runs. Written by `python -m benchmarks.peers` on "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.\n\n")
    with open(md_path, "w") as f:
        f.write(header + table(summary, s["stacks"], result["skipped"]))
    return json_path, md_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--stacks", nargs="+", choices=STACKS, default=list(STACKS))
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--size", choices=("full", "tiny"), default="full")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs after the warm-up one")
    parser.add_argument("--jax-python", default=JAX_PYTHON)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--output-dir", default=OUTPUT_DIR)
    args = parser.parse_args(argv)
    result = measure(args.stacks, args.workloads, sorted(set(args.devices)), args.rounds, args.size,
                     args.epochs, args.jax_python, args.timeout)
    for path in write(result, args.output_dir):
        print("peers: wrote", os.path.relpath(path, ROOT))
    return 0 if all("error" not in r for r in result["records"]) else 1


if __name__ == "__main__":
    sys.exit(main())
