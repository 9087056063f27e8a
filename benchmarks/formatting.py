"""How the report writes figures: numbers, ratios, intervals, device counts."""

from __future__ import annotations

import math


def fmt(value: float | None, digits: int = 0) -> str:
    if value is None or not isinstance(value, (int, float)) or not math.isfinite(value):
        return "n/a"
    if digits == 0 and abs(value) < 10:
        digits = 2 if abs(value) < 1 else 1
    return f"{value:,.{digits}f}"


def fmt_ratio(r: float | None) -> str:
    return "n/a" if r is None else f"**{r:.2f}x**"


def fmt_interval(interval: tuple[float, float] | None) -> str:
    return "" if interval is None else f"; 90% interval {interval[0]:.2f}-{interval[1]:.2f}"


def devices_label(devices: int | str) -> str:
    return "all GPUs" if devices == "gpu" else f"{devices} CPU"
