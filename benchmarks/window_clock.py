"""The clock of a timed run: warm-up ticks, then timed windows, in turns if asked."""

from __future__ import annotations

import time

from benchmarks.protocol import take_turn


class WindowClock:
    """The clock of a timed run: ``warmup_ticks`` ticks, then ``windows`` windows
    of ``ticks_per_window`` ticks (a tick is a step, or ``steps_per_execution`` steps).

    Call :meth:`tick` at the end of every tick. With ``turns`` (see
    ``processes.run_group``) it prints ``TURN`` at the end of the warm-up and of
    every window and waits for the runner before going on, and each window is
    timed from the moment it resumed. Once the runner has said ``STOP``,
    :attr:`stopped` is true: the caller takes no more ticks.
    """

    def __init__(self, warmup_ticks: int, ticks_per_window: int, windows: int, turns: bool):
        self.warmup_ticks, self.ticks_per_window = warmup_ticks, ticks_per_window
        self.total_ticks = warmup_ticks + windows * ticks_per_window
        self.turns = turns
        self.times: list[float] = []  # the clock at the end of each tick
        self.starts: dict[int, float] = {}  # the start of the window after tick i
        self.wall: list[float] = []  # with turns: wall-clock ends and starts of pauses
        self.stopped = False

    def tick(self) -> None:
        now = time.perf_counter()
        self.times.append(now)
        tick = len(self.times) - 1
        after_warmup = tick - self.warmup_ticks + 1
        if after_warmup >= 0 and after_warmup % self.ticks_per_window == 0:
            if self.turns:
                self.wall.append(time.time())
                self.stopped = not take_turn()
                now = time.perf_counter()
                self.wall.append(time.time())
            self.starts[tick] = now

    def samples(self, units_per_tick: float) -> list[float]:
        """Units per second in each timed window."""
        k = self.ticks_per_window
        return [units_per_tick * k / (self.times[end] - self.starts[end - k])
                for end in range(self.warmup_ticks - 1 + k, len(self.times), k)]

    def window_intervals(self) -> list[list[float]]:
        """With turns: [start, end] of each timed window, wall clock (comparable across processes)."""
        return [[self.wall[i], self.wall[i + 1]] for i in range(1, len(self.wall) - 1, 2)]
