"""One recovery at a time, from the failure to the first step committed past the restore point.

Shared by the single-controller executor and the multi-process controller, so that both count failures
and time recoveries the same way: every failure counts against the budget, including one that comes while
a recovery is already under way (it extends that recovery rather than starting a second one), and a
recovery ends only at a commit past the step it restored, never at a step the old group or mesh still
committed while the failure waited.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from elastic_runtime.core.events import RecoveryCompleted, RecoveryStarted
from elastic_runtime.core.retry import RetryState

__all__ = ["Recovery", "RecoveryTracker"]


@dataclass
class Recovery:
    """A recovery under way."""

    cause: str
    failed_step: int
    started: float  # monotonic time of the first failure it answers
    strategy: str = ""
    restore_step: int | None = None  # set by the restore; until then no commit ends the recovery
    restored_from: str = ""
    lost_steps: int = 0
    compile_wait_s: float = 0.0  # of its time, waiting for a program of the new mesh to compile


class RecoveryTracker:
    """Counts failures against a budget and turns the current recovery's milestones into events.

    Args:
        source: the ``source`` of the events it makes (``executor``, ``controller``).
        max_failures: failures the run survives; :attr:`over_budget` once more have come.
        clock: monotonic clock, injectable for tests.
    """

    def __init__(self, source: str, max_failures: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.source = source
        self.max_failures = max_failures
        self.clock = clock
        self.failures = 0
        self.current: Recovery | None = None
        self.step_attempts: dict[int, int] = {}  # step -> failed attempts at getting past it

    @property
    def over_budget(self) -> bool:
        return self.failures > self.max_failures

    def fail(
        self, cause: str, *, failed_step: int, last_committed_step: int, at: float | None = None
    ) -> RecoveryStarted:
        """Count a failure and return the ``RecoveryStarted`` that announces it. A failure during a recovery
        joins it: the recovery keeps the cause and start time of its first failure, and its restore starts
        over. ``at``: when the failure was seen (default: now)."""
        self.failures += 1
        if self.current is None:
            self.current = Recovery(cause=cause, failed_step=failed_step, started=self.clock() if at is None else at)
        else:
            self.current.restore_step = None
        return RecoveryStarted(
            step=failed_step, source=self.source, cause=cause, last_committed_step=last_committed_step
        )

    def attempt_failed(self, step: int) -> RetryState:
        """An attempt at getting past ``step`` failed (one per re-forming, not per lost member): the state a
        retry policy (:mod:`elastic_runtime.core.retry`) decides on."""
        self.step_attempts[step] = self.step_attempts.get(step, 0) + 1
        return RetryState(step=step, attempts=self.step_attempts[step], failures=self.failures)

    def restored(self, step: int, *, restored_from: str, lost_steps: int, strategy: str = "") -> None:
        """The state of ``step`` is in place: the first commit after it ends the recovery."""
        if self.current is not None:
            self.current.restore_step, self.current.restored_from = step, restored_from
            self.current.lost_steps, self.current.strategy = lost_steps, strategy

    def waited_for_compile(self, seconds: float) -> None:
        """Charge ``seconds`` of waiting for a compile to the recovery under way, if any."""
        if self.current is not None:
            self.current.compile_wait_s += seconds

    def committed(
        self,
        step: int,
        mesh_shape: dict[str, int],
        *,
        bytes_by_tier: dict[str, int] | None = None,
        read_s_by_tier: dict[str, float] | None = None,
        transfer_s: float = 0.0,
    ) -> RecoveryCompleted | None:
        """Step ``step`` was committed. Returns the ``RecoveryCompleted`` to publish when it ends a recovery (with
        what its restore read, per tier, where the caller knows it)."""
        recovery = self.current
        if recovery is None or recovery.restore_step is None or step <= recovery.restore_step:
            return None
        self.current = None
        return RecoveryCompleted(
            step=step,
            source=self.source,
            cause=recovery.cause,
            failed_step=recovery.failed_step,
            recovery_s=self.clock() - recovery.started,
            lost_steps=recovery.lost_steps,
            restored_from=recovery.restored_from,
            mesh_shape=mesh_shape,
            compile_wait_s=recovery.compile_wait_s,
            bytes_by_tier=dict(bytes_by_tier or {}),
            read_s_by_tier={tier: round(s, 4) for tier, s in (read_s_by_tier or {}).items()},
            transfer_s=round(transfer_s, 4),
        )
