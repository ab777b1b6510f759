"""Group membership as a synchronous state machine: who is in the group, in which generation, which steps
the whole group has committed, who restores from whom, and where each superseded generation was fenced. No
processes, sockets or clocks: the controller (``runtime/cluster/controller/shell.py``) drives it and turns its
answers into messages and events."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from elastic_runtime.cluster.tiers import Tier

__all__ = ["JoinReport", "Membership", "RestorePlan"]


@dataclass(frozen=True)
class JoinReport:
    """What a member says when it has joined a generation: the newest step it can restore, and from where."""

    best_step: int
    tier: Tier  # where its ``best_step`` is: RAM, SHM, DISK, DURABLE or NONE
    steps: tuple[int, ...] = ()  # every step it can restore; empty: only ``best_step`` (unless tier is "none")
    durable_only: tuple[int, ...] = ()  # of ``steps``, those whose shards it would read from the durable tier
    neighbour_step: int = 0  # the step of the previous process's shards it holds in RAM; 0: none

    def holds(self) -> set[int]:
        return set(self.steps) | ({self.best_step} if self.tier != Tier.NONE else set())

    def local(self) -> set[int]:
        """The steps it holds in its own memory or files (not only in the durable tier)."""
        return self.holds() - set(self.durable_only)


@dataclass(frozen=True)
class RestorePlan:
    """The step a new generation starts from, and the slice every member takes its shards from."""

    step: int
    source: int  # slice index in the new generation (its process id with one process a slice); -1: initial state
    restored_from: str  # the source's tier, "+peer" when some member takes the state from another
    lost_steps: int  # committed steps that are run again
    # Why the group goes back to the initial state though it committed steps: what is missing (no slice holds
    # one step whole, or no member holds any). "" when it restores a committed step, or has committed none.
    fallback: str = ""
    # Positions in the source slice whose shards come from the next process's neighbour replica.
    from_neighbour: tuple[int, ...] = ()


class Membership:
    """The group: members in process-id order, the generation, and the group's committed step.

    Args:
        size: the group's full size (``nprocs``).
        slice_size: processes per slice; the group is always made of whole slices (process ids
            ``k * slice_size`` to ``k * slice_size + slice_size - 1`` are slice ``k``).
        generation: the newest generation formed so far (a resumed run's, from its run folder); the next one
            formed is numbered after it.
        fences: superseded generations' fences so far (a resumed run's; see :attr:`fences`).
    """

    def __init__(
        self, size: int, slice_size: int = 1, *, generation: int = 0, fences: dict[int, int] | None = None
    ) -> None:
        self.size = size
        self.slice_size = slice_size
        self.members: list[int] = []
        self.generation = generation
        # generation -> the step the group went on from when a later generation replaced it: the newest step
        # of that generation that is part of the run's history. Anything it committed (or wrote) past its
        # fence is not: the group went on from the fence without it.
        self.fences: dict[int, int] = dict(fences or {})
        self.step = 0  # the newest step every member has committed
        self.high_water = 0  # the newest step the group ever committed (it moves back on a restore)
        self._member_set: set[int] = set()
        # Each member's newest committed step since the restore, and how many members are at each step: the
        # group's step is the smallest, found without looking at every member on every report (``report``).
        self._steps: dict[int, int] = {}
        self._at: Counter[int] = Counter()

    def has(self, worker: int) -> bool:
        """Whether ``worker`` is a member of the current generation."""
        return worker in self._member_set

    def seat(self, survivors: Sequence[int], recruits: Sequence[int]) -> list[int]:
        """The next group in process-id order: survivors keep their process ids, recruits take the free ones,
        and a slice with a seat nobody fills is left out whole (its survivors wait for a replacement).

        Stable ids mean the same device layout as before on every survivor, so each loads its step from the
        persistent compilation cache instead of compiling it again, and the numerics do not change.
        """
        alive = set(survivors)
        seats: list[int | None] = [w if w in alive else None for w in self.members]
        seats.extend([None] * max(0, self.size - len(seats)))
        queue = iter(recruits)
        for i, worker in enumerate(seats):
            if worker is None:
                seats[i] = next(queue, None)
        seated: list[int | None] = [*seats, *queue]
        if self.slice_size == 1:
            seated = [w for w in seated if w is not None]
        n = self.slice_size
        slices = [seated[k : k + n] for k in range(0, len(seated) - n + 1, n)]
        return [w for members in slices if None not in members for w in members if w is not None]

    def new_generation(self, members: Sequence[int]) -> int:
        """Make ``members`` the group of a new generation; returns its number."""
        self.members = list(members)
        self._member_set = set(members)
        self._steps.clear()
        self._at.clear()
        self.generation += 1
        return self.generation

    def take_seat(self, lost: int, spare: int) -> int:
        """``spare`` takes ``lost``'s seat in the current generation (before it formed); returns the seat."""
        seat = self.members.index(lost)
        self.members[seat] = spare
        self._member_set.discard(lost)
        self._member_set.add(spare)
        return seat

    def plan_restore(self, reports: Sequence[JoinReport]) -> RestorePlan:
        """The newest step every process of some slice holds, from that slice (among equals, the one with the
        most processes holding it in memory, then the lowest index).

        A process holds a step in its own memory or files, in the durable tier, or (with neighbour replicas)
        in the RAM of the next process of its slice. A process takes its shards from the neighbour when it
        holds the step nowhere but the durable tier: the neighbour's RAM is the faster source.

        ``reports`` are the members' in process-id order. With one process per slice this is the newest step
        any member holds. When no slice holds a committed step whole (its processes at different steps, a
        process's shards lost everywhere), the group goes back to the initial state (``init`` is deterministic:
        the run loses its steps, not its job), and the plan's ``fallback`` says what was missing.
        """
        n = self.slice_size
        best: tuple[int, int] = (0, 0)  # (step, processes restoring it from memory), the larger the better
        source = -1
        from_neighbour: tuple[int, ...] = ()
        for k in range(len(reports) // n):
            members = reports[k * n : (k + 1) * n]
            kept = [members[(i + 1) % n].neighbour_step if n > 1 else 0 for i in range(n)]  # by the next one
            candidates = {s for r in members for s in r.holds()} | set(kept)
            whole = [s for s in candidates if all(s in r.holds() or kept[i] == s for i, r in enumerate(members))]
            step = max(whole, default=0)
            in_memory = sum(r.tier == Tier.RAM and r.best_step == step for r in members)
            if step > 0 and (step, in_memory) > best:
                best, source = (step, in_memory), k
                from_neighbour = tuple(i for i, r in enumerate(members) if step not in r.local() and kept[i] == step)
        best_step = best[0]
        lost_steps = max(0, self.high_water - best_step)
        if source < 0:
            held_any = sorted({s for r in reports for s in r.holds() if s > 0})
            fallback = ""
            if not held_any and self.high_water > 0:
                fallback = (
                    f"the group committed step {self.high_water}, but no member holds any step of this run "
                    "(replicas lost, fenced or unreadable; durable steps withdrawn)"
                )
            elif held_any:
                newest = held_any[-1]
                lacking = [i for i, r in enumerate(reports) if newest not in r.holds()]
                fallback = (
                    f"no slice holds one step whole: the shards of process(es) {lacking} at step {newest} are "
                    f"nowhere (members hold {[(i, sorted(r.holds())) for i, r in enumerate(reports)]} "
                    "as (process, steps))"
                )
            return RestorePlan(step=0, source=-1, restored_from="init", lost_steps=lost_steps, fallback=fallback)
        # Where the source slice's processes take their shards: "ram", a replica file ("shm", "disk", or "file"
        # when not its newest), "durable", or the next process's "neighbour" copy.
        sources = reports[source * n : (source + 1) * n]

        def tier_of(position: int, report: JoinReport) -> Tier:
            if position in from_neighbour:
                return Tier.NEIGHBOUR
            if best_step in report.durable_only:
                return Tier.DURABLE
            return report.tier if report.best_step == best_step else Tier.FILE

        used = {tier_of(i, r) for i, r in enumerate(sources)}
        restored_from = "+".join(sorted(used))
        taking = {source * n + i for i in from_neighbour}
        if any(best_step not in r.holds() for i, r in enumerate(reports) if i not in taking):
            restored_from += "+peer"
        return RestorePlan(
            step=best_step,
            source=source,
            restored_from=restored_from,
            lost_steps=lost_steps,
            from_neighbour=from_neighbour,
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
        self._steps = dict.fromkeys(self.members, step)
        self._at = Counter({step: len(self.members)}) if self.members else Counter()
        return gap

    def report(self, worker: int, step: int) -> list[int]:
        """Member ``worker`` committed ``step`` (after :meth:`restore`). Returns the steps the whole group newly
        committed. O(1) a report: the group's step moves only when the last member at it moves on."""
        old = self._steps.get(worker)
        if old is None or step <= old:
            return []
        self._steps[worker] = step
        self._at[step] += 1
        self._at[old] -= 1
        if self._at[old]:
            return []
        del self._at[old]
        return self._advance(min(self._at))

    def progress(self, member_steps: Sequence[int]) -> list[int]:
        """Members report their committed steps. Returns the steps the whole group newly committed."""
        if not member_steps:
            return []
        return self._advance(min(member_steps))

    def _advance(self, newest: int) -> list[int]:
        done = list(range(self.step + 1, newest + 1))
        if done:
            self.step = newest
            self.high_water = max(self.high_water, newest)
        return done
