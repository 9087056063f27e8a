"""The XLA table of `python -m benchmarks`: step time with and without `jit_compile`.

One device and ours on K replicas, each with XLA on and off, took turns window by
window in one group (``plan._xla_configs``), so each "XLA / no XLA" ratio is
paired; stock `MirroredStrategy` with `jit_compile=True` ran beside them and its
row is its error (it fails at the first step).
"""

from __future__ import annotations

from typing import Any

from benchmarks.entries import STRATEGY_NAMES
from benchmarks.formatting import devices_label, fmt, fmt_interval, fmt_ratio
from benchmarks.ratios import speedup, speedup_interval


def _cell(entry: dict | None) -> str:
    if entry is None:
        return "not measured"
    if not entry.get("available"):
        reason = entry.get("error") or entry.get("reason") or "not available"
        lines = [ln.strip() for ln in reason.splitlines() if ln.strip()]
        # TensorFlow's message (the line that says what failed), not the node it names last.
        said = [ln for ln in lines if not ln.startswith(("[[", "File ", "Cf. ", "Detected at"))]
        return "fails: `" + (said[-1] if said else reason)[:200].replace("|", "/") + "`"
    return f"{fmt(entry['step_ms'], 1)} ms"


def xla_table(doc: dict[str, Any]) -> list[str]:
    """Markdown lines of the XLA section (none if it was not measured)."""
    rows = doc.get("xla") or []
    if not rows:
        return []
    out = ["**XLA** (`jit_compile`; small CNN, `model.fit`, global batch 128: ms per step, "
           "median of timed windows; the ratio is of throughput, XLA over no XLA, paired "
           "window by window, with its 90% interval)", "",
           "| strategy | devices | no XLA | `jit_compile=True` | XLA / no XLA |",
           "|---|---|---:|---:|---:|"]
    for strategy in ("one", "ours", "stock"):
        side = [e for e in rows if e.get("strategy") == strategy]
        if not side:
            continue
        off = next((e for e in side if e.get("jit") is False), None)
        on = next((e for e in side if e.get("jit") is True), None)
        both = on and off and on.get("available") and off.get("available")
        ratio = "-"
        if both:
            ratio = fmt_ratio(speedup(on, off)) + fmt_interval(speedup_interval(on, off))
        out.append(f"| {STRATEGY_NAMES[strategy]} | {devices_label(side[0]['devices'])} "
                   f"| {_cell(off) if off else 'not measured'} | {_cell(on)} | {ratio} |")
    out.append("")
    return out
