"""When a step that keeps failing is tried again, and when the run gives up on it.

A policy is a small callable over one :class:`RetryState` (tenacity's shape): it returns the seconds to wait
before the next attempt, or ``None`` to give up. The caller owns the clock and the sleep, so a policy is
tested without waiting.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Backoff", "RetryPolicy", "RetryState"]


@dataclass(frozen=True)
class RetryState:
    """One more attempt at getting past ``step`` failed.

    Attributes:
        step: the step the group was running when it failed.
        attempts: failed attempts at ``step`` so far, this one included (one per re-forming, however many
            members it lost).
        failures: every failure of the run so far (lost members), this one included.
    """

    step: int
    attempts: int
    failures: int


RetryPolicy = Callable[[RetryState], "float | None"]


@dataclass(frozen=True)
class Backoff:
    """Try a failed step again at once, then after ``base_s``, ``2 * base_s``, ... (at most ``max_s``);
    give up once it failed ``attempts`` times.

    The first retry is immediate: one lost worker is the common case and must cost no waiting. A step that
    fails again is more likely to fail for a reason a retry does not fix (its data, its program, the host),
    so each further attempt waits longer, and the run ends rather than loop.
    """

    attempts: int = 3
    base_s: float = 0.5
    max_s: float = 10.0

    def __call__(self, state: RetryState) -> float | None:
        if state.attempts >= self.attempts:
            return None
        if state.attempts <= 1:
            return 0.0
        return min(self.max_s, self.base_s * 2 ** (state.attempts - 2))
