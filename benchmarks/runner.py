"""The benchmark plan, its interleaved rounds, and the outputs (JSON, Markdown, PNG).

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
timing windows at its deadline (``_group_deadline``), down to half of them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as _dt
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks import report
from benchmarks.worker import GO, RESULT_PREFIX, ROOT, STOP, TURN

# Training models measured on the largest device count only (one group: one device,
# stock and ours), whose table gives a step time rather than examples/s: a GAN's step
# is one generator update (report.GAN_MODELS names the same).
GAN_MODELS = ("sngan",)

DEFAULT_OUTPUT_DIR = os.path.join(ROOT, "benchmarks", "results")
DOCS_PLOT = os.path.join(ROOT, "docs", "assets", "benchmarks.png")
JSON_NAME, TABLE_NAME, PLOT_NAME = "benchmarks.json", "benchmarks.md", "benchmarks.png"
SIZES_MB = (1, 16, 64)


@dataclass
class Settings:
    """What one run measures, and how long it may take."""

    quick: bool
    device_counts: tuple[int, ...]
    models: tuple[str, ...]
    rounds: int
    resnet_rounds: int
    windows: int
    sizes_mb: tuple[float, ...] = SIZES_MB
    timeout: float = 900.0
    jobs: int = 1
    # Rounds after the first are skipped config by config once this is spent.
    budget_seconds: float = float("inf")
    # Round 1 ends this long after it starts: a group past its deadline
    # (_group_deadline) takes no more windows, down to half its planned number.
    # Warm-ups cannot be cut, so a machine much slower than the one of
    # _EXPECTED_SECONDS can still overrun it.
    deadline_seconds: float = float("inf")
    # Sections asked for by name (--sections): the quick run adds the XLA group only then.
    sections: tuple[str, ...] = ()

    @classmethod
    def for_mode(cls, quick: bool, rounds: int | None = None, resnet_rounds: int | None = None,
                 device_counts: tuple[int, ...] | None = None,
                 models: tuple[str, ...] | None = None) -> Settings:
        if quick:
            return cls(quick=True, device_counts=device_counts or (2,), models=models or ("cnn",),
                       rounds=rounds or 1, resnet_rounds=resnet_rounds or 1, windows=2,
                       sizes_mb=(1, 16), timeout=300.0, jobs=2)
        return cls(quick=False, device_counts=device_counts or (2, 4),
                   models=models or ("cnn", "resnet50", "sngan"), rounds=rounds or 1,
                   resnet_rounds=resnet_rounds or 1, windows=3, budget_seconds=12 * 60.0,
                   deadline_seconds=13.5 * 60.0)


@dataclass
class Config:
    """One configuration: a section, a key that identifies it there, and the worker spec."""

    section: str
    key: dict[str, Any]
    spec: dict[str, Any]
    rounds: int = 1
    # Configurations with the same group take turns window by window (run_group).
    group: str | None = None
    results: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    skipped_rounds: int = 0
    # Rounds in which the deadline cut this configuration's windows short.
    cut_windows: list[dict[str, int]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.section + "/" + "/".join(f"{k}={v}" for k, v in self.key.items())


# --- the plan -----------------------------------------------------------------

# Seconds a unit (a group by its name, or a configuration alone by its section)
# of the full run took on this project's 2-core VM (8.2 min in all; the all-reduce
# groups from the 9.3-min run after they began timing several all-reduces per
# call); execute() plans round 1's time limit by them (_group_deadline).
_EXPECTED_SECONDS = {"memcopy": 1, "allreduce/2": 15, "allreduce/4": 19, "cnn/2": 36,
                     "cnn/4": 28, "resnet50/2": 66, "resnet50/4": 191, "batch_norm/4": 101,
                     "multiworker": 18, "input_pipeline": 20,
                     # Not measured on a quiet machine: the xla group's five warm-ups
                     # (4-replica tracing twice) on a loaded one.
                     "xla/4": 120,
                     # Not from a quiet run: alone on a machine at load average 11-13 the
                     # group took 465 s, its three processes 127 CPU-seconds in all (the
                     # tracing of 4 replicas most of it); 90 s is that CPU time on 2 cores
                     # and some waiting. Replace it from the next quiet full run.
                     "sngan/4": 90}
# The replica-work reference joined each training group after these were measured: one more
# process per group (one device, about as long as the one-device baseline's). Estimated, not
# measured: replace from the next quiet full run.
for _group, _extra in (("cnn/2", 9), ("cnn/4", 9), ("resnet50/2", 20), ("resnet50/4", 25),
                       ("sngan/4", 20)):
    _EXPECTED_SECONDS[_group] += _extra


def _expected_seconds(unit: list[Config]) -> float:
    """What ``unit`` is expected to take, from ``_EXPECTED_SECONDS`` (60 s if unknown)."""
    return _EXPECTED_SECONDS.get(unit[0].group or unit[0].section, 60.0)


def _train_spec(model: str, strategy: str, devices: int | str, s: Settings, **extra) -> dict:
    resnet = model == "resnet50"
    batches = {"sngan": 32}  # the SN-GAN learning check's global batch (per generator update)
    if model == "resnet50_bn":  # steps of ~80 ms, 8 per call: like the CNN's windows
        extra = {"steps_per_execution": 8, **extra}
    if s.quick:
        steps = {"warmup_steps": 2, "windows": s.windows, "window_steps": 4}
    # Many short windows rather than a few long ones: the ratios that count are
    # medians of window-by-window ratios, and this 2-core VM's noise is fast
    # (windows of one process vary by 10%), so more pairs resolve more.
    elif resnet or model in GAN_MODELS:  # steps of a few hundred ms or more
        steps = {"warmup_steps": 2, "windows": 12, "window_steps": 2}
    else:  # multiples of 8 for steps_per_execution=8
        steps = {"warmup_steps": 8, "windows": 24, "window_steps": 8}
    # ResNet-50 and its batch-norm layers alone: the same per-replica shapes.
    spec = {"kind": "train", "model": model, "strategy": strategy, "devices": devices,
            "global_batch": batches.get(model, 64 if model.startswith("resnet50") else 128),
            "steps_per_execution": 1, **steps,
            # Every window a new epoch (one fit call), as users train: each pays what Keras
            # does between epochs, where the stall of every epoch was (docs/performance.md).
            "epoch_per_window": True}
    spec.update(extra)
    return spec


def plan(settings: Settings, env: dict[str, Any]) -> list[Config]:
    """Every configuration of a run, in the order of the first round."""
    s = settings
    device_sets: list[int | str] = list(s.device_counts)
    if env.get("gpus", 0) > 0:
        device_sets.append("gpu")
    configs: list[Config] = [
        Config("memcopy", {}, {"kind": "memcopy", "sizes_mb": list(s.sizes_mb),
                               "windows": s.windows + 2}, s.rounds)
    ]
    for k in device_sets:
        for impl in ("stock_default", "stock_rtod", "ours"):
            configs.append(Config(
                "allreduce", {"impl": impl, "devices": k},
                {"kind": "allreduce", "impl": impl, "devices": k, "sizes_mb": list(s.sizes_mb),
                 "windows": s.windows + 2 if s.quick else 12}, s.rounds,
                 group=f"allreduce/{k}"))
    k = max(s.device_counts)

    def batch_norm_pair(model: str, group: str) -> list[Config]:
        return [Config("batch_norm", {"model": model, "batch_norm": bn, "devices": k},
                       _train_spec(model, "ours", k, s, batch_norm=bn),
                       s.resnet_rounds if model == "resnet50" else s.rounds, group=group)
                for bn in ("keras_sync", "global")]

    bn_available = bool(env.get("global_batch_norm_available"))
    for model in s.models:
        rounds = s.resnet_rounds if model == "resnet50" else s.rounds
        # A GAN on the largest device count only: one group of one device, stock and ours.
        model_sets = [k] if model in GAN_MODELS else device_sets
        # One group per device count: stock and ours side by side; the one-device
        # baseline joins the first group; for the CNN, ours with
        # steps_per_execution=8 joins each (stock fails with it on 2+ replicas).
        for one in [1] + (["gpu1"] if "gpu" in model_sets else []):
            configs.append(Config("training", {"model": model, "strategy": "one", "devices": one},
                                  _train_spec(model, "one", one, s), rounds,
                                  group=f"{model}/{model_sets[0]}" if one == 1 else None))
        for devices in model_sets:
            for strategy in ("stock", "ours"):
                configs.append(Config("training",
                                      {"model": model, "strategy": strategy, "devices": devices},
                                      _train_spec(model, strategy, devices, s), rounds,
                                      group=f"{model}/{devices}"))
            if isinstance(devices, int):
                # The replica-work reference, in the same group: one device doing the K
                # replicas' work (K steps at B / K per step), none of replication's costs.
                configs.append(Config("training",
                                      {"model": model, "strategy": "reference", "devices": devices},
                                      _train_spec(model, "reference", devices, s,
                                                  reference_replicas=devices), rounds,
                                      group=f"{model}/{devices}"))
            if model == "cnn":
                configs.append(Config("steps_per_execution",
                                      {"model": model, "steps_per_execution": 8,
                                       "devices": devices},
                                      _train_spec("cnn", "ours", devices, s, steps_per_execution=8),
                                      rounds, group=f"{model}/{devices}"))
            if model == "resnet50" and devices == k and bn_available:
                # The whole ResNet-50 with each batch norm joins its training group:
                # its warm-ups overlap those of stock and ours.
                configs += batch_norm_pair(model, f"{model}/{devices}")
    if bn_available:
        # The CNN always; ResNet-50's 53 batch-norm layers alone with ResNet-50.
        for model in ["cnn_bn"] + (["resnet50_bn"] if "resnet50" in s.models else []):
            configs += batch_norm_pair(model, f"batch_norm/{k}")
    if not s.quick or "xla" in s.sections:
        configs += _xla_configs(s, k)
    mw_steps = ({"warmup_steps": 3, "windows": 2, "window_steps": 4} if s.quick
                else {"warmup_steps": 5, "windows": 12, "window_steps": 5})
    for strategy in ("stock", "ours"):
        configs.append(Config("multiworker", {"strategy": strategy, "workers": 2},
                              {"kind": "multiworker", "strategy": strategy, "model": "cnn",
                               "global_batch": 128, "timeout": s.timeout / 2, **mw_steps},
                              s.rounds, group="multiworker"))
    if os.path.exists(os.path.join(ROOT, "benchmarks", "input_pipeline.py")):
        configs.append(Config("input_pipeline", {},
                              {"kind": "input_pipeline", "quick": s.quick}, 1))
    return configs


def _xla_configs(s: Settings, k: int) -> list[Config]:
    """XLA (`jit_compile`) on and off, one device and `k` replicas, taking turns in one group;
    stock `MirroredStrategy` with XLA beside them as it is (it fails: its error is the row)."""
    sides = [("one", 1, False), ("one", 1, True), ("ours", k, False), ("ours", k, True),
             ("stock", k, True)]
    return [Config("xla", {"model": "cnn", "strategy": strategy, "devices": devices, "jit": jit},
                   _train_spec("cnn", strategy, devices, s, jit_compile=jit), s.rounds,
                   group=f"xla/{k}")
            for strategy, devices, jit in sides]


# --- running ------------------------------------------------------------------


def run_worker(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Runs one worker process; returns its result or raises RuntimeError."""
    try:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.worker", json.dumps(spec)],
                              cwd=ROOT, env=_worker_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"timed out after {timeout:.0f} s") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"exit {proc.returncode}:\n{proc.stderr[-2500:]}")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def _worker_env() -> dict[str, str]:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    env.pop("TF_CONFIG", None)
    env.pop("KR_TEST_DEVICES", None)
    return env


def run_group(specs: list[dict[str, Any]], timeout: float, deadline: float | None = None,
              min_windows: int = 1) -> list[dict[str, Any] | RuntimeError]:
    """Runs workers (training, all-reduce, two-worker) side by side, taking turns window by window.

    All start together and warm up concurrently; then each timed window runs
    alone, the processes in turn (order reversed every other window), the others
    waiting in a callback. Past ``deadline`` (a ``time.perf_counter()`` value)
    the group takes no more windows once each process has timed
    ``min_windows``; every process then stops after the same window. Returns
    each worker's result, or the error it ended with.
    """
    import tempfile
    import threading

    procs, logs = [], []
    for spec in specs:
        log_file = tempfile.TemporaryFile(mode="w+")
        logs.append(log_file)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "benchmarks.worker", json.dumps(dict(spec, turns=True))],
            cwd=ROOT, env=_worker_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=log_file, text=True, bufsize=1))
    expired = threading.Event()

    def kill_all():
        expired.set()
        for p in procs:
            p.kill()

    watchdog = threading.Timer(timeout, kill_all)
    watchdog.start()
    outputs: list[list[str]] = [[] for _ in procs]
    alive = [True] * len(procs)

    def until_turn(i: int) -> None:
        """Reads worker i's output up to its next turn (or its end)."""
        for line in procs[i].stdout:
            line = line.rstrip("\n")
            if line == TURN:
                return
            outputs[i].append(line)
        alive[i] = False

    def send(i: int, line: str) -> None:
        if alive[i]:
            try:
                procs[i].stdin.write(line + "\n")
                procs[i].stdin.flush()
            except (BrokenPipeError, OSError):
                alive[i] = False

    try:
        for i in range(len(procs)):
            until_turn(i)  # warmed up
        windows = max(int(spec["windows"]) for spec in specs)
        for w in range(windows):
            if deadline is not None and w >= min_windows and time.perf_counter() > deadline:
                break
            for i in (range(len(procs)) if w % 2 == 0 else reversed(range(len(procs)))):
                if alive[i]:
                    send(i, GO)
                    until_turn(i)
        for i in range(len(procs)):
            send(i, STOP)
        for i, p in enumerate(procs):
            for line in p.stdout:
                outputs[i].append(line.rstrip("\n"))
            p.wait()
    finally:
        watchdog.cancel()
        for p in procs:
            if p.poll() is None:
                p.kill()
    results: list[dict[str, Any] | RuntimeError] = []
    for i, p in enumerate(procs):
        lines = [ln for ln in outputs[i] if ln.startswith(RESULT_PREFIX)]
        logs[i].seek(0)
        stderr = logs[i].read()
        logs[i].close()
        if expired.is_set():
            results.append(RuntimeError(f"timed out after {timeout:.0f} s"))
        elif p.returncode != 0 or not lines:
            results.append(RuntimeError(f"exit {p.returncode}:\n{stderr[-2500:]}"))
        else:
            results.append(json.loads(lines[-1][len(RESULT_PREFIX):]))
    return results


def execute(configs: list[Config], settings: Settings, log=print) -> None:
    """Runs the rounds: round r runs every configuration that wants r+1 rounds.

    With ``settings.jobs > 1`` (the quick smoke run) several processes run at
    once, which makes the figures meaningless but the run short.
    """

    started = time.perf_counter()
    durations: dict[str, float] = {}
    first_round: list[list[Config]] = []

    def record(r: int, config: Config, outcome, seconds: float) -> None:
        if isinstance(outcome, RuntimeError):
            config.errors.append(str(outcome))
            log(f"  round {r + 1}: {config.name}: FAILED ({str(outcome).splitlines()[0]})")
        else:
            config.results.append(outcome)
            log(f"  round {r + 1}: {config.name}: {_headline(outcome)} ({seconds:.0f} s)")

    def one(r: int, unit: list[Config]) -> None:
        name = " + ".join(c.name for c in unit)
        t0 = time.perf_counter()
        if r > 0 and t0 - started + durations.get(name, 0.0) > settings.budget_seconds:
            for config in unit:
                config.skipped_rounds += 1
                log(f"  round {r + 1}: {config.name}: skipped (time budget spent)")
            return
        if len(unit) == 1:
            try:
                outcomes = [run_worker(unit[0].spec, settings.timeout)]
            except RuntimeError as error:
                outcomes = [error]
        else:
            deadline = None
            if r == 0 and math.isfinite(settings.deadline_seconds):
                deadline = _group_deadline(first_round, unit, started, t0,
                                           settings.deadline_seconds)
            planned = max(int(c.spec["windows"]) for c in unit)
            outcomes = run_group([c.spec for c in unit], settings.timeout, deadline,
                                 min_windows=math.ceil(planned / 2))
            for config, outcome in zip(unit, outcomes):
                taken = _windows_taken(outcome)
                if taken is not None and taken < int(config.spec["windows"]):
                    config.cut_windows.append({"round": r + 1, "windows": taken,
                                               "planned": int(config.spec["windows"])})
                    log(f"  round {r + 1}: {config.name}: {taken} of "
                        f"{config.spec['windows']} windows (time limit)")
        durations[name] = time.perf_counter() - t0
        for config, outcome in zip(unit, outcomes):
            record(r, config, outcome, durations[name])

    # Units: a group's configurations together, every other configuration alone.
    units: list[list[Config]] = []
    for config in configs:
        if config.group is not None and units and units[-1][0].group == config.group:
            units[-1].append(config)
        else:
            units.append([config])
    total_rounds = max(c.rounds for c in configs)
    for r in range(total_rounds):
        order = units if r % 2 == 0 else units[::-1]
        todo = [u for u in order if r < u[0].rounds and not any(c.errors for c in u)]
        if r == 0:
            first_round = todo
        if settings.jobs > 1:
            with concurrent.futures.ThreadPoolExecutor(settings.jobs) as pool:
                list(pool.map(lambda u, r=r: one(r, u), todo))
        else:
            for unit in todo:
                one(r, unit)


def _group_deadline(units: list[list[Config]], unit: list[Config], started: float, now: float,
                    limit: float) -> float:
    """When ``unit`` (starting ``now``) must stop timing windows for round 1 to end by
    ``started + limit``: the end less what the units after it are expected to take,
    at the pace of the units before it (``_expected_seconds``, never faster than it).
    A unit may thus use the time its predecessors saved; on a slow machine the pace
    leaves the later units their share too.
    """
    i = units.index(unit)
    done = sum(map(_expected_seconds, units[:i]))
    pace = max(1.0, (now - started) / done) if done else 1.0
    return started + limit - pace * sum(map(_expected_seconds, units[i + 1:]))


def _windows_taken(result: dict[str, Any] | RuntimeError) -> int | None:
    """Timed windows in a worker's result (None for an error or a result without them)."""
    if isinstance(result, RuntimeError) or result.get("available") is False:
        return None
    if "samples" in result:
        return len(result["samples"])
    if "sizes" in result:
        return min(len(v["samples"]) for v in result["sizes"].values())
    return None


def _headline(result: dict[str, Any]) -> str:
    if result.get("available") is False:
        return "not available"
    if "examples_per_second" in result:
        return f"{result['examples_per_second']:.1f} examples/s"
    if "sizes" in result:
        return ", ".join(f"{mb} MB {v['gbps']:.2f} GB/s" for mb, v in result["sizes"].items())
    return "done"


# --- aggregation --------------------------------------------------------------


def _median_of_samples(results: list[dict[str, Any]], get) -> dict[str, Any]:
    samples = [x for r in results for x in get(r)]
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples),
            "windows": len(samples)}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def aggregate(config: Config) -> dict[str, Any]:
    """One configuration's entry in the JSON: its key, figures, and provenance."""
    entry: dict[str, Any] = dict(config.key)
    if config.errors and not config.results:
        entry.update(available=False, error=config.errors[0][-1500:])
        return entry
    results = config.results
    first = results[0]
    if first.get("available") is False:
        entry.update(available=False, reason=first.get("reason", ""))
        return entry
    entry["available"] = True
    entry["rounds"] = len(results)
    if "examples_per_second" in first:
        stats = _median_of_samples(results, lambda r: r["samples"])
        entry.update(
            examples_per_second=stats["median"],
            examples_per_second_min=stats["min"],
            examples_per_second_max=stats["max"],
            step_ms=1000.0 * config.spec["global_batch"] / stats["median"],
            global_batch=config.spec["global_batch"],
            windows=stats["windows"],
            # Per round; windows of one group were taken in turns, so the report
            # can pair them (report._speedup).
            window_samples=[r["samples"] for r in results],
            group=config.group,
        )
        for key in ("replicas", "cross_device_ops", "parameters"):
            if key in first:
                entry[key] = first[key]
        entry["first_execution_seconds"] = first.get("first_execution_seconds")
    elif "sizes" in first:
        # "sizes": several all-reduces per call (worker.all_reduces_per_call);
        # "one_per_call": the same sizes, one per call, where that differs.
        for series, suffix in (("sizes", ""), ("one_per_call", "_one_per_call")):
            sizes = first.get(series) or {}
            if series == "sizes" or sizes:
                entry["gbps" + suffix] = {
                    mb: _median_of_samples(
                        results, lambda r, mb=mb, series=series: r[series][mb]["samples"]
                    )["median"]
                    for mb in sizes}
                entry["window_samples" + suffix] = {
                    mb: [r[series][mb]["samples"] for r in results] for mb in sizes}
        entry["group"] = config.group
        for key in ("replicas", "cross_device_ops", "all_reduces_per_call"):
            if key in first:
                entry[key] = first[key]
    else:
        entry["result"] = first
    entry["process_seconds"] = [_round(r.get("wall_seconds")) for r in results]
    entry["process_cpu_seconds"] = [_round(r.get("cpu_seconds")) for r in results]
    return entry


def collect(configs: list[Config], settings: Settings, env: dict[str, Any],
            started: float, wall: float) -> dict[str, Any]:
    """The JSON document of a run."""
    doc: dict[str, Any] = {
        "mode": "quick" if settings.quick else "full",
        "date": _dt.datetime.fromtimestamp(started, _dt.timezone.utc).isoformat(timespec="seconds"),
        "wall_seconds": round(wall, 1),
        "settings": {"rounds": settings.rounds, "resnet_rounds": settings.resnet_rounds,
                     "parallel_processes": settings.jobs,
                     "skipped_for_time": sum(c.skipped_rounds for c in configs),
                     "deadline_seconds": (settings.deadline_seconds
                                          if math.isfinite(settings.deadline_seconds) else None),
                     "windows_cut_for_time": [dict(cut, config=c.name)
                                              for c in configs for cut in c.cut_windows],
                     "device_counts": list(settings.device_counts),
                     "models": list(settings.models), "sizes_mb": list(settings.sizes_mb)},
        "environment": env,
    }
    sections = ("training", "batch_norm", "allreduce", "steps_per_execution", "multiworker", "xla")
    for section in sections:
        doc[section] = [aggregate(c) for c in configs if c.section == section]
    mem = [c for c in configs if c.section == "memcopy"]
    doc["memcopy"] = aggregate(mem[0]) if mem else {"available": False}
    # steps_per_execution=1 is the training configuration of the same model and devices.
    spe = []
    for entry in doc["steps_per_execution"]:
        spe += [dict(e, steps_per_execution=1) for e in doc["training"]
                if e["model"] == "cnn" and e["strategy"] == "ours"
                and e["devices"] == entry["devices"]]
        spe.append(entry)
    doc["steps_per_execution"] = spe
    if not any(c.section == "batch_norm" for c in configs):
        doc["batch_norm"] = [{"available": False,
                              "reason": "keras_replicator.layers.GlobalBatchNormalization is missing"}]
    pipeline = [c for c in configs if c.section == "input_pipeline"]
    if pipeline and pipeline[0].results:
        doc["input_pipeline"] = dict(pipeline[0].results[0], available=True)
        doc["input_pipeline"].pop("wall_seconds", None)
    elif pipeline:
        doc["input_pipeline"] = {"available": False, "error": pipeline[0].errors[0][-1500:]}
    else:
        doc["input_pipeline"] = {"available": False,
                                 "reason": "benchmarks/input_pipeline.py is missing"}
    # Stock failing to train a GAN is a finding (its row in the table says how it
    # fails), not a failure of the run.
    doc["failures"] = [{"config": c.name, "error": c.errors[0][-1500:]}
                       for c in configs if c.errors and not _stock_gan(c) and not _stock_xla(c)]
    return doc


def _stock_gan(config: Config) -> bool:
    return (config.section == "training" and config.key.get("strategy") == "stock"
            and config.key.get("model") in GAN_MODELS)


def _stock_xla(config: Config) -> bool:
    """Stock `MirroredStrategy` with `jit_compile=True`: its failure is the finding."""
    return config.section == "xla" and config.key.get("strategy") == "stock"


def _finite_positive(doc: dict[str, Any]) -> list[str]:
    """Names of figures that are not positive finite numbers (should be none)."""
    bad = []

    def check(name, value):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            bad.append(name)

    for section in ("training", "batch_norm", "steps_per_execution", "multiworker", "xla"):
        for e in doc.get(section, []):
            if e.get("available"):
                check(f"{section}:{e}", e["examples_per_second"])
    for e in doc["allreduce"] + [doc["memcopy"]]:
        for key in ("gbps", "gbps_one_per_call"):
            for mb, v in e.get(key, {}).items():
                check(f"allreduce/memcopy {key} {mb}", v)
    return bad


# --- entry point --------------------------------------------------------------


def write_outputs(doc: dict[str, Any], output_dir: str, publish_docs: bool) -> list[str]:
    """Writes the JSON, the Markdown table and the PNG plot; returns their paths."""
    os.makedirs(output_dir, exist_ok=True)
    json_path = os.path.join(output_dir, JSON_NAME)
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=2, sort_keys=False)
        f.write("\n")
    table_path = os.path.join(output_dir, TABLE_NAME)
    with open(table_path, "w") as f:
        f.write(report.markdown(doc))
    plot_path = os.path.join(output_dir, PLOT_NAME)
    report.plot(doc, plot_path)
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
    print(report.summary(doc))
    print(f"total {doc['wall_seconds'] / 60:.1f} min")
    bad = _finite_positive(doc)
    if doc["failures"] or bad:
        for failure in doc["failures"]:
            print(f"FAILED {failure['config']}: {failure['error'].splitlines()[0]}",
                  file=sys.stderr)
        for name in bad:
            print(f"not a positive finite figure: {name}", file=sys.stderr)
        return 1
    return 0
