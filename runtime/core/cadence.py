"""When to take a RAM snapshot: every k steps, or at the Young-Daly interval for an expected failure rate.

A snapshot every step loses no work to a failure, but pays for a copy of the state every step. With failures
every M seconds on average and a copy costing C seconds, snapshots every tau seconds of training lose about
C/tau of the time to copying and tau/(2M) to re-doing work after a failure; tau = sqrt(2*C*M) minimises the
sum (Young 1974, Daly 2006). The cadence measures the step time and C (the extra time of a snapshotted step
over the average step without a copy) as the run goes, and turns tau into steps.
"""

from __future__ import annotations

import math

_SMOOTHING = 0.2  # weight of the newest measurement in the running averages
# A copy measured at no cost (the difference of two noisy step times) still costs something: without a
# floor the interval would fall to every step.
_MIN_COPY_S = 1e-4


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

    def taken(self, step: int) -> None:
        """Step ``step`` is being snapshotted (the next one is due ``every`` steps later)."""
        self.last = step

    def copied(self, copy_s: float) -> None:
        """A snapshot's copy cost ``copy_s`` beyond its step."""
        self._copy_s = _average(self._copy_s, copy_s)
        self._adapt()

    def stepped(self, step_s: float) -> None:
        """A step without a snapshot took ``step_s`` of computation."""
        self._step_s = _average(self._step_s, step_s)

    @property
    def step_s(self) -> float | None:
        """The running average of a step without a snapshot; None before the first."""
        return self._step_s

    def restarted(self, step: int) -> None:
        """The run went back to (or on from) ``step``, whose state is held by a tier."""
        self.last = step

    def _adapt(self) -> None:
        if self.mtbf_s is None or self._copy_s is None or not self._step_s:
            return
        interval_s = math.sqrt(2 * max(self._copy_s, _MIN_COPY_S) * self.mtbf_s)
        # At least every other step: a copy's cost is measured against the steps without one (a snapshot
        # every step is the copy compiled into the step: ``snapshot_every=1`` without an MTBF).
        self.every = max(2, round(interval_s / self._step_s))


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - _SMOOTHING) * old + _SMOOTHING * new
