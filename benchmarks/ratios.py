"""Ratios between two entries of a run's JSON, paired window by window when they took turns.

Entries of one group took turns window by window (``processes.run_group``), so
their ratio is the median of the ratios of their windows side by side, which
cancels the machine's drift; :func:`median_interval` gives its distribution-free
90% interval. Other ratios are ratios of medians.
"""

from __future__ import annotations

import math
import statistics


def eps(entry: dict | None) -> float | None:
    return entry.get("examples_per_second") if entry else None


def window_ratios(a: dict, b: dict, a_windows, b_windows) -> list[float] | None:
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
    ratios = window_ratios(a, b, a_windows, b_windows)
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


def speedup(a: dict | None, b: dict | None) -> float | None:
    """Throughput of training entry ``a`` over ``b`` (paired when they took turns)."""
    if not a or not b:
        return None
    return _paired_ratio(a, b, a.get("window_samples"), b.get("window_samples"), eps(a), eps(b))


def speedup_interval(a: dict | None, b: dict | None) -> tuple[float, float] | None:
    """90% interval of ``speedup(a, b)`` when ``a`` and ``b`` took turns, else None."""
    if not a or not b:
        return None
    ratios = window_ratios(a, b, a.get("window_samples"), b.get("window_samples"))
    return median_interval(ratios) if ratios else None


def inverse(interval: tuple[float, float] | None) -> tuple[float, float] | None:
    """The interval of ``1 / r`` from that of ``r`` (a speed-up's, as a step-time ratio's)."""
    return None if interval is None else (1.0 / interval[1], 1.0 / interval[0])


def _size_windows(a: dict, b: dict, mb: str, series: str = "") -> list:
    """All-reduce entries ``a`` and ``b``'s window figures at size ``mb``.

    ``series``: ``""`` for the main figures (several all-reduces per call),
    ``"_one_per_call"`` for those timed one all-reduce per call."""
    return [e.get("window_samples" + series, {}).get(mb) for e in (a, b)]


def bandwidth_ratio(a: dict | None, b: dict | None, mb: str, series: str = "") -> float | None:
    """All-reduce bandwidth of entry ``a`` over ``b`` at size ``mb`` (paired when they took turns)."""
    if not a or not b:
        return None
    return _paired_ratio(a, b, *_size_windows(a, b, mb, series),
                         a.get("gbps" + series, {}).get(mb), b.get("gbps" + series, {}).get(mb))


def bandwidth_interval(a: dict | None, b: dict | None, mb: str,
                       series: str = "") -> tuple[float, float] | None:
    """90% interval of ``bandwidth_ratio(a, b, mb, series)`` when they took turns, else None."""
    if not a or not b:
        return None
    ratios = window_ratios(a, b, *_size_windows(a, b, mb, series))
    return median_interval(ratios) if ratios else None
