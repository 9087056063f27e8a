"""The Markdown table of ratios and the PNG plot of a benchmark run, from its JSON."""

from __future__ import annotations

import math
import statistics
from typing import Any

STRATEGY_NAMES = {
    "one": "one device",
    "stock": "stock `MirroredStrategy`",
    "ours": "`ReplicatorStrategy`",
    "reference": "replica-work reference",
}
ALLREDUCE_NAMES = {
    "stock_default": "stock default",
    "stock_rtod": "stock `ReductionToOneDevice`",
    "ours": "ours",
}
MODEL_NAMES = {"cnn": "small CNN", "resnet50": "ResNet-50 (32x32)", "cnn_bn": "CNN + BN",
               "resnet50_bn": "ResNet-50's BN layers", "sngan": "SN-GAN (16x16)"}
# Training models whose step is a GAN's (n_dis discriminator updates and one generator
# update): their own table gives the step time per generator update, and they are not
# part of the throughput table and target (runner.GAN_MODELS).
GAN_MODELS = ("sngan",)
# Batch-norm comparisons in a whole model whose batch-norm layers are a small part
# of a step: the layers' difference is below what a run resolves there, so such a
# model checks that GlobalBatchNormalization is not resolved slower (its 90%
# interval entirely above 1.0) rather than deciding the target (see targets()).
WHOLE_MODEL_BN = ("resnet50",)


def _fmt(value: float | None, digits: int = 0) -> str:
    if value is None or not isinstance(value, (int, float)) or not math.isfinite(value):
        return "n/a"
    if digits == 0 and abs(value) < 10:
        digits = 2 if abs(value) < 1 else 1
    return f"{value:,.{digits}f}"


def _window_ratios(a: dict, b: dict, a_windows, b_windows) -> list[float] | None:
    """The ratios of entries ``a`` and ``b``'s windows side by side, if they took
    turns window by window (same group, see ``runner.run_group``; ``*_windows``:
    per round, a list of window figures); else None."""
    if (a.get("group") is not None and a.get("group") == b.get("group") and a_windows and b_windows
            and [len(r) for r in a_windows] == [len(r) for r in b_windows]):
        return [x / y for ra, rb in zip(a_windows, b_windows) for x, y in zip(ra, rb)]
    return None


def _paired_ratio(a: dict, b: dict, a_windows, b_windows, a_value, b_value) -> float | None:
    """``a_value / b_value``, or, when entries ``a`` and ``b`` took turns window by
    window, the median of the ratios of their windows side by side, which
    cancels the machine's drift between windows."""
    if not a_value or not b_value:
        return None
    ratios = _window_ratios(a, b, a_windows, b_windows)
    return statistics.median(ratios) if ratios else a_value / b_value


def median_interval(values: list[float], level: float = 0.9) -> tuple[float, float] | None:
    """A distribution-free confidence interval for the median of ``values``.

    The ``k``-th smallest and ``k``-th largest values, with ``k`` the largest for
    which the interval holds the median with probability >= ``level`` (each
    value is above the median with probability 1/2, so the count above is
    binomial). None when there are too few values for ``level``.
    """
    n = len(values)
    ordered = sorted(values)
    best = None
    for k in range(1, n // 2 + 1):
        below = sum(math.comb(n, i) for i in range(k)) / 2.0**n  # P(Binomial(n, 1/2) < k)
        if 1.0 - 2.0 * below < level:
            break
        best = (ordered[k - 1], ordered[n - k])
    return best


def _speedup(a: dict | None, b: dict | None) -> float | None:
    """Throughput of training entry ``a`` over ``b`` (paired when they took turns)."""
    if not a or not b:
        return None
    return _paired_ratio(a, b, a.get("window_samples"), b.get("window_samples"), _eps(a), _eps(b))


def _speedup_interval(a: dict | None, b: dict | None) -> tuple[float, float] | None:
    """90% interval of ``_speedup(a, b)`` when ``a`` and ``b`` took turns, else None."""
    if not a or not b:
        return None
    ratios = _window_ratios(a, b, a.get("window_samples"), b.get("window_samples"))
    return median_interval(ratios) if ratios else None


def _inverse(interval: tuple[float, float] | None) -> tuple[float, float] | None:
    """The interval of ``1 / r`` from that of ``r`` (a speed-up's, as a step-time ratio's)."""
    return None if interval is None else (1.0 / interval[1], 1.0 / interval[0])


def _fmt_interval(interval: tuple[float, float] | None) -> str:
    return "" if interval is None else f"; 90% interval {interval[0]:.2f}-{interval[1]:.2f}"


def _size_windows(a: dict, b: dict, mb: str, series: str = "") -> list:
    """All-reduce entries ``a`` and ``b``'s window figures at size ``mb``.

    ``series``: ``""`` for the main figures (several all-reduces per call),
    ``"_one_per_call"`` for those timed one all-reduce per call."""
    return [e.get("window_samples" + series, {}).get(mb) for e in (a, b)]


def _bandwidth_ratio(a: dict | None, b: dict | None, mb: str, series: str = "") -> float | None:
    """All-reduce bandwidth of entry ``a`` over ``b`` at size ``mb`` (paired when they took turns)."""
    if not a or not b:
        return None
    return _paired_ratio(a, b, *_size_windows(a, b, mb, series),
                         a.get("gbps" + series, {}).get(mb), b.get("gbps" + series, {}).get(mb))


def _bandwidth_interval(a: dict | None, b: dict | None, mb: str,
                        series: str = "") -> tuple[float, float] | None:
    """90% interval of ``_bandwidth_ratio(a, b, mb, series)`` when they took turns, else None."""
    if not a or not b:
        return None
    ratios = _window_ratios(a, b, *_size_windows(a, b, mb, series))
    return median_interval(ratios) if ratios else None


def _fmt_ratio(r: float | None) -> str:
    return "n/a" if r is None else f"**{r:.2f}x**"


def _devices_label(devices: int | str) -> str:
    return "all GPUs" if devices == "gpu" else f"{devices} CPU"


def _find(entries: list[dict], **key) -> dict | None:
    for e in entries:
        if all(e.get(k) == v for k, v in key.items()) and e.get("available"):
            return e
    return None


def _one_device(doc: dict[str, Any], model: str, devices: int | str) -> dict | None:
    """The one-device baseline of a row: GPU:0 for GPU rows, one CPU device otherwise."""
    return _find(doc["training"], model=model, strategy="one",
                 devices="gpu1" if devices == "gpu" else 1)


def _batch_norm_pairs(doc: dict[str, Any]) -> list[tuple[str, dict, dict]]:
    """``(model, Keras sync BN entry, GlobalBatchNormalization entry)`` per model measured,
    those of ``WHOLE_MODEL_BN`` last."""
    pairs = []
    for model in dict.fromkeys(e.get("model", "cnn_bn") for e in doc["batch_norm"]):
        sync = _find(doc["batch_norm"], model=model, batch_norm="keras_sync")
        glob = _find(doc["batch_norm"], model=model, batch_norm="global")
        if sync and glob:
            pairs.append((model, sync, glob))
    return sorted(pairs, key=lambda pair: pair[0] in WHOLE_MODEL_BN)  # whole models last


def _eps(entry: dict | None) -> float | None:
    return entry.get("examples_per_second") if entry else None


def machine_line(doc: dict[str, Any]) -> str:
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


def _spe8(doc: dict[str, Any], model: str, devices: int | str) -> dict | None:
    """Ours with ``steps_per_execution=8`` on a training row's model and devices."""
    return _find(doc["steps_per_execution"], model=model, devices=devices, steps_per_execution=8)


def _best_of_ours(doc: dict[str, Any], e: dict,
                  stock: dict | None) -> tuple[float, str, dict] | None:
    """Ours at its best against stock on training row ``e``: the larger of the
    ``steps_per_execution`` 1 and 8 ratios where both were measured (stock has
    only 1: it fails with more on 2+ replicas), with that value and entry."""
    options = [(_speedup(entry, stock), spe, entry)
               for spe, entry in (("1", e), ("8", _spe8(doc, e["model"], e["devices"])))]
    options = [o for o in options if o[0] is not None]
    return max(options, key=lambda o: o[0]) if options else None


def targets(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The targets: (target, measured, met?)."""
    rows = []
    same, best = [], []
    for e in doc["training"]:
        if (e.get("strategy") != "ours" or not e.get("available")
                or e.get("model") in GAN_MODELS):
            continue
        stock = _find(doc["training"], model=e["model"], strategy="stock", devices=e["devices"])
        label = f"{MODEL_NAMES.get(e['model'], e['model'])}, {_devices_label(e['devices'])}"
        r = _speedup(e, stock)
        if r is not None:
            same.append((r, label, _fmt_interval(_speedup_interval(e, stock))))
        at_best = _best_of_ours(doc, e, stock)
        if at_best is not None:
            b, spe, chosen = at_best
            best.append((b, label + f", `steps_per_execution={spe}`",
                         _fmt_interval(_speedup_interval(chosen, stock))))
    if best:
        worst, worst_same = min(best), min(same)
        rows.append(("training throughput, ours (at its best) >= 1.0x stock `MirroredStrategy`",
                     f"{worst[0]:.3f}x at worst ({worst[1]}{worst[2]}); "
                     f"best {max(best)[0]:.2f}x. "
                     f"Both at `steps_per_execution=1`: {worst_same[0]:.3f}x at worst "
                     f"({worst_same[1]}{worst_same[2]})",
                     "yes" if worst[0] >= 1.0 else "no"))
    rows += _reference_target(doc)
    rows += _batch_norm_target(doc)
    ar = _bandwidth_ratios(doc)
    if ar:
        worst = min(ar)
        one = _bandwidth_ratios(doc, "_one_per_call")
        one_text = ""
        if one:
            worst_one = min(one)
            one_text = (f". One all-reduce per call (the fixed cost of a call on K devices "
                        f"included): {worst_one[0]:.2f}x at worst "
                        f"({worst_one[1]}{worst_one[2]})")
        rows.append(("all-reduce bandwidth, ours >= 2x stock default",
                     f"{worst[0]:.3f}x at worst ({worst[1]}{worst[2]}); "
                     f"best {max(ar)[0]:.2f}x{one_text}",
                     "yes" if worst[0] >= 2.0 else "no"))
    return rows


def _bandwidth_ratios(doc: dict[str, Any], series: str = "") -> list[tuple[float, str, str]]:
    """Ours / stock default all-reduce bandwidth, per device count and size of
    ``series`` (see ``_size_windows``): (ratio, label, formatted interval)."""
    out = []
    for e in doc["allreduce"]:
        if e.get("impl") != "ours" or not e.get("available"):
            continue
        stock = _find(doc["allreduce"], impl="stock_default", devices=e["devices"])
        for mb in e.get("gbps" + series, {}):
            r = _bandwidth_ratio(e, stock, mb, series)
            if r is not None:
                out.append((r, f"{mb} MB, {_devices_label(e['devices'])}",
                            _fmt_interval(_bandwidth_interval(e, stock, mb, series))))
    return out


def _batch_norm_target(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    """GlobalBatchNormalization's step time against Keras sync BN's.

    Decided where the batch-norm layers make most of a step (the CNN + BN,
    ResNet-50's BN layers alone): the worst median ratio must be <= 1.0. In a
    whole model of ``WHOLE_MODEL_BN`` the ratio is shown with its interval, and
    only an interval entirely above 1.0 (resolved slower) fails the target.
    """
    layers, whole = [], []
    for model, sync, glob in _batch_norm_pairs(doc):
        ratio = 1.0 / _speedup(glob, sync)
        interval = _inverse(_speedup_interval(glob, sync))
        row = (ratio, MODEL_NAMES.get(model, model), glob, sync, interval)
        (whole if model in WHOLE_MODEL_BN else layers).append(row)
    if not layers and not whole:
        return []
    parts, met = [], True
    if layers:
        worst = max(layers, key=lambda row: row[0])
        met = worst[0] <= 1.0
        parts.append(f"{worst[0]:.3f}x at worst ({worst[1]}; medians "
                     f"{_fmt(worst[2]['step_ms'], 1)} ms vs {_fmt(worst[3]['step_ms'], 1)} ms"
                     f"{_fmt_interval(worst[4])})")
        parts += [f"{name} {r:.2f}x" + (f" ({_fmt_interval(ci)[2:]})" if ci else "")
                  for r, name, _, _, ci in layers if name != worst[1]]
    for ratio, name, _, _, interval in whole:
        slower = interval[0] > 1.0 if interval else ratio > 1.0
        met = met and not slower
        verdict = ("slower" if slower else "faster" if interval and interval[1] < 1.0
                   else "within what the run resolves")
        details = [_fmt_interval(interval)[2:]] if interval else []
        parts.append(f"whole {name}: {ratio:.2f}x ({'; '.join(details + [verdict])})")
    return [("`GlobalBatchNormalization` step time <= Keras synchronized BN's",
             "; ".join(parts), "yes" if met else "no")]


def _bandwidth_table(doc: dict[str, Any]) -> list[str]:
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
        chosen[_devices_label(e["devices"])] = e.get("cross_device_ops", "?")
        stock = _find(doc["allreduce"], impl="stock_default", devices=e["devices"])
        rtod = _find(doc["allreduce"], impl="stock_rtod", devices=e["devices"])
        for mb, v in e["gbps"].items():
            s = stock["gbps"].get(mb) if stock else None
            one = (_fmt_ratio(_bandwidth_ratio(e, stock, mb, "_one_per_call"))
                   if mb in e.get("gbps_one_per_call", {}) else "-")
            out.append(
                f"| {_devices_label(e['devices'])} | {mb} MB "
                f"| {e.get('all_reduces_per_call', {}).get(mb, 1)} | {_fmt(s, 2)} "
                f"| {_fmt(rtod['gbps'].get(mb) if rtod else None, 2)} | {_fmt(v, 2)} "
                f"| {_fmt_ratio(_bandwidth_ratio(e, stock, mb))} | {one} "
                f"| {_fmt(mem.get(mb), 1)} |")
    stock_kind = next((e.get("cross_device_ops") for e in doc["allreduce"]
                       if e.get("impl") == "stock_default" and e.get("available")), "?")
    out.append("")
    out.append(f"Stock default: `{stock_kind}`. Ours, as chosen by `ReplicatorStrategy` with "
               "`cross_device_ops=None`: "
               + "; ".join(f"{k}: `{v}`" for k, v in chosen.items()) + ".")
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
        one = _one_device(doc, e["model"], e["devices"])
        stock = _find(doc["training"], model=e["model"], strategy="stock", devices=e["devices"])
        for name, other in (("one device", one), ("stock", stock), ("ours", e)):
            ms = sorted(_window_ms(other, batch))
            if not ms:
                continue
            q = statistics.quantiles(ms, n=10) if len(ms) > 1 else [ms[0]] * 9
            median = statistics.median(ms)
            ratios = (None if other is e else
                      _window_ratios(e, other, e.get("window_samples"), other.get("window_samples")))
            paired = (f"{statistics.median(ratios):.2f}x, {min(ratios):.2f}x" if ratios else "-")
            out.append(f"| {MODEL_NAMES.get(e['model'], e['model'])} "
                       f"| {_devices_label(e['devices'])} | {name} | {_fmt(q[0], 1)} "
                       f"| {_fmt(median, 1)} | {_fmt(q[-1], 1)} | {_fmt(ms[-1], 1)} "
                       f"| {ms[-1] / median:.2f}x | {paired} |")
    out += ["", "Paired ratios are of throughput (above 1: ours faster in that pair of windows).",
            ""]
    return out


def _reference(doc: dict[str, Any], e: dict) -> dict | None:
    """The replica-work reference of training row ``e`` (one device doing its replicas' work)."""
    return _find(doc["training"], model=e["model"], strategy="reference", devices=e["devices"])


def _reference_target(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Ours >= 0.9x the replica-work reference (K steps at B/K on one device), classifiers."""
    found = []
    for e in doc["training"]:
        if e.get("strategy") != "ours" or not e.get("available") or e.get("model") in GAN_MODELS:
            continue
        ref = _reference(doc, e)
        r = _speedup(e, ref)
        if r is not None:
            label = f"{MODEL_NAMES.get(e['model'], e['model'])}, {_devices_label(e['devices'])}"
            found.append((r, label, _fmt_interval(_speedup_interval(e, ref))))
    if not found:
        return []
    worst = min(found)
    return [("training throughput, ours >= 0.9x the replica-work reference (one device running "
             "the replicas' work: K steps at B/K per step)",
             f"{worst[0]:.3f}x at worst ({worst[1]}{worst[2]}); "
             + ", ".join(f"{label} {r:.2f}x" for r, label, _ in found),
             "yes" if worst[0] >= 0.9 else "no")]


def _gan_table(doc: dict[str, Any]) -> list[str]:
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
        return f"{_fmt(entry['step_ms'], 1)} ms"

    def ratio(a: dict, b: dict | None) -> str:
        r = _speedup(a, b) if b and b.get("available") else None
        return "-" if r is None else (_fmt_ratio(r) + _fmt_interval(_speedup_interval(a, b)))

    for e in rows:
        one = _one_device(doc, e["model"], e["devices"])
        stock = next((x for x in doc["training"] if x.get("model") == e["model"]
                      and x.get("strategy") == "stock" and x.get("devices") == e["devices"]),
                     None)
        out.append(f"| {MODEL_NAMES.get(e['model'], e['model'])} "
                   f"| {_devices_label(e['devices'])} | {cell(one)} | {cell(stock)} | {cell(e)} "
                   f"| {cell(_reference(doc, e))} | {ratio(e, one)} | {ratio(e, stock)} "
                   f"| {ratio(e, _reference(doc, e))} |")
    out.append("")
    return out


def markdown(doc: dict[str, Any]) -> str:
    """The Markdown tables of one run (included by docs/performance.md)."""
    out = ["<!-- Written by `python -m benchmarks` from benchmarks.json; do not edit. -->", ""]
    if doc.get("mode") == "quick":
        out += ["!!! warning \"Quick-mode numbers\"",
                "    These figures come from a `--quick` smoke run (few windows, one round, "
                "2 devices, no ResNet-50, two processes at a time): a placeholder that shows "
                "the layout, not a measurement to quote.", ""]
    out += [machine_line(doc), ""]

    rows = targets(doc)
    if rows:
        out += ["**Targets**", "", "| target | measured | met |", "|---|---|---|"]
        out += [f"| {t} | {m} | {ok} |" for t, m, ok in rows]
        out.append("")

    out += ["**Training throughput** (examples/s, `model.fit`, median of timed windows after "
            "warm-up; `steps_per_execution=1` unless said)", "",
            "| model | devices | one device | stock `MirroredStrategy` | `ReplicatorStrategy` "
            "| ours, `steps_per_execution=8` | ours / stock | ours (spe=8) / stock "
            "| ours / one device | replica-work reference | ours / reference | ours' all-reduce |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for e in doc["training"]:
        if e.get("strategy") != "ours" or e.get("model") in GAN_MODELS:
            continue
        one = _one_device(doc, e["model"], e["devices"])
        stock = _find(doc["training"], model=e["model"], strategy="stock", devices=e["devices"])
        spe8 = _spe8(doc, e["model"], e["devices"])
        out.append(
            f"| {MODEL_NAMES.get(e['model'], e['model'])} | {_devices_label(e['devices'])} "
            f"| {_fmt(_eps(one))} | {_fmt(_eps(stock))} | {_fmt(_eps(e))} "
            f"| {_fmt(_eps(spe8)) if spe8 else 'not measured'} "
            f"| {_fmt_ratio(_speedup(e, stock))} "
            f"| {_fmt_ratio(_speedup(spe8, stock)) if spe8 else '-'} "
            f"| {_fmt_ratio(_speedup(e, one))} | {_fmt(_eps(_reference(doc, e)))} "
            f"| {_fmt_ratio(_speedup(e, _reference(doc, e)))} | {e.get('cross_device_ops', 'n/a')} |")
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

    out += _gan_table(doc)
    from benchmarks.xla_table import xla_table  # it reads this module's helpers

    out += xla_table(doc)
    out += _window_table(doc)
    out += _bandwidth_table(doc)

    pairs = _batch_norm_pairs(doc)
    out += ["**Cross-replica batch norm** (`ReplicatorStrategy`; CNN + BN: 4 conv layers each "
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
                           f"| {_devices_label(e['devices'])} | {_fmt(e['step_ms'], 1)} "
                           f"| {_fmt(_eps(e))} | {_fmt(e.get('first_execution_seconds'), 1)} "
                           f"| {_fmt_ratio(1.0 / _speedup(e, sync))} |")
        out += ["", "First step: seconds from `fit` to the end of the first step (tracing, "
                "graph optimization, one step)."]
    else:
        reason = (doc["batch_norm"][0].get("reason") or doc["batch_norm"][0].get("error", "")
                  if doc["batch_norm"] else "")
        out.append(f"Not available: {reason.splitlines()[0] if reason else 'not measured'}.")
    out.append("")

    spe = [e for e in doc["steps_per_execution"] if e.get("available")]
    out += ["**`steps_per_execution`** (small CNN, `ReplicatorStrategy`; stock "
            "`MirroredStrategy` fails with values > 1 on 2+ replicas)", ""]
    if spe:
        out += ["| steps_per_execution | devices | examples/s | vs 1 |", "|---:|---|---:|---:|"]
        for e in spe:
            base = _find(spe, devices=e["devices"], steps_per_execution=1)
            out.append(f"| {e['steps_per_execution']} | {_devices_label(e['devices'])} "
                       f"| {_fmt(_eps(e))} | {_fmt_ratio(_speedup(e, base))} |")
    else:
        out.append("Not available.")
    out.append("")

    out += ["**Two local workers** (one CPU device each, small CNN, custom `strategy.run` loop; "
            "stock `MultiWorkerMirroredStrategy` cannot run `model.fit` in Keras 3)", ""]
    stock = _find(doc["multiworker"], strategy="stock")
    ours_entry = next((e for e in doc["multiworker"] if e.get("strategy") == "ours"), {})
    ours = ours_entry if ours_entry.get("available") else None
    out += ["| stock `MultiWorkerMirroredStrategy` | `ReplicatorStrategy` | ours / stock |",
            "|---:|---:|---:|"]
    ours_cell = _fmt(_eps(ours)) if ours else (
        "not available" + (f" ({ours_entry['reason']})" if ours_entry.get("reason") else ""))
    out.append(f"| {_fmt(_eps(stock))} examples/s | {ours_cell} "
               f"| {_fmt_ratio(_speedup(ours, stock))} |")
    out.append("")

    pipeline = doc.get("input_pipeline", {})
    if pipeline.get("available"):
        out += ["**Input pipeline** (`benchmarks/input_pipeline.py`)", ""]
        out += _input_pipeline(pipeline)
        out.append("")
    return "\n".join(out) + "\n"


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
            out.append(f"| {r} | " + " | ".join(_fmt(result[c].get(r)) for c in columns) + " |")
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
            rows.append((name, _fmt(v, 2)))
        elif isinstance(v, (int, str, bool)):
            rows.append((name, str(v)))
    return rows


def summary(doc: dict[str, Any]) -> str:
    """A few lines for the console: the targets."""
    lines = [f"targets ({doc['mode']} mode):"]
    for target, measured, ok in targets(doc):
        lines.append(f"  [{'met' if ok == 'yes' else 'NOT met'}] {target}: {measured}")
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: str) -> None:
    """A 2x2 figure: training speed-ups, all-reduce bandwidth, batch norm, the rest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    fig.suptitle(f"keras_replicator vs stock TensorFlow ({doc['mode']} mode, "
                 f"{doc['environment'].get('cpu_count', '?')} CPU cores, "
                 f"TF {doc['environment'].get('tensorflow', '?')})")

    # (a) training throughput of ours over stock on the same devices (paired), with
    # the 90% interval: the ratios the target is about. (Ratios to one device
    # would mix paired and unpaired figures: one device shares only the first
    # row's group.)
    ax = axes[0][0]
    groups = [e for e in doc["training"] if e.get("strategy") == "ours"]
    labels = []
    bars: dict[str, list[tuple[float, tuple[float, float] | None]]] = {"1": [], "8": []}
    for e in groups:
        stock = _find(doc["training"], model=e["model"], strategy="stock", devices=e["devices"])
        labels.append(f"{MODEL_NAMES.get(e['model'], e['model'])}\n{_devices_label(e['devices'])}")
        for spe, entry in (("1", e), ("8", _spe8(doc, e["model"], e["devices"]))):
            r = _speedup(entry, stock) if entry else None
            bars[spe].append((r or 0.0, _speedup_interval(entry, stock) if r else None))
    x = range(len(labels))
    for offset, spe, color in ((-0.2, "1", "#1f77b4"), (0.2, "8", "#17becf")):
        values = [v for v, _ in bars[spe]]
        errors = [[v - ci[0] if ci else 0.0 for v, ci in bars[spe]],
                  [ci[1] - v if ci else 0.0 for v, ci in bars[spe]]]
        ax.bar([i + offset for i in x], values, 0.4, yerr=errors, capsize=3, color=color,
               label=f"ReplicatorStrategy, steps_per_execution={spe}")
    # Ours over the replica-work reference (one device doing the replicas' work), paired.
    refs = [(i, _speedup(e, _reference(doc, e)), _speedup_interval(e, _reference(doc, e)))
            for i, e in zip(x, groups)]
    refs = [(i, r, ci) for i, r, ci in refs if r]
    if refs:
        ax.errorbar([i for i, _, _ in refs], [r for _, r, _ in refs],
                    yerr=[[r - ci[0] if ci else 0.0 for _, r, ci in refs],
                          [ci[1] - r if ci else 0.0 for _, r, ci in refs]],
                    fmt="D", color="#d62728", capsize=3,
                    label="ReplicatorStrategy / replica-work reference")
        ax.axhline(0.9, color="#d62728", lw=0.6, ls=":")
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("throughput / stock MirroredStrategy's (bars)")
    ax.set_title("Training throughput (model.fit), 90% intervals")
    ax.legend(fontsize=7, loc="lower right")

    # (b) all-reduce bandwidth against size
    ax = axes[0][1]
    styles = {"stock_default": ("#999999", "o"), "stock_rtod": ("#ff7f0e", "s"),
              "ours": ("#1f77b4", "^")}
    dashes = {}
    for e in doc["allreduce"]:
        if not e.get("available"):
            continue
        color, marker = styles.get(e["impl"], ("black", "x"))
        sizes = [float(mb) for mb in e["gbps"]]
        ls = dashes.setdefault(e["devices"], ["-", ":", "-."][len(dashes) % 3])
        ax.plot(sizes, list(e["gbps"].values()), marker=marker, color=color, ls=ls,
                label=f"{ALLREDUCE_NAMES.get(e['impl'], e['impl']).replace('`', '')}, "
                      f"{_devices_label(e['devices'])}")
    mem = doc.get("memcopy", {}).get("gbps", {})
    if mem:
        ax.plot([float(mb) for mb in mem], list(mem.values()), color="green", ls="--",
                label="NumPy copy")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    plain = matplotlib.ticker.FormatStrFormatter("%g")
    ax.xaxis.set_major_formatter(plain)
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.set_xlabel("tensor size (MB)")
    ax.set_ylabel("GB/s (bytes / time per all-reduce)")
    ax.set_title("All-reduce algorithm bandwidth (several per call under 8 MB)")
    ax.legend(fontsize=7)

    # (c) batch norm step time
    ax = axes[1][0]
    pairs = _batch_norm_pairs(doc)
    if pairs:
        # Step time relative to Keras's synchronized BN, per model (absolute times differ 10x).
        labels = [MODEL_NAMES.get(model, model) for model, _, _ in pairs]
        xs = range(len(pairs))
        ax.bar([x - 0.2 for x in xs], [1.0] * len(pairs), 0.4, color="#999999",
               label="Keras BN (synchronized=True)")
        values = [1.0 / _speedup(g, s) for _, s, g in pairs]
        intervals = [_inverse(_speedup_interval(g, s)) for _, s, g in pairs]
        errors = [[v - ci[0] if ci else 0.0 for v, ci in zip(values, intervals)],
                  [ci[1] - v if ci else 0.0 for v, ci in zip(values, intervals)]]
        ax.bar([x + 0.2 for x in xs], values, 0.4, yerr=errors, capsize=3,
               color="#1f77b4", label="GlobalBatchNormalization (90% interval)")
        ax.set_xticks(list(xs), labels)
        ax.set_ylabel("step time / Keras sync BN's")
        ax.legend(fontsize=7)
        ax.set_title(f"Cross-replica batch norm, {_devices_label(pairs[0][1]['devices'])}")
    else:
        ax.text(0.5, 0.5, "GlobalBatchNormalization not available", ha="center")
        ax.set_axis_off()

    # (d) steps_per_execution and multi-worker throughput
    ax = axes[1][1]
    names, values, colors = [], [], []
    for e in doc["steps_per_execution"]:
        if e.get("available"):
            names.append(f"spe={e['steps_per_execution']}\n{_devices_label(e['devices'])}")
            values.append(_eps(e))
            colors.append("#1f77b4")
    for e in doc["multiworker"]:
        names.append(f"2 workers\n{'stock MWMS' if e.get('strategy') == 'stock' else 'ours'}")
        values.append(_eps(e) if e.get("available") else 0.0)
        colors.append("#999999" if e.get("strategy") == "stock" else "#1f77b4")
    ax.bar(names, values, color=colors)
    ax.set_ylabel("examples/s")
    ax.set_title("steps_per_execution (ours) and 2 local workers")
    ax.tick_params(axis="x", labelsize=8)

    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
