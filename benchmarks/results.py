"""The JSON document of a run: each configuration's figures over its rounds, and the failures.

A configuration's figure is the median of all its windows over all rounds; the
windows themselves are kept per round (``window_samples``), so that the report
can pair the windows of configurations that took turns.
"""

from __future__ import annotations

import datetime as _dt
import math
import statistics
from typing import Any

from benchmarks.models import GAN_MODELS
from benchmarks.plan import Config, Settings


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
            # can pair them (ratios.speedup).
            window_samples=[r["samples"] for r in results],
            group=config.group,
        )
        for key in ("replicas", "cross_device_ops", "parameters"):
            if key in first:
                entry[key] = first[key]
        entry["first_execution_seconds"] = first.get("first_execution_seconds")
    elif "sizes" in first:
        # "sizes": several all-reduces per call (allreduce.all_reduces_per_call);
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


def invalid_figures(doc: dict[str, Any]) -> list[str]:
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
