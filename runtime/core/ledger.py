"""The step ledger: a training loop's committed step and data position, which tiers are due, and its recovery.

The single-controller executor and the multi-process worker keep the same books through it: a commit moves
the step and the data position on and says which tiers save it (:mod:`elastic_runtime.core.cadence` decides, one
policy per tier); a failure is classified once (:func:`elastic_runtime.core.classify.classify`) and counted by the
recovery tracker; a restore moves the step back (or, resuming, on) and restarts every tier's cadence there.
It is synchronous and owns no thread, no event loop and no clock of its own (the tracker's is injected), so
that its tests drive it through failures without processes; the loops around it publish what it returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from typing import NamedTuple

from elastic_runtime.core.cadence import SavePolicy
from elastic_runtime.core.classify import classify
from elastic_runtime.core.events import Event, Failure, RecoveryFailed, RecoveryStarted, StateRestored, StepFailed
from elastic_runtime.core.recovery import RecoveryTracker

__all__ = ["CommitNoted", "FailureNoted", "StepLedger"]


class CommitNoted(NamedTuple):
    """A commit, booked: the events it leaves to publish, and the tiers that save the step."""

    events: tuple[Event, ...]  # RecoveryCompleted when the commit ends a recovery
    due: tuple[str, ...]


class FailureNoted(NamedTuple):
    """A failed step, classified: its failure event, and the recovery it starts or joins."""

    event: Failure
    started: RecoveryStarted | None  # None for StepFailed: the user's error ends the run, nothing to recover


class StepLedger:
    """The books of one training loop.

    Args:
        source: the ``source`` of the events it makes (``executor``, ``worker``).
        max_failures: failures the run survives (the recovery tracker's budget).
        policies: tier name -> the policy that decides which steps it saves.
        at_dispatch: tiers whose copy is queued with a step, before its commit (the executor's RAM snapshot):
            their saves are recorded by :meth:`taken` alone; a commit decides the others.
        clock: monotonic clock of the recovery tracker, injectable for tests.
    """

    def __init__(
        self,
        source: str,
        *,
        max_failures: int = 0,
        policies: Mapping[str, SavePolicy] | None = None,
        at_dispatch: Collection[str] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source = source
        self.policies: dict[str, SavePolicy] = dict(policies or {})
        self.at_dispatch = frozenset(at_dispatch)
        self.recovery = RecoveryTracker(source, max_failures, clock)
        self.step = 0  # the newest committed step
        self.data_position = 0  # where the data of the step after it starts
        self.high_water = 0  # the newest step ever committed, before any rollback
        self._last: dict[str, int] = {}  # tier -> its newest save (or the step the run restarted from)

    @property
    def recovering(self) -> bool:
        return self.recovery.current is not None

    @property
    def over_budget(self) -> bool:
        return self.recovery.over_budget

    # --- saves -----------------------------------------------------------------------------------------

    def due(self, step: int) -> tuple[str, ...]:
        """The tiers whose policy wants ``step`` saved (asking changes nothing)."""
        return tuple(
            tier for tier, policy in self.policies.items() if policy.should_save(step, self._last.get(tier, 0))
        )

    def taken(self, tier: str, step: int) -> None:
        """``tier`` saves ``step``: its next save is due by its policy from there."""
        self._last[tier] = max(self._last.get(tier, 0), step)

    # --- the loop's milestones -------------------------------------------------------------------------

    def commit(self, step: int, *, data_position: int, mesh_shape: dict[str, int] | None = None) -> CommitNoted:
        """Step ``step`` is committed; the data of the next one starts at ``data_position``.

        The tiers due at it (but those decided at dispatch) count as saved whether the caller writes them or
        skips them (its writer busy, its lease lapsed): the next save comes at the policy's next step, not at
        the next commit.
        """
        due = tuple(tier for tier in self.due(step) if tier not in self.at_dispatch)
        for tier in due:
            self.taken(tier, step)
        completed = self.recovery.committed(step, mesh_shape or {})
        self.data_position = data_position
        self.high_water = max(self.high_water, step)
        self.step = step  # last: whoever reads the step finds the rest in place
        return CommitNoted(events=() if completed is None else (completed,), due=due)

    def fail(
        self,
        exc: BaseException,
        *,
        step: int,
        lost_devices: tuple[int, ...] = (),
        slices: tuple[int, ...] = (),
        slice_size: int = 1,
        at: float | None = None,
    ) -> FailureNoted:
        """Step ``step`` raised ``exc``: its failure event and, for an infrastructure failure, the
        ``RecoveryStarted`` of the recovery it starts (or joins, when one is under way). The committed step
        stays where it was; :attr:`over_budget` says whether the run survives it. ``at``: when it was seen."""
        event = classify(
            exc, step=step, lost_devices=lost_devices, slices=slices, slice_size=slice_size, source=self.source
        )
        if isinstance(event, StepFailed):
            return FailureNoted(event, None)
        started = self.recovery.fail(type(event).__name__, failed_step=step, last_committed_step=self.step, at=at)
        return FailureNoted(event, started)

    def restored(self, step: int, *, data_position: int, restored_from: str, seconds: float) -> StateRestored:
        """The state of ``step`` is in place, from ``restored_from`` (``init``: nothing held one). The loop goes
        on from there, every tier's cadence counts from there, and the first commit past it ends the
        recovery under way. Before the first commit (a resumed run) the step counts as committed already."""
        self.high_water = max(self.high_water, step)
        lost = self.high_water - step
        self.step, self.data_position = step, data_position
        self._last = dict.fromkeys(self.policies, step)
        self.recovery.restored(step, restored_from=restored_from, lost_steps=lost)
        return StateRestored(
            step=step, source=self.source, restored_from=restored_from, lost_steps=lost, seconds=seconds
        )

    def give_up(self, reason: str) -> RecoveryFailed:
        """The recovery cannot complete (over budget, nothing to restore, no handler resumed): the event that
        ends the run, at the newest committed step."""
        return RecoveryFailed(step=self.step, source=self.source, reason=reason, message=reason)
