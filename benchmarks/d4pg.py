"""D4PG throughput (tutorial 3): actor environment steps/s with 1, 2 and 4 Ray actors, and
learner updates/s on 1 device and 2 and 4 simulated replicas, measured in one run.

Run ``python -m benchmarks.d4pg`` (``make bench-d4pg``; about 4 minutes on 2 cores). With
``--pendulum-seeds 0 1 2 3 4`` it measures learning instead: one run of the default Pendulum-v1
command per seed, one after the other, each scored on its 100-episode held-out evaluation, with its
wall time and the machine's load average (``results/d4pg_pendulum_runs.{json,md}``). Actors:
each configuration starts a local Ray instance on 127.0.0.1, keeps every actor busy with
`run` calls of 50 Pendulum-v1 steps (the full-size policy, evaluated with NumPy) for a timed
window after a warm-up, and counts the steps returned. Learner: each replica count runs in its
own interpreter (the number of simulated devices is fixed when TensorFlow starts), trains
`D4PGLearner` (Acme's network sizes, global batch 256) by `model.fit` on a repeated in-memory
batch, and reports the median of timed windows after a warm-up. The configurations take turns
window by window (learner) so that a shared machine's drift hits them alike.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

LEARNER_CODE = r"""
import json, os, sys, time
import numpy as np
import keras_replicator as kr
replicas = int(sys.argv[1]); windows = int(sys.argv[2]); steps = int(sys.argv[3])
# reference > 1: the replica-work reference of that many replicas: one device running
# `reference` updates at 256 / reference per update of the others (steps_per_execution).
reference = int(sys.argv[4])
kr.simulate_devices(replicas)
import keras, tensorflow as tf
from keras_replicator.applications import d4pg
strategy = kr.ReplicatorStrategy()
with strategy.scope():
    keras.utils.set_random_seed(0)
    learner = d4pg.D4PGLearner.create(3, [-2.0], [2.0])
    learner.compile(steps_per_execution=reference)
rng = np.random.default_rng(0)
b = 256 // reference
batch = {"observation": rng.normal(size=(b, 3)).astype("f4"),
         "action": rng.uniform(-2, 2, size=(b, 1)).astype("f4"),
         "reward": rng.normal(size=b).astype("f4"), "discount": np.full(b, 0.95, "f4"),
         "next_observation": rng.normal(size=(b, 3)).astype("f4")}
ds = strategy.distribute_dataset(tf.data.Dataset.from_tensors(batch).repeat().unbatch(),
                                 global_batch_size=b)
learner.fit(ds, epochs=1, steps_per_epoch=10 * reference, verbose=0)
print("READY", flush=True)
for _ in range(windows):
    sys.stdin.readline()
    t = time.perf_counter()
    learner.fit(ds, epochs=1, steps_per_epoch=steps * reference, verbose=0)
    print("WINDOW", steps / (time.perf_counter() - t), flush=True)
"""


def learner_throughput(replica_counts=(1, 2, 4), windows=5, steps=30) -> dict:
    """Median updates/s per replica count, and of each count's replica-work reference
    (key ``"reference K"``: one device doing K replicas' work, K updates at 256 / K per
    update); all the processes take turns window by window."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    procs = {}
    configs = [(k, k, 1) for k in replica_counts] + [
        (f"reference {k}", 1, k) for k in replica_counts if k > 1]
    for key, k, reference in configs:
        procs[key] = subprocess.Popen(
            [sys.executable, "-c", LEARNER_CODE, str(k), str(windows), str(steps), str(reference)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    for p in procs.values():
        while (line := p.stdout.readline()) and not line.startswith("READY"):
            pass
    rates = {key: [] for key in procs}
    for _ in range(windows):
        for k, p in procs.items():
            p.stdin.write("\n")
            p.stdin.flush()
            while (line := p.stdout.readline()) and not line.startswith("WINDOW"):
                pass
            rates[k].append(float(line.split()[1]))
    for p in procs.values():
        p.stdin.close()
        p.wait(timeout=120)
    return {k: float(np.median(v)) for k, v in rates.items()}


def actor_throughput(actor_counts=(1, 2, 4), seconds=10.0, steps_per_call=50) -> dict:
    """Environment steps/s of all actors together, for each actor count."""
    from keras_replicator.applications import d4pg
    from keras_replicator.applications.d4pg import actors

    weights = d4pg.make_policy(3, [-2.0], [2.0]).get_weights()
    out = {}
    for k in actor_counts:
        ray = actors.start_ray()
        try:
            pool = actors.make_actors("Pendulum-v1", k, seed=0, reward_scale=0.1)
            ref = ray.put(weights)
            ray.get([a.run.remote(ref, steps_per_call) for a in pool])  # warm-up
            pending = {a.run.remote(ref, steps_per_call): a for a in pool}
            steps, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                done, _ = ray.wait(list(pending), num_returns=1)
                for r in done:
                    steps += ray.get(r)[2]
                    actor = pending.pop(r)
                    pending[actor.run.remote(ref, steps_per_call)] = actor
            elapsed = time.perf_counter() - start
            ray.wait(list(pending), num_returns=len(pending), timeout=30)
            out[k] = steps / elapsed
        finally:
            actors.stop_ray()
    return out


def _load_average() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def pendulum_run(seed: int, out_dir: str, flags=()) -> dict:
    """One run of the default command at ``seed`` (one process, its output in ``out_dir``): its
    held-out evaluation (`final_evaluation.json`), wall time, the machine's 1-minute load average
    sampled every 10 s, and whether its log (TensorFlow's warnings on) has tf.data's finalizer
    error at exit."""
    import threading

    loads, stop = [], threading.Event()

    def sample():
        while not stop.is_set():
            loads.append(_load_average())
            stop.wait(10)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    command = [sys.executable, "-m", "keras_replicator.applications.d4pg", "--env", "Pendulum-v1",
               "--out", out_dir, "--seed", str(seed), *flags]
    start = time.monotonic()
    # TensorFlow's warnings shown (the command hides them by default): the finalizer's is one.
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "0"}
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    wall = time.monotonic() - start
    stop.set()
    sampler.join()
    log = result.stdout + result.stderr
    if result.returncode:
        raise RuntimeError(f"seed {seed} failed:\n{log[-3000:]}")
    with open(os.path.join(out_dir, "final_evaluation.json")) as f:
        final = json.load(f)
    with open(os.path.join(out_dir, "returns.csv")) as f:
        curve = [line.strip() for line in f if line.strip()]
    return {"seed": seed, "flags": list(flags), "wall_time_s": wall, "curve_csv": curve,
            "load_average_mean": float(np.mean(loads)), "load_average_max": float(np.max(loads)),
            "finalizer_error": "Error occurred when finalizing" in log,
            **{k: final[k] for k in ("mean", "std", "worst", "episodes", "reset_seeds",
                                     "env_steps", "updates", "updates_per_env_step")}}


def pendulum_runs(seeds, out: str, flags=()) -> list[dict]:
    """`pendulum_run` for each seed, one after the other; writes ``out`` (JSON) and its .md table."""
    import tempfile

    # Checked before the first run (each takes minutes): a missing folder used to lose them all.
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"--out {out!r}: its folder {folder!r} does not exist")
    runs = []
    with tempfile.TemporaryDirectory(prefix="d4pg_runs_") as tmp:
        for seed in seeds:
            runs.append(pendulum_run(seed, os.path.join(tmp, f"seed{seed}"), flags))
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "curve_csv"}), flush=True)
    write_pendulum_runs(runs, out, flags)
    return runs


def write_pendulum_runs(runs: list[dict], out: str, flags=()) -> None:
    """Writes ``out`` (JSON) and its .md table from `pendulum_run`'s records."""
    with open(out, "w") as f:
        json.dump({"flags": list(flags), "cpu_count": os.cpu_count(), "runs": runs}, f, indent=1)
    lines = ["| seed | mean | std | worst | updates per env step | wall time | load average |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['seed']} | {r['mean']:.0f} | {r['std']:.0f} | {r['worst']:.0f} | "
              f"{r['updates_per_env_step']:.3f} | {r['wall_time_s'] / 60:.1f} min | "
              f"{r['load_average_mean']:.1f} (max {r['load_average_max']:.1f}) |" for r in runs]
    means = [r["mean"] for r in runs]
    lines += ["", f"Median of the means {np.median(means):.0f}, worst mean {min(means):.0f}; "
              f"{sum(m >= -200 for m in means)} of {len(means)} runs at -200 or better. Each run: "
              f"`python -m keras_replicator.applications.d4pg --env Pendulum-v1 --seed S"
              f"{' ' + ' '.join(flags) if flags else ''}`, then its `policy.keras` over "
              f"{runs[0]['episodes']} held-out episodes (reset seeds {runs[0]['reset_seeds'][0]}"
              f"..{runs[0]['reset_seeds'][1]})."]
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None,
                   help="results JSON (default: results/d4pg_throughput.json, or "
                        "results/d4pg_pendulum_runs.json with --pendulum-seeds)")
    p.add_argument("--pendulum-seeds", type=int, nargs="+", default=None,
                   help="instead of throughput: one run of the default Pendulum-v1 command per "
                        "seed, each scored on its held-out evaluation")
    p.add_argument("--flags", default="",
                   help="with --pendulum-seeds: extra flags of the command, e.g. "
                        "'--target-update-period 100'")
    args = p.parse_args(argv)
    results = os.path.join(os.path.dirname(__file__), "results")
    if args.pendulum_seeds is not None:
        pendulum_runs(args.pendulum_seeds, args.out or os.path.join(
            results, "d4pg_pendulum_runs.json"), args.flags.split())
        return 0
    args.out = args.out or os.path.join(results, "d4pg_throughput.json")
    t0 = time.time()
    acting = actor_throughput()
    learning = learner_throughput()
    result = {"actor_env_steps_per_s": acting, "learner_updates_per_s": learning,
              "cpu_count": os.cpu_count(), "seconds": time.time() - t0}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    lines = ["| configuration | throughput |", "|---|---|"]
    for k, v in acting.items():
        lines.append(f"| {k} actor{'s' if k > 1 else ''} (Pendulum-v1) | {v:,.0f} env steps/s |")
    for k, v in learning.items():
        if isinstance(k, str):
            continue
        what = "1 device" if k == 1 else f"{k} simulated replicas"
        ref = learning.get(f"reference {k}")
        vs_ref = f", {v / ref:.2f}x its replica-work reference ({ref:.1f} updates/s)" if ref else ""
        lines.append(f"| learner, {what}, global batch 256 | {v:.1f} updates/s "
                     f"({v / learning[1]:.2f}x one device{vs_ref}) |")
    lines.append("")
    lines.append("A replica-work reference of K replicas is one device running K updates at "
                 "batch 256 / K per update (`steps_per_execution=K`): the replicas' work with "
                 "none of replication's costs, taking turns with the others.")
    lines.append("")
    lines.append(f"Measured by `python -m benchmarks.d4pg` in {result['seconds']:.0f} s on "
                 f"{os.cpu_count()} CPU cores.")
    table = "\n".join(lines) + "\n"
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
