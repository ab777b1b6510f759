"""Group membership as a synchronous state machine: who is in the group, in which generation, which steps
the whole group has committed, who restores from whom, and where each superseded generation was fenced. No
processes, sockets or clocks: the controller (``runtime/cluster/controller.py``) drives it and turns its
answers into messages and events."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["JoinReport", "Membership", "RestorePlan"]


@dataclass(frozen=True)
class JoinReport:
    """What a member says when it has joined a generation: the newest step it can restore, and from where."""

    best_step: int
    tier: str  # "ram", "file", or "none"


@dataclass(frozen=True)
class RestorePlan:
    """The step a new generation starts from, and the member every other member takes it from."""

    step: int
    source: int  # process id in the new generation; -1 when starting from the initial state
    restored_from: str  # the source's tier, "+peer" when some member takes the state from another
    lost_steps: int  # committed steps that are run again


class Membership:
    """The group: members in process-id order, the generation, and the group's committed step.

    Args:
        size: the group's full size (``nprocs``).
        generation: the newest generation formed so far (a resumed run's, from its run folder); the next one
            formed is numbered after it.
        fences: superseded generations' fences so far (a resumed run's; see :attr:`fences`).
    """

    def __init__(self, size: int, *, generation: int = 0, fences: dict[int, int] | None = None) -> None:
        self.size = size
        self.members: list[int] = []
        self.generation = generation
        # generation -> the step the group went on from when a later generation replaced it: the newest step
        # of that generation that is part of the run's history. Anything it committed (or wrote) past its
        # fence is not: the group went on from the fence without it.
        self.fences: dict[int, int] = dict(fences or {})
        self.step = 0  # the newest step every member has committed
        self.high_water = 0  # the newest step the group ever committed (it moves back on a restore)

    def seat(self, survivors: Sequence[int], recruits: Sequence[int]) -> list[int]:
        """The next group in process-id order: survivors keep their process ids, recruits take the free ones.

        Stable ids mean the same device layout as before on every survivor, so each loads its step from the
        persistent compilation cache instead of compiling it again, and the numerics do not change.
        """
        seats: list[int | None] = [w if w in survivors else None for w in self.members]
        seats.extend([None] * max(0, self.size - len(seats)))
        queue = list(recruits)
        for i, worker in enumerate(seats):
            if worker is None and queue:
                seats[i] = queue.pop(0)
        return [w for w in seats if w is not None] + queue

    def new_generation(self, members: Sequence[int]) -> int:
        """Make ``members`` the group of a new generation; returns its number."""
        self.members = list(members)
        self.generation += 1
        return self.generation

    def plan_restore(self, reports: Sequence[JoinReport]) -> RestorePlan:
        """The newest step any member of the new generation holds (the lowest process id among equals)."""
        source = max(range(len(reports)), key=lambda i: (reports[i].best_step, -i))
        step = reports[source].best_step
        restored_from = "init" if reports[source].tier == "none" else reports[source].tier
        if any(r.best_step < step for r in reports):
            restored_from += "+peer"
        return RestorePlan(
            step=step,
            source=source if step > 0 else -1,
            restored_from=restored_from,
            lost_steps=max(0, self.high_water - step),
        )

    def restore(self, step: int) -> list[int]:
        """The group (of the current generation) starts again from ``step``: the run's history past ``step``
        is this generation's alone, so every earlier generation is fenced at ``step`` at the latest. Returns the
        steps it newly counts as committed: those the member restored from committed before the old group could
        report them all."""
        for older in range(1, self.generation):
            self.fences[older] = min(self.fences.get(older, step), step)
        gap = list(range(self.step + 1, step + 1))
        self.step = step
        self.high_water = max(self.high_water, step)
        return gap

    def progress(self, member_steps: Sequence[int]) -> list[int]:
        """Members report their committed steps. Returns the steps the whole group newly committed."""
        if not member_steps:
            return []
        newest = min(member_steps)
        done = list(range(self.step + 1, newest + 1))
        if done:
            self.step = newest
            self.high_water = max(self.high_water, newest)
        return done
