"""When a tier saves a step: one policy protocol, and its three policies (every step, every n, Young-Daly).

A policy answers one question, in the spirit of Orbax's ``SaveDecisionPolicy``: is step ``step`` due, the
tier's previous save (or the step a run restarted from) being ``last``? The caller keeps ``last`` per tier
(:class:`elastic_runtime.core.ledger.StepLedger` does), so that a policy is a small callable shared by the RAM
snapshots, the disk and GCS tiers of the cascade, and the multi-process worker's durable checkpoints.

Young-Daly: a snapshot every step loses no work to a failure, but pays for a copy of the state every step.
With failures every M seconds on average and a copy costing C seconds, snapshots every tau seconds of
training lose about C/tau of the time to copying and tau/(2M) to re-doing work after a failure;
tau = sqrt(2*C*M) minimises the sum (Young 1974, Daly 2006). :class:`SnapshotCadence` measures the step time
and C (the extra time of a snapshotted step over the average step without a copy) as the run goes, and
turns tau into steps.
"""

from __future__ import annotations

import math
from typing import Protocol

__all__ = ["EveryN", "EveryStep", "SavePolicy", "SnapshotCadence"]

_SMOOTHING = 0.2  # weight of the newest measurement in the running averages
# A copy measured at no cost (the difference of two noisy step times) still costs something: without a
# floor the interval would fall to every step.
_MIN_COPY_S = 1e-4


class SavePolicy(Protocol):
    """Decides whether a tier saves a step."""

    def should_save(self, step: int, last: int) -> bool:
        """Whether ``step`` is due, the tier's newest save (or restart point) being step ``last``."""
        ...


class EveryStep:
    """Every step past the last save."""

    def should_save(self, step: int, last: int) -> bool:
        return step > last


class EveryN:
    """Each time the step crosses a multiple of ``n``.

    "Crosses" rather than "is": a tier fed only some steps (the disk, from a sparser RAM cadence) still
    saves one per multiple; with every step offered it is the same as ``step % n == 0``.
    """

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"a save cadence must be >= 1 step, got {n}")
        self.n = n

    def should_save(self, step: int, last: int) -> bool:
        return step // self.n > last // self.n


class SnapshotCadence:
    """``every`` steps after the last save; with ``mtbf_s``, at the Young-Daly interval, measured as it runs.

    Args:
        every: save every ``every`` steps; with ``mtbf_s``, only until the first copy is measured.
        mtbf_s: expected mean time between failures; None keeps ``every`` fixed.
    """

    def __init__(self, every: int, mtbf_s: float | None = None) -> None:
        if every < 1:
            raise ValueError(f"snapshot cadence must be >= 1 step, got {every}")
        if mtbf_s is not None and mtbf_s <= 0:
            raise ValueError(f"mean time between failures must be > 0 s, got {mtbf_s}")
        self.every = every
        self.mtbf_s = mtbf_s
        self._copy_s: float | None = None
        self._step_s: float | None = None

    def should_save(self, step: int, last: int) -> bool:
        return step - last >= self.every

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

    def _adapt(self) -> None:
        if self.mtbf_s is None or self._copy_s is None or not self._step_s:
            return
        interval_s = math.sqrt(2 * max(self._copy_s, _MIN_COPY_S) * self.mtbf_s)
        # At least every other step: a copy's cost is measured against the steps without one (a snapshot
        # every step is the copy compiled into the step: ``snapshot_every=1`` without an MTBF). On CPU devices no
        # copy is measured (a snapshot is the state itself): ``every`` stays as it was set.
        self.every = max(2, round(interval_s / self._step_s))


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - _SMOOTHING) * old + _SMOOTHING * new
