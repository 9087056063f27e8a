"""The plan of a ``python -m benchmarks`` run: its settings and its configurations.

A configuration (:class:`Config`) is a section of the results, a key that
identifies it there and the spec its worker process measures; configurations
with the same ``group`` take turns window by window (``processes.run_group``).
:data:`EXPECTED_SECONDS` says what each group took on this project's machine,
from which round 1's time limit is planned (``rounds.group_deadline``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from benchmarks.models import GAN_MODELS
from benchmarks.protocol import ROOT

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
    # (rounds.group_deadline) takes no more windows, down to half its planned number.
    # Warm-ups cannot be cut, so a machine much slower than the one of
    # EXPECTED_SECONDS can still overrun it.
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
    # Configurations with the same group take turns window by window (processes.run_group).
    group: str | None = None
    results: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    skipped_rounds: int = 0
    # Rounds in which the deadline cut this configuration's windows short.
    cut_windows: list[dict[str, int]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.section + "/" + "/".join(f"{k}={v}" for k, v in self.key.items())


# Seconds a unit (a group by its name, or a configuration alone by its section)
# of the full run took on this project's 2-core VM (8.2 min in all; the all-reduce
# groups from the 9.3-min run after they began timing several all-reduces per
# call); rounds.execute plans round 1's time limit by them (rounds.group_deadline).
EXPECTED_SECONDS = {"memcopy": 1, "allreduce/2": 15, "allreduce/4": 19, "cnn/2": 36,
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
    EXPECTED_SECONDS[_group] += _extra


def expected_seconds(unit: list[Config]) -> float:
    """What ``unit`` is expected to take, from ``EXPECTED_SECONDS`` (60 s if unknown)."""
    return EXPECTED_SECONDS.get(unit[0].group or unit[0].section, 60.0)


def train_spec(model: str, strategy: str, devices: int | str, s: Settings, **extra) -> dict:
    """The worker spec of a ``train`` configuration: its batch, warm-up and windows."""
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
            # does between epochs, where the stall of every epoch was (docs/design.md).
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
                       train_spec(model, "ours", k, s, batch_norm=bn),
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
                                  train_spec(model, "one", one, s), rounds,
                                  group=f"{model}/{model_sets[0]}" if one == 1 else None))
        for devices in model_sets:
            for strategy in ("stock", "ours"):
                configs.append(Config("training",
                                      {"model": model, "strategy": strategy, "devices": devices},
                                      train_spec(model, strategy, devices, s), rounds,
                                      group=f"{model}/{devices}"))
            if isinstance(devices, int):
                # The replica-work reference, in the same group: one device doing the K
                # replicas' work (K steps at B / K per step), none of replication's costs.
                configs.append(Config("training",
                                      {"model": model, "strategy": "reference", "devices": devices},
                                      train_spec(model, "reference", devices, s,
                                                 reference_replicas=devices), rounds,
                                      group=f"{model}/{devices}"))
            if model == "cnn":
                configs.append(Config("steps_per_execution",
                                      {"model": model, "steps_per_execution": 8,
                                       "devices": devices},
                                      train_spec("cnn", "ours", devices, s, steps_per_execution=8),
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
                   train_spec("cnn", strategy, devices, s, jit_compile=jit), s.rounds,
                   group=f"xla/{k}")
            for strategy, devices, jit in sides]
