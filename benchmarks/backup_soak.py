"""Crash-consistent backups under fire: random SIGKILLs, each followed by a restart; and what the commit costs.

    python -m benchmarks.backup_soak [--kills 50] [--seed 0] [--json benchmarks/results/backup_soak.json]
    python -m benchmarks.backup_soak --cost [--megabytes 200] [--repeats 5]

The soak: a `fit` under `kr.ReplicatorStrategy()` on 2 simulated CPU devices, a
5.2M-parameter MLP with Adam (a 63 MB backup), 40 short epochs, with
``keras.callbacks.BackupAndRestore`` (epoch backups), run in a fresh process. The
parent first runs it uninterrupted (the reference weights, the time to the first
step and the run's length), then starts it again and again, each time SIGKILLing
the whole process group after a delay drawn uniformly between the first step and
the end of the run, and restarting it with the same command, until ``--kills``
kills landed; then the last start runs to the end. A restart fails if it exits
with anything but 0 or the kill. The job logs each step and each committed backup
with its time, so each kill is classed: during a save (after an epoch's last step,
before its backup was committed), or during training. At the end: the restarts
that failed (the target: 0), the gap of the final weights to the uninterrupted
run's (the target: 1e-6), the kill times.

``--cost``: the save and restore time of a ~``--megabytes`` MB backup (a model whose
weights and Adam state make that size), with the commit (keras_replicator's: a new
folder, fsync, rename, pointer) and without it (Keras 3.15's own ``_save_model``,
in place, no fsync; and the same followed by an fsync of its file), taking turns, median of
``--repeats``; and the restore of the committed backup (the CRC-32 check and the load)
against Keras's load of the in-place one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPOCHS, STEPS, BATCH, FEATURES = 40, 4, 64, 256


def _model(keras, width: int = 2048, features: int = FEATURES):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((features,)), keras.layers.Dense(width, "relu"),
                              keras.layers.Dense(width, "relu"), keras.layers.Dense(features, "relu"),
                              keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(1e-4), "mse")
    return model


def job(out_dir: str) -> None:
    """The training run the soak kills (one process, 2 replicas)."""
    import keras_replicator as kr

    kr.simulate_devices(2)
    strategy = kr.ReplicatorStrategy()
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * BATCH, FEATURES)).astype("float32")
    y = rng.normal(size=(STEPS * BATCH, 1)).astype("float32")
    with strategy.scope():
        model = _model(keras)
    events = open(os.path.join(out_dir, "events.jsonl"), "a")

    def log(*event):
        events.write(json.dumps([*event, time.time()]) + "\n")
        events.flush()

    log("start")
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: log("step", batch),
        on_epoch_end=lambda epoch, logs: log("committed", epoch),  # runs after BackupAndRestore's save
    )
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=[keras.callbacks.BackupAndRestore(os.path.join(out_dir, "backup")), record])
    np.savez(os.path.join(out_dir, "weights.npz"), *model.get_weights())
    log("finished")


def _start(out_dir: str) -> subprocess.Popen:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
    env.pop("KERAS_REPLICATOR_KILL_AT_SAVE", None)
    return subprocess.Popen([sys.executable, "-m", "benchmarks.backup_soak", "--job", out_dir], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _events(out_dir: str) -> list[list]:
    path = os.path.join(out_dir, "events.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _kill_after(process, out_dir: str, begun: float, delay: float, after_first_step: bool) -> bool:
    """SIGKILLs `process`'s group `delay` s after its start (or after its first step); False if it
    ended first."""
    start = begun
    while after_first_step:
        if process.poll() is not None:
            return False
        steps = [e for e in _events(out_dir) if e[0] == "step" and e[-1] >= begun]
        if steps:
            start = steps[0][-1]
            break
        time.sleep(0.02)
    while time.time() < start + delay:
        if process.poll() is not None:
            return False
        time.sleep(0.01)
    if process.poll() is not None:
        return False
    _kill_group(process)
    return True


def _check_weights(out_dir: str, reference, landed) -> float:
    import numpy as np

    with np.load(os.path.join(out_dir, "weights.npz")) as f:
        gap = max(float(np.max(np.abs(a - b))) for a, b in zip([f[k] for k in f.files], reference))
    print(f"final weights: gap {gap:.2g} to the uninterrupted run's", flush=True)
    return gap


def _classify(events: list[list], since: float, at: float) -> str:
    """Where a kill at `at` landed: in a save (after an epoch's last step, before its commit), else training."""
    last = [e for e in events if since <= e[-1] <= at]
    if not last or last[-1][0] == "start":
        return "before the first step"
    if last[-1][0] == "step" and last[-1][1] == STEPS - 1:
        return "during a save"
    return "during training"


def soak(kills: int, seed: int) -> dict:
    import numpy as np

    rng = random.Random(seed)
    reference_dir = tempfile.mkdtemp(prefix="soak_reference_")
    started = time.time()
    run = _start(reference_dir)
    output, _ = run.communicate()
    assert run.returncode == 0, output[-3000:]
    events = _events(reference_dir)
    first_step = next(e[-1] for e in events if e[0] == "step") - started
    length = events[-1][-1] - started
    print(f"uninterrupted: first step after {first_step:.1f} s, finished after {length:.1f} s", flush=True)
    with np.load(os.path.join(reference_dir, "weights.npz")) as f:
        reference = [f[k] for k in f.files]

    out_dir = tempfile.mkdtemp(prefix="soak_")
    # Each kill lands at a random moment of the start's training (after its first step: the
    # run then progresses by about half a window per start, so the kills spread over the whole
    # run) or, one in five, of its start-up and restore (before the first step).
    window = (length - first_step) * 1.2 / kills
    landed, failed, gaps, starts = [], [], [], 0
    while True:
        starts += 1
        begun = time.time()
        process = _start(out_dir)
        killed = False
        if len(landed) < kills:
            early = rng.random() < 0.2
            delay = rng.uniform(0, first_step) if early else rng.uniform(0, window)
            killed = _kill_after(process, out_dir, begun, delay, after_first_step=not early)
        if killed:
            at = time.time()
            where = _classify(_events(out_dir), begun, at)
            landed.append({"start": starts, "after_s": round(at - begun, 2), "where": where})
            print(f"kill {len(landed)}: {at - begun:.1f} s after start {starts}, {where}", flush=True)
            continue
        output, _ = process.communicate()
        _kill_group(process)
        if process.returncode != 0:
            failed.append({"start": starts, "code": process.returncode, "tail": output[-2000:]})
            print(f"start {starts} FAILED with {process.returncode}:\n{output[-2000:]}", flush=True)
            if len(failed) >= 3:
                break
            continue
        if len(landed) < kills:  # finished before every kill landed: a new run in a new folder
            print(f"run finished after {len(landed)} kills; starting another run", flush=True)
            gaps.append(_check_weights(out_dir, reference, landed))
            out_dir = tempfile.mkdtemp(prefix="soak_")
            continue
        break
    finished = os.path.exists(os.path.join(out_dir, "weights.npz"))
    if finished:
        gaps.append(_check_weights(out_dir, reference, landed))
    where = {w: sum(k["where"] == w for k in landed) for w in sorted({k["where"] for k in landed})}
    return {"kills": len(landed), "starts": starts, "failed_restarts": len(failed), "finished": finished,
            "runs_finished": len(gaps), "max_gap_to_uninterrupted": max(gaps) if gaps else None, "kills_by_moment": where, "kill_times": landed, "failures": failed,
            "uninterrupted_seconds": round(length, 1), "first_step_seconds": round(first_step, 1)}


def cost(megabytes: float, repeats: int) -> dict:
    """Save and restore times of a ~`megabytes` MB backup, with and without the commit."""
    import keras_replicator as kr

    kr.simulate_devices(2)
    strategy = kr.ReplicatorStrategy()
    import keras
    import numpy as np
    from keras.src.callbacks import backup_and_restore

    from keras_replicator import atomic_files
    from keras_replicator._compat import keras_checkpointing

    stock_save = next(p for p in keras_checkpointing.PATCHES
                      if p.owner is backup_and_restore.BackupAndRestore and p.name == "_save_model").original
    # Adam: 3 floats (12 bytes) per weight; the one square hidden layer (width x width) holds most.
    width = int((megabytes * 1e6 / 12) ** 0.5)
    with strategy.scope():
        model = _model(keras, width=width, features=64)
    x = np.ones((BATCH, 64), "float32")
    y = np.ones((BATCH, 1), "float32")
    folder = tempfile.mkdtemp(prefix="backup_cost_")
    times: dict[str, list[float]] = {"save, committed": [], "save, Keras in place": [],
                                     "save, Keras in place + fsync": [],
                                     "restore, committed": [], "restore, Keras in place": []}

    class Timed(keras.callbacks.BackupAndRestore):
        def _save_model(self):
            started = time.monotonic()
            super()._save_model()  # keras_replicator's commit
            times["save, committed"].append(time.monotonic() - started)
            paths = {a: getattr(self, a) for a in keras_checkpointing._BR_PATHS}
            self.backup_dir = os.path.join(folder, "in_place")
            self._weights_path = os.path.join(self.backup_dir, "latest.weights.h5")
            self._training_metadata_path = os.path.join(self.backup_dir, "training_metadata.json")
            started = time.monotonic()
            with keras_checkpointing._plain_saves():
                stock_save(self)
            times["save, Keras in place"].append(time.monotonic() - started)
            # What the same file costs once on the disk (the commit fsyncs; Keras never does, and
            # its next save truncates the file, so in this loop its data may never be written).
            atomic_files.fsync_path(self._weights_path)
            times["save, Keras in place + fsync"].append(time.monotonic() - started)
            for a, path in paths.items():
                setattr(self, a, path)

    backup = Timed(os.path.join(folder, "committed"), delete_checkpoint=False)
    model.fit(x, y, batch_size=BATCH, epochs=repeats, verbose=0, callbacks=[backup])
    size = os.path.getsize(os.path.join(folder, "in_place", "latest.weights.h5"))
    for _ in range(repeats):
        started = time.monotonic()
        keras_checkpointing._restore(backup, strategy)
        times["restore, committed"].append(time.monotonic() - started)
        backup._weights_path = os.path.join(folder, "in_place", "latest.weights.h5")
        backup._training_metadata_path = os.path.join(folder, "in_place", "training_metadata.json")
        started = time.monotonic()
        backup._load_model()
        times["restore, Keras in place"].append(time.monotonic() - started)
    medians = {k: round(statistics.median(v), 3) for k, v in times.items()}
    return {"backup_bytes": size, "repeats": repeats, "median_seconds": medians,
            "all_seconds": {k: [round(t, 3) for t in v] for k, v in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", metavar="OUT_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cost", action="store_true")
    parser.add_argument("--megabytes", type=float, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.job:
        job(args.job)
        return
    result = cost(args.megabytes, args.repeats) if args.cost else soak(args.kills, args.seed)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
