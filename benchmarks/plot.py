"""The PNG plot of a run, from its JSON: a 2x2 figure, one panel per comparison."""

from __future__ import annotations

from typing import Any

from benchmarks.entries import (
    ALLREDUCE_NAMES,
    MODEL_NAMES,
    batch_norm_pairs,
    find,
    ours_at_spe8,
    reference,
)
from benchmarks.formatting import devices_label
from benchmarks.ratios import eps, inverse, speedup, speedup_interval

Interval = tuple[float, float]


def plot(doc: dict[str, Any], path: str) -> None:
    """A 2x2 figure: training speed-ups, all-reduce bandwidth, batch norm, the rest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    fig.suptitle(f"keras_replicator vs stock TensorFlow ({doc['mode']} mode, "
                 f"{doc['environment'].get('cpu_count', '?')} CPU cores, "
                 f"TF {doc['environment'].get('tensorflow', '?')})")
    _training_panel(axes[0][0], doc)
    _allreduce_panel(axes[0][1], doc)
    _batch_norm_panel(axes[1][0], doc)
    _throughput_panel(axes[1][1], doc)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _error_bars(values: list[float], intervals: list[Interval | None]) -> list[list[float]]:
    """Matplotlib's ``yerr`` (below, above) of ``values`` from their intervals (none: 0)."""
    return [[v - ci[0] if ci else 0.0 for v, ci in zip(values, intervals)],
            [ci[1] - v if ci else 0.0 for v, ci in zip(values, intervals)]]


def _training_panel(ax, doc: dict[str, Any]) -> None:
    """Training throughput of ours over stock on the same devices (paired), with the 90%
    interval: the ratios the target is about. (Ratios to one device would mix paired and
    unpaired figures: one device shares only the first row's group.)"""
    groups = [e for e in doc["training"] if e.get("strategy") == "ours"]
    labels = []
    bars: dict[str, list[tuple[float, Interval | None]]] = {"1": [], "8": []}
    for e in groups:
        stock = find(doc["training"], model=e["model"], strategy="stock", devices=e["devices"])
        labels.append(f"{MODEL_NAMES.get(e['model'], e['model'])}\n{devices_label(e['devices'])}")
        for spe, entry in (("1", e), ("8", ours_at_spe8(doc, e["model"], e["devices"]))):
            r = speedup(entry, stock) if entry else None
            bars[spe].append((r or 0.0, speedup_interval(entry, stock) if r else None))
    x = range(len(labels))
    for offset, spe, color in ((-0.2, "1", "#1f77b4"), (0.2, "8", "#17becf")):
        values = [v for v, _ in bars[spe]]
        errors = _error_bars(values, [ci for _, ci in bars[spe]])
        ax.bar([i + offset for i in x], values, 0.4, yerr=errors, capsize=3, color=color,
               label=f"ReplicatorStrategy, steps_per_execution={spe}")
    # Ours over the replica-work reference (one device doing the replicas' work), paired.
    refs = [(i, speedup(e, reference(doc, e)), speedup_interval(e, reference(doc, e)))
            for i, e in zip(x, groups)]
    refs = [(i, r, ci) for i, r, ci in refs if r]
    if refs:
        ratios = [r for _, r, _ in refs]
        ax.errorbar([i for i, _, _ in refs], ratios,
                    yerr=_error_bars(ratios, [ci for _, _, ci in refs]),
                    fmt="D", color="#d62728", capsize=3,
                    label="ReplicatorStrategy / replica-work reference")
        ax.axhline(0.9, color="#d62728", lw=0.6, ls=":")
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("throughput / stock MirroredStrategy's (bars)")
    ax.set_title("Training throughput (model.fit), 90% intervals")
    ax.legend(fontsize=7, loc="lower right")


def _allreduce_panel(ax, doc: dict[str, Any]) -> None:
    """All-reduce bandwidth against size, per implementation and device count."""
    import matplotlib.ticker

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
                      f"{devices_label(e['devices'])}")
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


def _batch_norm_panel(ax, doc: dict[str, Any]) -> None:
    """Step time of GlobalBatchNormalization relative to Keras's synchronized BN, per model
    (absolute times differ 10x)."""
    pairs = batch_norm_pairs(doc)
    if not pairs:
        ax.text(0.5, 0.5, "GlobalBatchNormalization not available", ha="center")
        ax.set_axis_off()
        return
    labels = [MODEL_NAMES.get(model, model) for model, _, _ in pairs]
    xs = range(len(pairs))
    ax.bar([x - 0.2 for x in xs], [1.0] * len(pairs), 0.4, color="#999999",
           label="Keras BN (synchronized=True)")
    values = [1.0 / speedup(g, s) for _, s, g in pairs]
    intervals = [inverse(speedup_interval(g, s)) for _, s, g in pairs]
    ax.bar([x + 0.2 for x in xs], values, 0.4, yerr=_error_bars(values, intervals), capsize=3,
           color="#1f77b4", label="GlobalBatchNormalization (90% interval)")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("step time / Keras sync BN's")
    ax.legend(fontsize=7)
    ax.set_title(f"Cross-replica batch norm, {devices_label(pairs[0][1]['devices'])}")


def _throughput_panel(ax, doc: dict[str, Any]) -> None:
    """Examples/s of ours at each ``steps_per_execution``, and of the two-worker runs."""
    names, values, colors = [], [], []
    for e in doc["steps_per_execution"]:
        if e.get("available"):
            names.append(f"spe={e['steps_per_execution']}\n{devices_label(e['devices'])}")
            values.append(eps(e))
            colors.append("#1f77b4")
    for e in doc["multiworker"]:
        names.append(f"2 workers\n{'stock MWMS' if e.get('strategy') == 'stock' else 'ours'}")
        values.append(eps(e) if e.get("available") else 0.0)
        colors.append("#999999" if e.get("strategy") == "stock" else "#1f77b4")
    ax.bar(names, values, color=colors)
    ax.set_ylabel("examples/s")
    ax.set_title("steps_per_execution (ours) and 2 local workers")
    ax.tick_params(axis="x", labelsize=8)
