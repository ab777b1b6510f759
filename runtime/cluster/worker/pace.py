"""A worker's pace: how long its iterations take, and how much of each it spent outside the step's collectives (its
own work: reading data, host code, its writes). In a synchronous group every member's iteration takes as long as
the slowest member's, the others waiting for it inside the collectives: the time outside them is what tells a
straggler (controller/heartbeat.py compares it across the group). A device slow inside the compiled step is not
told apart this way: every process waits for it in the same program."""

from __future__ import annotations

__all__ = ["Pace"]


class Pace:
    """The newest whole iteration of a worker: ``iteration_s`` (from one step's start to the next's) and
    ``outside_s`` (of it, the seconds not spent in collectives). None until two steps in a row of one generation
    ran (an iteration across a re-forming says nothing about the worker)."""

    def __init__(self) -> None:
        self.iteration_s: float | None = None
        self.outside_s: float | None = None
        self._last: tuple[int, int, float, float] | None = None  # generation, step, its start, its collectives' time

    def record(self, generation: int, step: int, began: float, waited: float) -> None:
        """Step ``step`` of ``generation`` began at ``began`` (perf_counter) and spent ``waited`` in collectives."""
        last = self._last
        if last is not None and last[:2] == (generation, step - 1):
            self.iteration_s = began - last[2]
            self.outside_s = max(0.0, self.iteration_s - last[3])
        self._last = (generation, step, began, waited)

    def exclude(self, seconds: float) -> None:
        """Count ``seconds`` of the current iteration as not the worker's own pace (like a collective's wait): work
        only its role does (the first slice writes the durable checkpoint), which a replacement would do too."""
        if self._last is not None:
            generation, step, began, waited = self._last
            self._last = (generation, step, began, waited + seconds)
