"""When to take a RAM snapshot: every k steps, or at the Young-Daly interval for an expected failure rate.

A snapshot every step loses no work to a failure, but pays for a copy of the state every step. With failures
every M seconds on average and a copy costing C seconds, snapshots every tau seconds of training lose about
C/tau of the time to copying and tau/(2M) to re-doing work after a failure; tau = sqrt(2*C*M) minimises the
sum (Young 1974, Daly 2006). The cadence measures C (the copy after a due step) and the step time as the run
goes, and turns tau into steps.
"""

from __future__ import annotations

import math

_SMOOTHING = 0.2  # weight of the newest measurement in the running averages


class SnapshotCadence:
    """Decides which steps are snapshotted.

    Args:
        every: snapshot every ``every`` steps; with ``mtbf_s``, only until the first copy is measured.
        mtbf_s: expected mean time between failures; None keeps ``every`` fixed.
    """

    def __init__(self, every: int, mtbf_s: float | None = None) -> None:
        if every < 1:
            raise ValueError(f"snapshot cadence must be >= 1 step, got {every}")
        if mtbf_s is not None and mtbf_s <= 0:
            raise ValueError(f"mean time between failures must be > 0 s, got {mtbf_s}")
        self.every = every
        self.mtbf_s = mtbf_s
        self.last = 0  # the newest snapshotted step (or the step a run restarted from)
        self._copy_s: float | None = None
        self._step_s: float | None = None

    def due(self, step: int) -> bool:
        return step - self.last >= self.every

    def taken(self, step: int, copy_s: float) -> None:
        """Step ``step`` was snapshotted; the copy took ``copy_s`` beyond the step."""
        self.last = step
        self._copy_s = _average(self._copy_s, copy_s)
        self._adapt()

    def stepped(self, step_s: float) -> None:
        """A step took ``step_s`` of computation."""
        self._step_s = _average(self._step_s, step_s)

    def restarted(self, step: int) -> None:
        """The run went back to (or on from) ``step``, whose state is held by a tier."""
        self.last = step

    def _adapt(self) -> None:
        if self.mtbf_s is None or self._copy_s is None or not self._step_s:
            return
        interval_s = math.sqrt(2 * self._copy_s * self.mtbf_s)
        self.every = max(1, round(interval_s / self._step_s))


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - _SMOOTHING) * old + _SMOOTHING * new
