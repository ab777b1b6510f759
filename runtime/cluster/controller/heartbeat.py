"""The heartbeat monitor: from workers' (step, time) reports, decide who is lost, hung or straggling.

The core, :class:`HeartbeatMonitor`, is synchronous and reads time only from an injected clock, so its
tests run without waiting. :func:`watch` is the thin async shell the controller runs: it calls
:meth:`HeartbeatMonitor.check` every ``interval`` seconds and publishes the verdicts as events.

- lost: no heartbeat for ``timeout_s`` while the worker trains (kill -9, lost host), or for ``start_timeout_s``
  before it has committed a step in its group (starting, joining, restoring, compiling: where long silences
  were seen), or the controller saw the worker's connection or process end (:meth:`HeartbeatMonitor.mark_gone`),
  which it reports at the next check without waiting. A silent worker whose process the controller sees
  running (``alive``: it started it on this machine) is late, not lost, until ``hang_timeout_s`` of silence:
  on one machine a lost worker is an exited process or a closed connection, and a loaded machine delays a
  live one's heartbeats past a short timeout (seen on CI);
- hung: heartbeats still arrive but the committed step has not moved for ``hang_timeout_s`` while progress is
  expected (a stuck collective, a deadlock);
- straggler: the group would step ``straggler_factor`` times faster or more without the worker: its recent time
  outside the step's collectives (its own work: data, host code, writes) exceeds the group's median by that much
  of the group's iteration (worker/pace.py says why the time outside, not the step's time, tells it).

Each verdict is given once per worker; :meth:`HeartbeatMonitor.forget` or :meth:`HeartbeatMonitor.register`
resets it.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

import anyio

from elastic_runtime.core.events import Event, Straggler, WorkerHung, WorkerLost

log = logging.getLogger(__name__)

Clock = Callable[[], float]
Watching = Literal["training", "starting", "idle", "unwatched"]  # how a worker is judged (``HeartbeatMonitor.watch``)

# How often the group's step times are compared (stragglers): a median over every worker is O(N), not for
# every check.
_STRAGGLER_CHECK_S = 1.0


class UnknownWorker(KeyError):
    """A heartbeat named a worker id the monitor was never told about (or has forgotten)."""


@dataclass(frozen=True)
class Lost:
    worker: int
    silent_s: float
    reason: str
    detected_by: str = "heartbeat"  # or the scheduler that reported it first (``mark_gone``)


@dataclass(frozen=True)
class Hung:
    worker: int
    stalled_s: float
    step: int


@dataclass(frozen=True)
class Straggling:
    worker: int
    slowdown: float  # the group's iteration / what it would be without the worker
    excess_s: float  # per iteration: the worker's time outside the collectives less the group's median
    iteration_s: float  # the group's iteration with the worker (its own: inside the collectives and outside)


Verdict = Lost | Hung | Straggling


@dataclass
class _Worker:
    last_seen: float
    step: int = -1
    progress_at: float = 0.0  # when ``step`` last changed, or progress was (re-)expected
    expect_progress: bool = False
    # Not yet past ``start_step`` since it was registered or its group formed: watched with the start timeout.
    starting: bool = True
    start_step: int = -1
    gone: str = ""  # why the controller knows it is gone, if it does
    gone_by: str = "heartbeat"  # which signal said so first
    iterations: deque[float] = field(default_factory=lambda: deque(maxlen=8))
    outsides: deque[float] = field(default_factory=lambda: deque(maxlen=8))  # of each, outside the collectives
    reported: bool = False  # lost or hung was reported
    straggler_reported_at: float = -1e18


class HeartbeatMonitor:
    """Tracks the liveness and progress of every registered worker.

    Args:
        timeout_s: silence after which a training worker is lost (JAX's own default is 100 s; the controller's 1 s).
        start_timeout_s: the same for a worker that has not committed a step in its group yet; never shorter
            than ``timeout_s``; None: ``timeout_s``.
        hang_timeout_s: how long a worker that still sends heartbeats may make no step progress.
        straggler_factor: a worker without which the group would step this many times faster is a straggler.
        straggler_min_s: ... and only when it costs the group at least this much per iteration (noise floor).
        straggler_every_s: report the same straggler at most this often.
        alive: whether a silent worker's process is known to run (and is not stopped); None: nothing is known,
            silence alone decides.
        clock: monotonic seconds; injected in tests.

    Raises:
        ValueError: a non-positive timeout or a factor <= 1.
    """

    def __init__(
        self,
        *,
        timeout_s: float = 2.0,
        start_timeout_s: float | None = None,
        hang_timeout_s: float = 5.0,
        straggler_factor: float = 1.5,
        straggler_min_s: float = 0.05,
        straggler_every_s: float = 30.0,
        alive: Callable[[int], bool] | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        if timeout_s <= 0 or hang_timeout_s <= 0:
            raise ValueError(f"timeouts must be > 0, got timeout_s={timeout_s}, hang_timeout_s={hang_timeout_s}")
        if straggler_factor <= 1:
            raise ValueError(f"straggler_factor must be > 1, got {straggler_factor}")
        self.timeout_s = timeout_s
        self.start_timeout_s = max(start_timeout_s or timeout_s, timeout_s)
        self.hang_timeout_s = hang_timeout_s
        self.straggler_factor = straggler_factor
        self.straggler_min_s = straggler_min_s
        self.straggler_every_s = straggler_every_s
        self.alive = alive
        self.clock = clock
        self._workers: dict[int, _Worker] = {}
        # Watched workers (no verdict yet) by their last heartbeat, oldest first, training and starting apart
        # (each with its timeout); those expected to progress by their last progress; those known to be gone.
        self._training_by_seen: OrderedDict[int, None] = OrderedDict()
        self._starting_by_seen: OrderedDict[int, None] = OrderedDict()
        self._by_progress: OrderedDict[int, None] = OrderedDict()
        self._gone: dict[int, None] = {}
        self._late: dict[int, None] = {}  # silent past their timeout, but their process runs (``alive``)
        self._lost: set[int] = set()  # found lost, not forgotten (nor registered) since
        self._stragglers_due = -math.inf
        # The longest silence between two heartbeats of a watched worker: how close the run came to a false
        # "lost" (the timeout's margin, for choosing it), whether or not a verdict followed; and the same for
        # training workers only (``timeout_s``'s margin).
        self.longest_gap_s = 0.0
        self.longest_training_gap_s = 0.0

    @property
    def workers(self) -> tuple[int, ...]:
        return tuple(sorted(self._workers))

    def register(self, worker: int) -> None:
        """Start watching ``worker`` (its silence is timed from now)."""
        self._workers[worker] = _Worker(last_seen=self.clock())
        self._training_by_seen.pop(worker, None)
        self._starting_by_seen[worker] = None
        self._starting_by_seen.move_to_end(worker)
        self._by_progress.pop(worker, None)
        self._gone.pop(worker, None)
        self._late.pop(worker, None)
        self._lost.discard(worker)

    def forget(self, worker: int) -> None:
        """Stop watching ``worker`` (it was replaced or finished). Unknown ids are ignored."""
        self._workers.pop(worker, None)
        self._training_by_seen.pop(worker, None)
        self._starting_by_seen.pop(worker, None)
        self._by_progress.pop(worker, None)
        self._gone.pop(worker, None)
        self._late.pop(worker, None)
        self._lost.discard(worker)

    def starting(self, worker: int) -> None:
        """``worker`` joins a new group (or ends its run): its silences are judged against the start timeout
        until it reports a step past the one its group restored (:meth:`expect_progress`'s ``from_step``)."""
        entry = self._workers.get(worker)
        if entry is not None:
            self._set_starting(worker, entry, True)

    def expect_progress(self, worker: int, expected: bool = True, *, from_step: int | None = None) -> None:
        """Whether ``worker`` should be committing steps now (not while its group re-forms or after it ends).

        ``from_step``: the step its group restored (None: the step it reported last); a starting worker
        trains once it reports a step past it.
        """
        entry = self._workers.get(worker)
        if entry is not None:
            entry.expect_progress = expected
            entry.progress_at = self.clock()
            entry.start_step = entry.step if from_step is None else from_step
            self._by_progress.pop(worker, None)
            if expected and not entry.reported:
                self._by_progress[worker] = None  # the newest progress_at: last in order

    def watch(self, worker: int, how: Watching, from_step: int | None = None) -> None:
        """Judge ``worker`` as ``how`` from now: the supervisor's ``Watch`` action. ``training``: it commits steps
        past ``from_step`` (its group's restored step); ``starting``: it joins, restores and compiles (the start
        timeout, no progress expected); ``idle``: its group is not training (silence only); ``unwatched``: it
        was replaced or left."""
        match how:
            case "training":
                self.expect_progress(worker, True, from_step=from_step)
            case "starting":
                self.expect_progress(worker, False)
                self.starting(worker)
            case "idle":
                self.expect_progress(worker, False)
            case "unwatched":
                self.forget(worker)

    def observe(self, worker: int, step: int, pace: tuple[float, float] | None = None) -> None:
        """Record a heartbeat with the worker's newest iteration and its time outside collectives (``pace``).
        Raises UnknownWorker for an id that is not registered."""
        entry = self._workers.get(worker)
        if entry is None:
            raise UnknownWorker(worker)
        now = self.clock()
        watched = self._starting_by_seen if entry.starting else self._training_by_seen
        if worker in self._late:  # heard from again: watched again, last in its order
            del self._late[worker]
            watched[worker] = None
        if worker in watched:
            self.longest_gap_s = max(self.longest_gap_s, now - entry.last_seen)
            if not entry.starting:
                self.longest_training_gap_s = max(self.longest_training_gap_s, now - entry.last_seen)
            watched.move_to_end(worker)
        entry.last_seen = now
        if entry.starting and entry.expect_progress and step > entry.start_step:
            self._set_starting(worker, entry, False)  # it trains: the short timeout from now on
        if step != entry.step:
            entry.step = step
            entry.progress_at = now
            if worker in self._by_progress:
                self._by_progress.move_to_end(worker)
            if pace is not None and min(pace) >= 0:
                entry.iterations.append(pace[0])
                entry.outsides.append(pace[1])

    def mark_gone(self, worker: int, reason: str, *, detected_by: str = "heartbeat") -> None:
        """The controller knows ``worker`` is gone (its connection closed or its process exited), or a scheduler
        said so (``detected_by="ray"``). The first signal wins: a later one, or one after the verdict, is
        ignored."""
        entry = self._workers.get(worker)
        if entry is not None and not entry.gone and not entry.reported:
            entry.gone, entry.gone_by = reason, detected_by
            self._gone[worker] = None

    def losing(self, silent_s: float) -> bool:
        """Whether more losses may be on their way: a worker found lost is not forgotten yet (its verdict is
        still on its way to the supervisor), or a watched one has sent nothing for ``silent_s`` or more. O(1)."""
        if self._lost:
            return True
        now = self.clock()
        for watched, _ in self._silence_orders():
            oldest = next(iter(watched), None)
            if oldest is not None and now - self._workers[oldest].last_seen >= silent_s:
                return True
        return False

    def next_silence_due(self) -> float:
        """When the oldest silence comes to its timeout (clock time; infinity when none is watched): the watch
        checks then rather than up to its interval later."""
        due = math.inf
        for watched, timeout_s in self._silence_orders():
            oldest = next(iter(watched), None)
            if oldest is not None:
                due = min(due, self._workers[oldest].last_seen + timeout_s)
        for worker in self._late:
            due = min(due, self._workers[worker].last_seen + self.hang_timeout_s)
        return due

    def _silence_orders(self) -> tuple[tuple[OrderedDict[int, None], float], ...]:
        """The watched workers by last heartbeat, each order with the timeout of its silences."""
        return (self._training_by_seen, self.timeout_s), (self._starting_by_seen, self.start_timeout_s)

    def _set_starting(self, worker: int, entry: _Worker, starting: bool) -> None:
        """Move ``worker`` between the training and the starting order (if watched). A move appends it: to
        the training order when it was just heard from (its place), to the starting order when it joins a new
        group, where the workers heard from after it pass it within a heartbeat interval, so that a verdict on
        it comes at most that late."""
        if entry.starting == starting:
            return
        entry.starting = starting
        training, start = self._training_by_seen, self._starting_by_seen
        source, target = (training, start) if starting else (start, training)
        if worker in source:
            del source[worker]
            target[worker] = None

    def check(self) -> list[Verdict]:
        """Verdicts that became true since the last check, at most one lost-or-hung per worker.

        It looks only at the workers with a verdict due: the watched ones are kept in the order of their last
        heartbeat (and of their last progress), so the check stops at the first one still in time. Its cost
        does not grow with the group; each heartbeat's is O(1).
        """
        now = self.clock()
        verdicts: list[Verdict] = []
        for worker in list(self._gone):
            entry = self._report(worker)
            self._lost.add(worker)
            verdicts.append(Lost(worker, now - entry.last_seen, entry.gone, entry.gone_by))
        for watched, timeout_s in self._silence_orders():
            while watched:
                worker = next(iter(watched))
                silent = now - self._workers[worker].last_seen
                if silent < timeout_s:
                    break
                if self.alive is not None and silent < self.hang_timeout_s and self.alive(worker):
                    del watched[worker]
                    self._late[worker] = None
                    continue
                self._report(worker)
                self._lost.add(worker)
                verdicts.append(Lost(worker, silent, f"no heartbeat for {silent:.2f} s"))
        for worker in list(self._late):  # few: a late heartbeat is rare
            silent = now - self._workers[worker].last_seen
            assert self.alive is not None  # only ``alive`` makes a worker late
            runs = self.alive(worker)
            if runs and silent < self.hang_timeout_s:
                continue
            self._report(worker)
            self._lost.add(worker)
            why = f"no heartbeat for {silent:.2f} s" + (" though its process runs" if runs else "")
            verdicts.append(Lost(worker, silent, why))
        while self._by_progress:
            worker = next(iter(self._by_progress))
            entry = self._workers[worker]
            if now - entry.progress_at < self.hang_timeout_s:
                break
            self._report(worker)
            verdicts.append(Hung(worker, now - entry.progress_at, entry.step))
        if now >= self._stragglers_due:
            self._stragglers_due = now + _STRAGGLER_CHECK_S
            verdicts.extend(self._stragglers(now))
        return verdicts

    def _report(self, worker: int) -> _Worker:
        """``worker`` gets its verdict: it is watched no more for loss or hang."""
        entry = self._workers[worker]
        entry.reported = True
        self._training_by_seen.pop(worker, None)
        self._starting_by_seen.pop(worker, None)
        self._by_progress.pop(worker, None)
        self._gone.pop(worker, None)
        self._late.pop(worker, None)
        return entry

    def _stragglers(self, now: float) -> list[Straggling]:
        # Medians over each worker's window: a stall of one iteration (a loaded machine, a durable write) is not
        # a straggler, a slowdown of most of them is. The group's pace without a worker is the usual time outside
        # the collectives plus the worker's own time inside them: it arrives last, so that time is compute, no
        # wait. (Its iterations, taken alone, mix paces while a slowdown starts, and overstated it 10-30x.)
        paced = {
            w: (
                statistics.median(i - o for i, o in zip(e.iterations, e.outsides, strict=True)),
                statistics.median(e.outsides),
            )
            for w, e in self._workers.items()
            if len(e.outsides) >= 3 and not e.reported
        }
        if len(paced) < 3:  # a median of two says nothing about which one is slow
            return []
        usual = statistics.median(o for _, o in paced.values())
        found = []
        for worker, (inside, outside) in paced.items():
            excess = outside - usual
            slowdown = (inside + outside) / max(inside + usual, 1e-9)
            entry = self._workers[worker]
            slow = slowdown >= self.straggler_factor and excess >= self.straggler_min_s
            if slow and now - entry.straggler_reported_at >= self.straggler_every_s:
                entry.straggler_reported_at = now
                found.append(Straggling(worker, slowdown, excess, inside + outside))
        return found


def verdict_event(verdict: Verdict, *, step: int | None) -> Event:
    """The event that states ``verdict``."""
    match verdict:
        case Lost(worker, silent_s, reason, detected_by):
            return WorkerLost(
                step=step,
                source=detected_by,
                worker=worker,
                silent_s=silent_s,
                message=reason,
                detected_by=detected_by,
            )
        case Hung(worker, stalled_s, at_step):
            return WorkerHung(
                step=step,
                source="heartbeat",
                worker=worker,
                stalled_s=stalled_s,
                message=f"no progress past step {at_step} for {stalled_s:.2f} s",
            )
        case Straggling(worker, slowdown, excess_s, iteration_s):
            return Straggler(
                step=step,
                source="heartbeat",
                worker=worker,
                slowdown=slowdown,
                excess_s=excess_s,
                iteration_s=iteration_s,
            )


async def watch(
    monitor: HeartbeatMonitor,
    publish: Callable[[Verdict], Awaitable[None]],
    *,
    interval: float = 0.05,
) -> None:
    """Check ``monitor`` every ``interval`` seconds, and when a silence comes to its timeout, and hand each verdict
    to ``publish``. Runs until cancelled."""
    while True:
        for verdict in monitor.check():
            await publish(verdict)
        await anyio.sleep(min(interval, max(0.0, monitor.next_silence_due() - monitor.clock())))
