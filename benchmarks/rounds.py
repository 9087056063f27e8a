"""The rounds of a run: every group and configuration once per round, within a time limit.

A round runs every group once (its processes taking turns, ``processes.run_group``)
and every other configuration alone; odd rounds run the plan in reverse order.
Round 1 has a time limit: each group stops timing windows at its deadline
(:func:`group_deadline`), down to half of them. Rounds after the first are
skipped configuration by configuration once the run's budget is spent.
"""

from __future__ import annotations

import concurrent.futures
import math
import time
from typing import Any

from benchmarks.plan import Config, Settings, expected_seconds
from benchmarks.processes import run_group, run_worker


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
                deadline = group_deadline(first_round, unit, started, t0,
                                          settings.deadline_seconds)
            planned = max(int(c.spec["windows"]) for c in unit)
            outcomes = run_group([c.spec for c in unit], settings.timeout, deadline,
                                 min_windows=math.ceil(planned / 2))
            for config, outcome in zip(unit, outcomes):
                taken = windows_taken(outcome)
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


def group_deadline(units: list[list[Config]], unit: list[Config], started: float, now: float,
                   limit: float) -> float:
    """When ``unit`` (starting ``now``) must stop timing windows for round 1 to end by
    ``started + limit``: the end less what the units after it are expected to take,
    at the pace of the units before it (``expected_seconds``, never faster than it).
    A unit may thus use the time its predecessors saved; on a slow machine the pace
    leaves the later units their share too.
    """
    i = units.index(unit)
    done = sum(map(expected_seconds, units[:i]))
    pace = max(1.0, (now - started) / done) if done else 1.0
    return started + limit - pace * sum(map(expected_seconds, units[i + 1:]))


def windows_taken(result: dict[str, Any] | RuntimeError) -> int | None:
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
