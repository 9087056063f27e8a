"""The Markdown tables of a run, from its JSON (``benchmarks.md``, included by docs/performance.md).

:func:`markdown` writes them in order: the machine, the targets, training
throughput, the SN-GAN, XLA, the step time per window, the all-reduces, batch
norm, ``steps_per_execution``, two workers and the input pipeline.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.entries import (
    MODEL_NAMES,
    batch_norm_pairs,
    find,
    one_device,
    ours_at_spe8,
    reference,
)
from benchmarks.formatting import devices_label, fmt, fmt_interval, fmt_ratio
from benchmarks.models import GAN_MODELS
from benchmarks.ratios import bandwidth_ratio, eps, speedup, speedup_interval, window_ratios
from benchmarks.targets import targets
from benchmarks.xla_table import xla_table


def markdown(doc: dict[str, Any]) -> str:
    """The Markdown tables of one run (included by docs/performance.md)."""
    out = ["<!-- Written by `python -m benchmarks` from benchmarks.json; do not edit. -->", ""]
    if doc.get("mode") == "quick":
        out += ["!!! warning \"Quick-mode numbers\"",
                "    These figures come from a `--quick` smoke run (few windows, one round, "
                "2 devices, no ResNet-50, two processes at a time): a placeholder that shows "
                "the layout, not a measurement to quote.", ""]
    out += [machine_line(doc), ""]
    out += _targets_table(doc)
    out += _training_table(doc)
    out += gan_table(doc)
    out += xla_table(doc)
    out += _window_table(doc)
    out += bandwidth_table(doc)
    out += _batch_norm_table(doc)
    out += _steps_per_execution_table(doc)
    out += _multiworker_table(doc)
    pipeline = doc.get("input_pipeline", {})
    if pipeline.get("available"):
        out += ["**Input pipeline** (`benchmarks/input_pipeline.py`)", ""]
        out += _input_pipeline(pipeline)
        out.append("")
    return "\n".join(out) + "\n"


def _targets_table(doc: dict[str, Any]) -> list[str]:
    """The targets, measured and met or not (none: no lines)."""
    rows = targets(doc)
    if not rows:
        return []
    out = ["**Targets**", "", "| target | measured | met |", "|---|---|---|"]
    out += [f"| {t} | {m} | {ok} |" for t, m, ok in rows]
    out.append("")
    return out


def _training_table(doc: dict[str, Any]) -> list[str]:
    """Training throughput of one device, stock, ours and the replica-work reference, by row."""
    out = ["**Training throughput** (examples/s, `model.fit`, median of timed windows after "
           "warm-up; `steps_per_execution=1` unless said)", "",
           "| model | devices | one device | stock `MirroredStrategy` | `ReplicatorStrategy` "
           "| ours, `steps_per_execution=8` | ours / stock | ours (spe=8) / stock "
           "| ours / one device | replica-work reference | ours / reference | ours' all-reduce |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for e in doc["training"]:
        if e.get("strategy") != "ours" or e.get("model") in GAN_MODELS:
            continue
        one = one_device(doc, e["model"], e["devices"])
        stock = find(doc["training"], model=e["model"], strategy="stock", devices=e["devices"])
        spe8 = ours_at_spe8(doc, e["model"], e["devices"])
        out.append(
            f"| {MODEL_NAMES.get(e['model'], e['model'])} | {devices_label(e['devices'])} "
            f"| {fmt(eps(one))} | {fmt(eps(stock))} | {fmt(eps(e))} "
            f"| {fmt(eps(spe8)) if spe8 else 'not measured'} "
            f"| {fmt_ratio(speedup(e, stock))} "
            f"| {fmt_ratio(speedup(spe8, stock)) if spe8 else '-'} "
            f"| {fmt_ratio(speedup(e, one))} | {fmt(eps(reference(doc, e)))} "
            f"| {fmt_ratio(speedup(e, reference(doc, e)))} | {e.get('cross_device_ops', 'n/a')} |")
    out += ["", "Stock `MirroredStrategy` fails with `steps_per_execution` > 1 on 2+ replicas "
            "in Keras 3, so its column is at 1; ours runs 8 steps per call where measured "
            "(the small CNN, whose steps are short enough for the per-step cost of `fit` to "
            "show; a ResNet-50 step takes most of a second).", "",
            "The replica-work reference of K replicas is one device running K steps at "
            "B/K for each step of the others (`steps_per_execution=K`): the replicas' work "
            "with none of replication's costs, the best K simulated replicas sharing one "
            "device's cores can do. It takes turns with its row's stock and ours.", "",
            "Ratios between configurations that took turns (each row's stock and ours, "
            "`steps_per_execution` 1 and 8; "
            "the one-device baseline with the first row of each model; the two batch-norm "
            "layers; the two multi-worker runs; the all-reduce "
            "implementations on the same devices) are the median of "
            "their window-by-window ratios, which cancels the machine's drift; other ratios "
            "are of medians.", ""]
    return out


def _batch_norm_table(doc: dict[str, Any]) -> list[str]:
    """Step time of Keras's synchronized batch norm and ours, per model."""
    pairs = batch_norm_pairs(doc)
    out = ["**Cross-replica batch norm** (`ReplicatorStrategy`; CNN + BN: 4 conv layers each "
           "followed by batch norm; ResNet-50: its 53 batch-norm layers, 32x32 images, "
           "global batch 64; ResNet-50's BN layers: the same 53 layers at the same shapes, "
           "each shape's chain fed by a pooling and a 1x1 convolution of the image, "
           "`steps_per_execution=8`)", ""]
    if pairs:
        out += ["| model | layer | devices | step time (ms) | examples/s | first step (s) "
                "| step time / Keras sync BN's |",
                "|---|---|---|---:|---:|---:|---:|"]
        for model, sync, glob in pairs:
            for name, e in (("Keras `BatchNormalization(synchronized=True)`", sync),
                            ("`GlobalBatchNormalization`", glob)):
                out.append(f"| {MODEL_NAMES.get(model, model)} | {name} "
                           f"| {devices_label(e['devices'])} | {fmt(e['step_ms'], 1)} "
                           f"| {fmt(eps(e))} | {fmt(e.get('first_execution_seconds'), 1)} "
                           f"| {fmt_ratio(1.0 / speedup(e, sync))} |")
        out += ["", "First step: seconds from `fit` to the end of the first step (tracing, "
                "graph optimization, one step)."]
    else:
        reason = (doc["batch_norm"][0].get("reason") or doc["batch_norm"][0].get("error", "")
                  if doc["batch_norm"] else "")
        out.append(f"Not available: {reason.splitlines()[0] if reason else 'not measured'}.")
    out.append("")
    return out


def _steps_per_execution_table(doc: dict[str, Any]) -> list[str]:
    """Ours' throughput at ``steps_per_execution`` 1 and 8, per device count."""
    spe = [e for e in doc["steps_per_execution"] if e.get("available")]
    out = ["**`steps_per_execution`** (small CNN, `ReplicatorStrategy`; stock "
           "`MirroredStrategy` fails with values > 1 on 2+ replicas)", ""]
    if spe:
        out += ["| steps_per_execution | devices | examples/s | vs 1 |", "|---:|---|---:|---:|"]
        for e in spe:
            base = find(spe, devices=e["devices"], steps_per_execution=1)
            out.append(f"| {e['steps_per_execution']} | {devices_label(e['devices'])} "
                       f"| {fmt(eps(e))} | {fmt_ratio(speedup(e, base))} |")
    else:
        out.append("Not available.")
    out.append("")
    return out


def _multiworker_table(doc: dict[str, Any]) -> list[str]:
    """Two local workers: stock ``MultiWorkerMirroredStrategy`` and ours."""
    out = ["**Two local workers** (one CPU device each, small CNN, custom `strategy.run` loop; "
           "stock `MultiWorkerMirroredStrategy` cannot run `model.fit` in Keras 3)", ""]
    stock = find(doc["multiworker"], strategy="stock")
    ours_entry = next((e for e in doc["multiworker"] if e.get("strategy") == "ours"), {})
    ours = ours_entry if ours_entry.get("available") else None
    out += ["| stock `MultiWorkerMirroredStrategy` | `ReplicatorStrategy` | ours / stock |",
            "|---:|---:|---:|"]
    ours_cell = fmt(eps(ours)) if ours else (
        "not available" + (f" ({ours_entry['reason']})" if ours_entry.get("reason") else ""))
    out.append(f"| {fmt(eps(stock))} examples/s | {ours_cell} "
               f"| {fmt_ratio(speedup(ours, stock))} |")
    out.append("")
    return out


def machine_line(doc: dict[str, Any]) -> str:
    """The machine, the versions and the run's settings, in one paragraph."""
    env = doc["environment"]
    return (
        f"Measured on {env.get('cpu_model', '?')} with {env.get('cpu_count', '?')} CPU cores "
        f"(physical devices: {', '.join(env.get('physical_devices', [])) or '?'}), "
        f"{env.get('platform', '')}; Python {env.get('python', '?')}, "
        f"TensorFlow {env.get('tensorflow', '?')}, Keras {env.get('keras', '?')}, "
        f"keras_replicator {env.get('keras_replicator', '?')}. "
        f"Run of {doc.get('date', '?')} in **{doc.get('mode', '?')} mode**, "
        f"{doc.get('wall_seconds', 0) / 60:.1f} min; "
        f"{doc['settings']['rounds']} interleaved round(s) "
        f"({doc['settings']['resnet_rounds']} for ResNet-50)"
        + (f", {doc['settings']['skipped_for_time']} configuration round(s) skipped for time"
           if doc["settings"].get("skipped_for_time") else "")
        + "." + _cuts_line(doc)
    )


def _cuts_line(doc: dict[str, Any]) -> str:
    """Which configurations timed fewer windows than planned, to end the run in time."""
    cuts = doc["settings"].get("windows_cut_for_time") or []
    if not cuts:
        return ""
    listed = "; ".join(f"{c['config']}: {c['windows']} of {c['planned']}" for c in cuts)
    return (f" To end within {doc['settings']['deadline_seconds'] / 60:.1f} min, these took "
            f"fewer windows than planned: {listed}.")


def gan_table(doc: dict[str, Any]) -> list[str]:
    """The GAN rows: step time per generator update of one device, stock and ours,
    and ours' paired ratios; a side that failed shows its error instead."""
    rows = [e for e in doc["training"] if e.get("model") in GAN_MODELS
            and e.get("strategy") == "ours"]
    if not rows:
        return []
    out = ["**SN-GAN** (`kr.applications.sngan.SNGAN`, `model.fit`: ms per step, a step being "
           "`n_dis=1` discriminator update and one generator update; 16x16 images, `ch=16`, "
           "global batch 32 per update, synthetic images in [-1, 1]; median of timed windows; "
           "ratios of throughput, paired window by window, with their 90% interval)", "",
           "| model | devices | one device | stock `MirroredStrategy` | `ReplicatorStrategy` "
           "| replica-work reference | ours / one device | ours / stock | ours / reference |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]

    def cell(entry: dict | None) -> str:
        if entry is None:
            return "not measured"
        if not entry.get("available"):
            reason = entry.get("error") or entry.get("reason") or "not available"
            lines = [ln for ln in reason.splitlines() if ln.strip()]
            # The exception's own line (the last), not the worker's exit status.
            return "fails: `" + (lines[-1] if lines else reason)[:160].replace("|", "/") + "`"
        return f"{fmt(entry['step_ms'], 1)} ms"

    def ratio(a: dict, b: dict | None) -> str:
        r = speedup(a, b) if b and b.get("available") else None
        return "-" if r is None else (fmt_ratio(r) + fmt_interval(speedup_interval(a, b)))

    for e in rows:
        one = one_device(doc, e["model"], e["devices"])
        stock = next((x for x in doc["training"] if x.get("model") == e["model"]
                      and x.get("strategy") == "stock" and x.get("devices") == e["devices"]),
                     None)
        out.append(f"| {MODEL_NAMES.get(e['model'], e['model'])} "
                   f"| {devices_label(e['devices'])} | {cell(one)} | {cell(stock)} | {cell(e)} "
                   f"| {cell(reference(doc, e))} | {ratio(e, one)} | {ratio(e, stock)} "
                   f"| {ratio(e, reference(doc, e))} |")
    out.append("")
    return out


def _window_ms(entry: dict | None, batch: int) -> list[float]:
    """Step time (ms) of each timed window of an entry, every round."""
    if not entry or not entry.get("window_samples"):
        return []
    return [1000.0 * batch / x for r in entry["window_samples"] for x in r]


def _window_table(doc: dict[str, Any]) -> list[str]:
    """Distribution of per-window step times: one device, stock and ours (the stall at every epoch)."""
    out = ["**Step time per window** (ms per step; each window is one `fit` call, a new epoch "
           "with a new iterator; spread: the slowest window over the median; paired: ours' "
           "window over the other's window run just before or after it)", "",
           "| model | devices | strategy | p10 | median | p90 | slowest | spread "
           "| ours / it, paired (median, worst) |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for e in doc["training"]:
        if e.get("strategy") != "ours":
            continue
        batch = e.get("global_batch") or (64 if e["model"].startswith("resnet50") else 128)
        one = one_device(doc, e["model"], e["devices"])
        stock = find(doc["training"], model=e["model"], strategy="stock", devices=e["devices"])
        for name, other in (("one device", one), ("stock", stock), ("ours", e)):
            ms = sorted(_window_ms(other, batch))
            if not ms:
                continue
            # inclusive: the deciles of the windows measured (the default extrapolates beyond the
            # slowest window when there are few, so p90 could exceed it).
            q = statistics.quantiles(ms, n=10, method="inclusive") if len(ms) > 1 else [ms[0]] * 9
            median = statistics.median(ms)
            ratios = (None if other is e else
                      window_ratios(e, other, e.get("window_samples"), other.get("window_samples")))
            paired = (f"{statistics.median(ratios):.2f}x, {min(ratios):.2f}x" if ratios else "-")
            out.append(f"| {MODEL_NAMES.get(e['model'], e['model'])} "
                       f"| {devices_label(e['devices'])} | {name} | {fmt(q[0], 1)} "
                       f"| {fmt(median, 1)} | {fmt(q[-1], 1)} | {fmt(ms[-1], 1)} "
                       f"| {ms[-1] / median:.2f}x | {paired} |")
    out += ["", "Paired ratios are of throughput (above 1: ours faster in that pair of windows).",
            ""]
    return out


def bandwidth_table(doc: dict[str, Any]) -> list[str]:
    """The all-reduce section of the Markdown table: bandwidths and ratios by size."""
    out: list[str] = []
    mem = doc.get("memcopy", {}).get("gbps", {})
    out += ["**All-reduce algorithm bandwidth** (GB/s = tensor bytes / time per in-replica "
            "sum of a float32 tensor. Each timed call makes the given number of all-reduces, "
            "of distinct tensors, which spreads the fixed cost of calling a function on K "
            "devices over them, as nccl-tests times operations back to back; sizes where "
            "that is more than one are also timed one all-reduce per call. NumPy `copyto` "
            "bandwidth of the same size for scale)", "",
            "| devices | size | all-reduces per call | stock default "
            "| stock `ReductionToOneDevice` | ours | ours / stock default "
            "| ours / stock default, one per call | NumPy copy |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    chosen = {}
    for e in doc["allreduce"]:
        if e.get("impl") != "ours" or not e.get("available"):
            continue
        chosen[devices_label(e["devices"])] = e.get("cross_device_ops", "?")
        stock = find(doc["allreduce"], impl="stock_default", devices=e["devices"])
        rtod = find(doc["allreduce"], impl="stock_rtod", devices=e["devices"])
        for mb, v in e["gbps"].items():
            s = stock["gbps"].get(mb) if stock else None
            one = (fmt_ratio(bandwidth_ratio(e, stock, mb, "_one_per_call"))
                   if mb in e.get("gbps_one_per_call", {}) else "-")
            out.append(
                f"| {devices_label(e['devices'])} | {mb} MB "
                f"| {e.get('all_reduces_per_call', {}).get(mb, 1)} | {fmt(s, 2)} "
                f"| {fmt(rtod['gbps'].get(mb) if rtod else None, 2)} | {fmt(v, 2)} "
                f"| {fmt_ratio(bandwidth_ratio(e, stock, mb))} | {one} "
                f"| {fmt(mem.get(mb), 1)} |")
    stock_kind = next((e.get("cross_device_ops") for e in doc["allreduce"]
                       if e.get("impl") == "stock_default" and e.get("available")), "?")
    out.append("")
    out.append(f"Stock default: `{stock_kind}`. Ours, as chosen by `ReplicatorStrategy` with "
               "`cross_device_ops=None`: "
               + "; ".join(f"{k}: `{v}`" for k, v in chosen.items()) + ".")
    out.append("")
    return out


def _input_pipeline(result: dict[str, Any]) -> list[str]:
    """Its dicts of name -> number become columns of one table; scalars a line; notes text."""
    columns = [k for k, v in result.items() if isinstance(v, dict) and v
               and all(isinstance(x, (int, float)) for x in v.values())]
    rows: list[str] = []
    for col in columns:
        rows += [r for r in result[col] if r not in rows]
    out = []
    scalars = [f"{k}: {v}" for k, v in result.items()
               if k not in ("available", "benchmark", "notes", "unit")
               and isinstance(v, (int, float, str, bool, list))]
    if scalars:
        out += ["; ".join(scalars) + ".", ""]
    if columns:
        unit = result.get("unit", "")
        out.append("| pipeline | " + " | ".join(f"{c} ({unit})" if unit else c for c in columns)
                   + " |")
        out.append("|---|" + "---:|" * len(columns))
        for r in rows:
            out.append(f"| {r} | " + " | ".join(fmt(result[c].get(r)) for c in columns) + " |")
    else:
        out += ["| measurement | value |", "|---|---:|"]
        out += [f"| {name} | {value} |" for name, value in _flatten(result)
                if name != "available"]
    if isinstance(result.get("notes"), str):
        out += ["", result["notes"]]
    return out


def _flatten(d: dict[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    rows = []
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            rows += _flatten(v, name + " / ")
        elif isinstance(v, float):
            rows.append((name, fmt(v, 2)))
        elif isinstance(v, (int, str, bool)):
            rows.append((name, str(v)))
    return rows
