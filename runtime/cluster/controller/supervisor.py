"""The controller's decisions as a synchronous state machine: inputs in, actions out.

The :class:`Supervisor` is told what happened (workers failed, a spare said hello, a member joined, a restore
failed, steps were committed, every member finished, time passed) and answers with what to do (start spares,
kill a worker, send a message, hand a new generation its ``Form``, publish an event, end the run). It decides
when the group re-forms, when a re-forming falls back to restarting every worker, whether a step that keeps
failing is tried again (``config.retry``) and when the failure budget is spent, and it switches the heartbeat
monitor's ``expect_progress`` as the group forms and trains. No processes, sockets or clocks of its own: the
controller (``runtime/cluster/controller/shell.py``) feeds it, carries its actions out and calls :meth:`handle` with
:class:`Tick` at :attr:`Supervisor.deadline`; its tests drive it alone.

Forming a generation: recruit spares (started if need be) to fill the group around the survivors, seat them
(``Membership.seat``), send every member ``Form``, wait for every ``Joined``, then send ``Restore`` with the plan
(``Membership.plan_restore``). A member lost while the group forms drops out of that forming, and nobody else
is replaced: once a member is in the generation (it joined, or its heartbeat names the generation) every member
got past JAX's start, so the rest re-form at once as after any loss; before that the others wait in JAX's start
for the lost one's seat, so a spare takes that seat in the same generation (started if none is ready). Only a
group that does not form in time (``form_timeout_s``) restarts with every worker replaced. Its inputs and
actions are in ``supervision.py``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from enum import Enum

from runtime.cluster.config import LaunchConfig, LaunchError, LaunchResult, Strategy
from runtime.cluster.controller.heartbeat import HeartbeatMonitor
from runtime.cluster.controller.membership import JoinReport, Membership
from runtime.cluster.controller.processes import ProcessPool, WorkerProcess, log_tail
from runtime.cluster.controller.supervision import (
    Action,
    DrainRequested,
    EndRun,
    Finish,
    Input,
    Kill,
    MemberFinished,
    MemberJoined,
    MemberRestored,
    Progress,
    Publish,
    Readmitted,
    RegroupRequested,
    RestoreFailed,
    SaveFences,
    Send,
    SendForm,
    Spawn,
    Start,
    Tick,
    TopUpSpares,
    WarmSpares,
    WorkerChanged,
)
from runtime.cluster.protocol import EXIT_REPLACE, Joined, Restore, Stop
from runtime.core.errors import ElasticRuntimeError, RecoveryError
from runtime.core.events import GroupFormed, GroupForming, RunStarted, StateRestored, StepCompleted
from runtime.core.recovery import RecoveryTracker

__all__ = ["Phase", "Supervisor"]

log = logging.getLogger(__name__)

# A planned re-forming (growing, draining) happens this many steps after the newest step a member committed.
PLANNED_AHEAD = 3
# Near-simultaneous losses (a host, a slice) are answered by one re-forming, not one each.
SETTLE_S = 0.05
# Workers on other hosts are found lost by their silence, each one timeout after its own last heartbeat: those
# lost together are found within about one heartbeat interval of each other. Settling waits for them while any
# worker has been silent for half the timeout (a healthy one never is) or a loss found is still on its way here
# (``HeartbeatMonitor.losing``): a single loss settles in SETTLE_S, a rack once its last worker is found.


class Phase(Enum):
    IDLE = "idle"  # not started, or training
    SETTLING = "settling"  # a failure came: waiting a moment for the ones that come with it
    BACKOFF = "backoff"  # a step failed before: waiting the retry policy's backoff
    RECRUITING = "recruiting"  # waiting for enough spares to say hello
    JOINING = "joining"  # Form sent: waiting for every member's Joined
    DONE = "done"  # finished or ended


class Supervisor:
    """Decides how the group is formed, re-formed and ended. Single use.

    Args:
        config: the run's settings.
        pool: the workers' records (the shell starts processes and fills them in; tests add records).
        group: the group's membership.
        monitor: the heartbeat monitor whose ``expect_progress`` it switches.
        recovery: the failure budget and recovery timing.
        result: the run's outcome, whose formation figures it fills in.
        target_steps: the run's target; -1 until the first worker's hello says it (see :attr:`target_steps`).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        config: LaunchConfig,
        pool: ProcessPool,
        group: Membership,
        monitor: HeartbeatMonitor,
        recovery: RecoveryTracker,
        result: LaunchResult,
        *,
        target_steps: int = -1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.pool = pool
        self.group = group
        self.monitor = monitor
        self.recovery = recovery
        self.result = result
        self.target_steps = target_steps
        self.clock = clock
        self.phase = Phase.IDLE
        self.stopped = False  # the run is ending: nothing is replaced or formed any more
        self.restored = False  # the current generation got its Restore
        self.restored_bytes: dict[str, int] = {}  # what the current generation's members restored, per tier
        self.deadline: float | None = None  # when to be handed a Tick
        self._requests: set[int] = set()  # members to replace at the next re-forming
        self._reason = ""
        self._strategy: Strategy | None = None
        self._unreadable = ""  # the current generation's restore failed: why
        self._failed_restores: set[tuple[int, int]] = set()  # (generation, step) of each restore re-formed for
        self._slowest_join = 0.0  # the longest a member of a formed group took to join (its compile included)
        # The generation being formed.
        self._forming = Strategy.START
        self._forming_reason = ""
        self._started = 0.0
        self._timeout = 0.0
        self._survivors: list[int] = []
        self._chosen: list[int] = []
        self._coordinator = ""
        self._settle_until = 0.0
        self._unjoined: set[int] = set()  # members of the forming generation not joined yet
        self._growable: bool | None = None  # whether a ready spare would grow the group; None: look again
        # Instances (hosts) under maintenance: their workers are taken out of the group and not seated again
        # until re-admitted (``DrainRequested``, ``Readmitted``).
        self.cordoned: set[str] = set()
        self._drains: dict[str, str] = {}  # instance -> why, drains not yet started
        self._leaving: list[int] = []  # members the generation being formed drains

    @property
    def done(self) -> bool:
        return self.phase == Phase.DONE

    def hosted(self, generation: int, coordinator: str) -> None:
        """The shell started generation ``generation``'s coordination service at ``coordinator``."""
        if generation == self.group.generation:
            self._coordinator = coordinator

    @property
    def coordinator(self) -> str:
        """The address of the current generation's coordination service ("" before it is hosted)."""
        return self._coordinator

    def mesh_shape(self) -> dict[str, int]:
        """The group's mesh: as its first member laid it out (the job's own axes), else the default layout."""
        first = self.pool[self.group.members[0]].joined if self.group.members else None
        if first is not None and first.mesh_shape:
            return dict(first.mesh_shape)
        size = self.config.slice_size
        return {"data": len(self.group.members) // size, "model": size * self.config.local_devices}

    def handle(self, event: Input) -> list[Action]:
        """What to do about ``event``."""
        out: list[Action] = []
        if self.done:
            return out
        # A heartbeat's progress, a join or a restore changes no worker's record that recruiting reads: only the
        # other inputs make the supervisor look at every worker again (a heartbeat must cost O(1)).
        frequent = isinstance(event, Progress | MemberJoined | MemberRestored)
        if not frequent:
            self._growable = None
        match event:
            case Start():
                self._form(out, Strategy.START, "start")
            case RegroupRequested(workers=workers, reason=reason, strategy=strategy):
                self._regroup_requested(out, set(workers), reason, strategy)
            case RestoreFailed(generation=generation, step=step, reason=reason, recovered_from=recovered_from):
                # Once per failed restore, however many tiers or members found it damaged; not at all when
                # the member read the step from the next tier instead.
                failed = (generation, step)
                if not recovered_from and failed not in self._failed_restores:
                    self._failed_restores.add(failed)
                    self._unreadable = reason
            case MemberRestored(tier=tier, nbytes=nbytes):
                if nbytes:  # a member that took every shard from the others delivered nothing itself
                    self.restored_bytes[tier] = self.restored_bytes.get(tier, 0) + nbytes
            case Progress(worker=worker, step_time_s=seconds):
                if 0 <= self.target_steps <= self.pool[worker].step:  # done: finishing (its last writes) is no hang
                    self.monitor.expect_progress(worker, False)
                self._progress(out, worker, seconds)
            case MemberFinished():
                members = self.group.members
                if members and all(self.pool[w].finished is not None for w in members):
                    self.stopped = True
                    self.phase, self.deadline = Phase.DONE, None
                    out.append(Finish())
                    return out
            case DrainRequested(instance=instance, reason=reason):
                self.cordoned.add(instance)
                self._drains[instance] = reason
            case Readmitted(instance=instance):
                self.cordoned.discard(instance)
                self._drains.pop(instance, None)
            case WorkerChanged() | MemberJoined() | Tick():
                pass
        if not self.done:
            self._advance(out, event, frequent)
        return out

    # --- failures ------------------------------------------------------------------------------------------

    def _regroup_requested(self, out: list[Action], lost: set[int], reason: str, strategy: Strategy | None) -> None:
        if self.stopped:
            return
        for worker in sorted(lost):
            self.monitor.forget(worker)
            proc = self.pool.get(worker)
            if proc is not None:
                proc.gone = True
            if worker not in self.group.members:
                # A spare (or an already replaced worker): keep the pool of spares full, no re-forming.
                out.append(TopUpSpares())
                continue
            self._requests.add(worker)
            self._count_failure(out, reason)
        if self._spent(out, f"{reason} at step {self.group.step + 1}", lost):
            return
        self._reason = reason
        self._strategy = strategy or self._strategy

    def _count_failure(self, out: list[Action], cause: str) -> None:
        step = self.group.step
        out.append(Publish(self.recovery.fail(cause, failed_step=step + 1, last_committed_step=step)))

    def _spent(self, out: list[Action], last: str, lost: set[int]) -> bool:
        """Whether the failures counted so far spend the budget (then the run ends). The one check, made where
        failures are counted: one while a group forms ends the run as surely as any."""
        if not self.recovery.over_budget:
            return False
        error = RecoveryError(
            f"{self.recovery.failures} failures exceed max_failures={self.config.max_failures} "
            f"(the last: {last}){self._why(lost)}",
            last_committed_step=self.group.step,
        )
        self._end(out, error)
        return True

    def _end(self, out: list[Action], error: ElasticRuntimeError | LaunchError) -> None:
        self.stopped = True
        self.phase, self.deadline = Phase.DONE, None
        out.append(EndRun(error))

    def _why(self, lost: set[int]) -> str:
        """What the lost workers' logs say (their tracebacks): the reason a step keeps failing is in there."""
        logs = [self.pool.logs / f"worker-{w}.log" for w in sorted(lost)]
        return "".join(f"\nworker log {path}:\n{log_tail(path)}" for path in logs)

    def _quiet(self, workers: list[int]) -> None:
        """The group is not training: a worker that commits nothing now is not hung."""
        for worker in workers:
            self.monitor.expect_progress(worker, False)

    # --- the state machine ---------------------------------------------------------------------------------

    def _advance(self, out: list[Action], event: Input, frequent: bool) -> None:
        """Do what the current phase allows now; called after every input."""
        now = self.clock()
        due = self.deadline is not None and now >= self.deadline
        if self.phase == Phase.IDLE and self.group.generation and self.restored:
            if self._requests:
                self._quiet(self.group.members)  # at once: the survivors wait in a broken collective now
                self.phase, self.deadline = Phase.SETTLING, now + SETTLE_S
                # Workers the controller started are found lost by their exit, all at once; others by silence.
                spread = 0.0 if self.config.starts_workers else self.config.heartbeat_timeout_s
                self._settle_until = now + max(SETTLE_S, spread)
            elif self._unreadable:
                reason, self._unreadable = self._unreadable, ""
                self._regroup(out, set(), reason)  # the same members, from another step
            elif self._drains:
                self._drain(out)
            elif self._can_grow():
                self._form(out, Strategy.GROW, "a spare is ready")
        elif self.phase == Phase.SETTLING and due:
            if now < self._settle_until and self.monitor.losing(self.monitor.timeout_s / 2):
                self.deadline = min(self._settle_until, now + SETTLE_S)  # more of them may be found soon
            else:
                self._regroup(out, set(self._requests), self._reason)
        elif self.phase == Phase.BACKOFF and due:
            self._form(out, self._strategy or self.config.strategy, self._reason)
        elif self.phase == Phase.RECRUITING and not frequent:
            self._recruit(out, now, event.worker if isinstance(event, WorkerChanged) else None)
        elif self.phase == Phase.JOINING and (due or not frequent or isinstance(event, MemberJoined)):
            self._await_joins(out, due, event)

    def _regroup(self, out: list[Action], lost: set[int], reason: str) -> None:
        """Re-form after a failure. A step that failed before is tried again only after the retry policy's
        backoff, and not at all once the policy gives up."""
        self._reason = reason
        if self.restored:  # the group was training: its attempt at the next step failed
            attempt = self.recovery.attempt_failed(self.group.step + 1)
            wait = self.config.retry(attempt)
            if wait is None:
                why = f"step {attempt.step} failed {attempt.attempts} times ({reason}); giving up{self._why(lost)}"
                self._end(out, RecoveryError(why, last_committed_step=self.group.step))
                return
            if wait > 0:
                log.warning("step %d failed %d times; retrying in %.2f s", attempt.step, attempt.attempts, wait)
                self.phase, self.deadline = Phase.BACKOFF, self.clock() + wait
                return
        self._form(out, self._strategy or self.config.strategy, reason)

    def _seatable(self, proc: WorkerProcess) -> bool:
        """A spare ready to be seated, on a host that is not under maintenance."""
        return proc.ready_spare and not self._cordoned(proc)

    def _cordoned(self, proc: WorkerProcess) -> bool:
        return proc.hello is not None and proc.hello.instance in self.cordoned

    def _drain(self, out: list[Action]) -> None:
        """Take the members on cordoned hosts out at a planned step: the rest (and ready spares) re-form there,
        every member's state in memory, nothing lost or counted. Not when the run ends first, nor when the
        group would be smaller than ``min_nprocs``: then the host's loss is a failure like any other."""
        reason = "; ".join(self._drains.values())
        self._drains.clear()
        members = self.group.members
        leaving = [w for w in members if self._cordoned(self.pool[w])]
        if not leaving:
            return
        staying = [w for w in members if w not in leaving]
        ready = [p.worker for p in self.pool if self._seatable(p)]
        ahead = max(self.pool[w].step for w in members) + PLANNED_AHEAD
        if 0 <= self.target_steps <= ahead + 1:
            log.warning("not draining workers %s (%s): the run ends first", leaving, reason)
            return
        assert self.config.min_nprocs is not None
        if len(self.group.seat(staying, ready)) < self.config.min_nprocs:
            log.warning("cannot drain workers %s (%s): fewer than min_nprocs would be left", leaving, reason)
            return
        self._leaving = leaving
        self._form(out, Strategy.DRAIN, f"drain: {reason}")

    def _can_grow(self) -> bool:
        """A group that shrank (``min_nprocs``) grows back once a spare is ready, away from the run's end."""
        members = self.group.members
        if not (
            len(members) < self.config.nprocs
            and self.recovery.current is None
            and not self.stopped
            and self.group.step + 5 < self.target_steps
        ):
            return False
        if self._growable is None:  # counted again only after an input that may change it
            ready = sum(self._seatable(p) for p in self.pool)
            self._growable = len(self.group.seat(members, [-1] * ready)) > len(members)  # a whole slice more
        return self._growable

    def _form(self, out: list[Action], strategy: Strategy, reason: str) -> None:
        """Start forming a new generation: survivors stay (unless restarting), spares are recruited."""
        self._strategy = None
        self._growable = None
        self._unreadable = ""  # the new generation plans its own restore
        self.restored = False
        self._forming_reason = reason
        self._started = self.clock()
        leaving = self._leaving if strategy == Strategy.DRAIN else []
        survivors = [
            w for w in self.group.members if not self.pool[w].gone and w not in self._requests and w not in leaving
        ]
        self._quiet(survivors)
        if strategy == Strategy.RESTART:
            for worker in survivors:
                why = "restart strategy: every worker is replaced"
                out.append(Kill(worker, why))
                if self.pool[worker].popen is None:  # not ours to kill: asked to exit, the cluster replaces it
                    out.append(Send(worker, Stop(reason=why, exit_code=EXIT_REPLACE)))
                self.pool[worker].gone = True
                self.monitor.forget(worker)
            self.result.survivor_restarts += len(survivors)
            survivors = []
        elif strategy == Strategy.REFORM and not survivors:
            strategy = Strategy.RESTART  # nobody left to re-form with: the state must come from the replica files
        self._forming, self._survivors, self._chosen = strategy, survivors, []
        self._timeout = self.config.start_timeout_s if strategy == Strategy.START else self.config.spawn_timeout_s
        self.phase, self.deadline = Phase.RECRUITING, self._started + self._timeout
        self._recruit(out, self._started, None)

    def _recruit(self, out: list[Action], now: float, changed: int | None) -> None:
        """Enough spares (started now if needed) to fill the group around the survivors, once they said hello.
        ``changed``: the one worker whose record changed (a hello, a close), if that is all that happened: only
        it is looked at, so N workers saying hello cost O(N), not O(N**2)."""
        survivors = [w for w in self._survivors if not self.pool[w].gone]
        need = self.config.nprocs - len(survivors)
        chosen = dict.fromkeys(self._chosen)
        if changed is None:
            chosen = {w: None for w in chosen if self._seatable(self.pool[w])}  # one chosen earlier may be gone since
            ready = (p.worker for p in self.pool if self._seatable(p) and p.worker not in chosen)
        else:
            proc = self.pool.get(changed)
            if proc is None or not self._seatable(proc):
                chosen.pop(changed, None)
            ready = (w for w in [changed] if proc is not None and self._seatable(proc) and w not in chosen)
        for worker in ready:
            if len(chosen) >= need:
                break
            chosen[worker] = None
        self._chosen = list(chosen)
        if len(chosen) >= need:
            self._seat(out, survivors, self._chosen)
            return
        starting = (
            [p for p in self.pool if p.spare and not p.gone and p.hello is None] if self.config.starts_workers else []
        )
        if self.config.starts_workers and len(starting) + len(chosen) < need:
            out.append(Spawn(need - len(starting) - len(chosen)))
        # Workers the controller does not start are the orchestrator's to replace: after a loss the group goes
        # on without them at once where min_nprocs allows, and grows back when they say hello.
        soon = (not self.config.starts_workers or self._forming == Strategy.DRAIN) and bool(survivors)
        assert self.config.min_nprocs is not None
        late = self.deadline is not None and now > self.deadline
        enough = (soon or late) and len(self.group.seat(survivors, self._chosen)) >= self.config.min_nprocs  # slices
        if (soon or late) and enough:
            self._seat(out, survivors, self._chosen)  # go on smaller; the next re-forming grows the group back
        elif late:
            count = len(survivors) + len(chosen)
            self._end(out, LaunchError(f"only {count} workers ready after {self._timeout} s"))

    def _seat(self, out: list[Action], survivors: list[int], recruits: list[int]) -> None:
        members = self.group.seat(survivors, recruits)
        seated = set(members)
        for worker in set(survivors) | set(recruits):
            if worker not in seated:  # in a slice short of a process: it waits, as a spare, for a replacement
                self.pool[worker].spare = True
                self.monitor.expect_progress(worker, False)
        self._requests.clear()
        generation = self.group.new_generation(members)
        out.append(SaveFences())  # a resumed controller numbers its generations after this one
        self.restored_bytes.clear()
        self._coordinator = ""
        for worker in members:
            proc = self.pool[worker]
            proc.spare, proc.joined, proc.finished = False, None, None
            self.monitor.expect_progress(worker, False)
        # Growing is planned: every member re-forms after committing the same step, so no collective is cut
        # off; after a failure the group re-forms now (in-flight steps are abandoned).
        planned = self._forming in (Strategy.GROW, Strategy.DRAIN) and survivors
        leaving = self._leaving if self._forming == Strategy.DRAIN else []
        self._leaving = []
        at_step = max(self.pool[w].step for w in [*survivors, *leaving]) + PLANNED_AHEAD if planned else -1
        out.append(SendForm(generation, tuple(members), self._forming, at_step))
        for worker in leaving:
            # It steps with the old group up to ``at_step``, then exits: a replacement may take its place once
            # its host is back (``Readmitted``). Not watched from now: its leaving is no failure.
            proc = self.pool[worker]
            proc.gone = proc.told_to_stop = True
            self.monitor.forget(worker)
            why = f"drained at step {at_step}: {self._forming_reason}"
            out.append(Send(worker, Stop(reason=why, exit_code=EXIT_REPLACE, at_step=at_step)))
        out.append(
            Publish(
                GroupForming(
                    step=self.group.step,
                    source="controller",
                    generation=generation,
                    members=tuple(members),
                    strategy=self._forming,
                )
            )
        )
        self._unjoined = set(members)
        self.phase, self.deadline = Phase.JOINING, self.clock() + self._join_timeout()

    def _join_timeout(self) -> float:
        """How long the members may take to join: the first group, its start-up (imports, the first compile);
        a later one the configured time, or twice the slowest join seen, when a real model compiles longer."""
        if self._forming == Strategy.START:
            return max(self.config.start_timeout_s, self.config.form_timeout_s)
        return max(self.config.form_timeout_s, 2 * self._slowest_join)

    def _await_joins(self, out: list[Action], due: bool, event: Input) -> None:
        if isinstance(event, MemberJoined) and not due:
            self._unjoined.discard(event.worker)
            if self._unjoined:
                return  # O(1) a join: every member is looked at once all have joined
        procs = [self.pool[w] for w in self.group.members]
        lost = [p.worker for p in procs if p.gone]
        if lost and not due and self._started_jax(procs):
            # Every member got past JAX's start (one is in the generation): nobody waits for the lost ones there.
            # They drop out of this forming and the rest re-form now, as after any loss (counted when reported).
            log.warning("generation %d: %s lost while forming; re-forming without", self.group.generation, lost)
            self._form(out, self.config.strategy, self._forming_reason)
            return
        if lost and not due:
            self._substitute(out, lost)  # the others wait in JAX's start for those seats: spares take them
            return
        if lost:
            outcome = "member lost while forming"
        elif all(p.joined is not None for p in procs):
            self._slowest_join = max(self._slowest_join, *(p.joined.join_s for p in procs if p.joined is not None))
            self._restore(out)
            return
        elif due:
            outcome = (
                f"not joined within {self._join_timeout():.1f} s (the slowest join so far took "
                f"{self._slowest_join:.1f} s; raise --form-timeout or --start-timeout if joining compiles longer)"
            )
        else:
            return
        # The group did not form in time (a member stalled, or no spare came for a lost one's seat). Members
        # blocked in initialize() wait until JAX's initialization timeout, so they are replaced too: restart.
        generation = self.group.generation
        log.warning("generation %d did not form (%s); restarting its workers", generation, outcome)
        if not lost:  # a stall; a lost member was counted when it was reported
            self._count_failure(out, outcome)
        if self._spent(out, f"{outcome} in generation {generation}", set(lost)):  # members dying while forming, again
            return
        self._form(out, Strategy.RESTART, self._forming_reason)

    def _started_jax(self, procs: list[WorkerProcess]) -> bool:
        """Whether a member is in the generation being formed (joined, or named it in a heartbeat): JAX's start
        waits for every seat, so then every member got past it."""
        generation = self.group.generation
        return any(p.joined is not None or (p.generation == generation and not p.gone) for p in procs)

    def _substitute(self, out: list[Action], lost: list[int]) -> None:
        """Seat a ready spare in each lost member's seat of the generation being formed (its Form names the
        seat's process id, the same coordinator); start spares for the seats none is ready for."""
        ready = [p.worker for p in self.pool if self._seatable(p)]
        members, generation = self.group.members, self.group.generation
        seated = []
        for worker in lost:
            if not ready:
                break
            spare = ready.pop(0)
            seat = self.group.take_seat(worker, spare)
            self._unjoined.discard(worker)  # the seat waits for the spare's join now
            self._unjoined.add(spare)
            self._requests.discard(worker)  # replaced in this forming: no re-forming for it after
            proc = self.pool[spare]
            proc.spare, proc.joined, proc.finished = False, None, None
            self.monitor.expect_progress(spare, False)
            seated.append(spare)
            log.warning("generation %d: worker %d takes lost worker %d's seat %d", generation, spare, worker, seat)
        if seated:
            out.append(SendForm(generation, tuple(members), self._forming, -1, seats=tuple(seated)))
            self.deadline = self.clock() + self.config.form_timeout_s  # the newcomer's time to join, from now
        missing = len(lost) - len(seated)
        starting = [p for p in self.pool if p.spare and not p.gone and p.hello is None]
        if self.config.starts_workers and len(starting) < missing:
            out.append(Spawn(missing - len(starting)))

    def _restore(self, out: list[Action]) -> None:
        """Every member joined: tell them which step to restore, and from whom."""
        members, strategy, group = self.group.members, self._forming, self.group
        reports = []
        for worker in members:
            joined = self.pool[worker].joined
            assert joined is not None
            reports.append(
                JoinReport(joined.best_step, joined.tier, joined.steps, joined.durable_only, joined.neighbour_step)
            )
        plan = group.plan_restore(reports)
        log.info("generation %d restores %s from %s", group.generation, plan, reports)
        if plan.missing:
            why = f"cannot restore generation {group.generation}: {plan.missing}"
            self._end(out, RecoveryError(why, last_committed_step=group.step))
            return
        if 0 <= self.target_steps < plan.step:
            why = f"refusing to restore step {plan.step}: past the run's target of {self.target_steps} steps"
            self._end(out, RecoveryError(why, last_committed_step=group.step))
            return
        gaps = group.restore(plan.step)
        # The older generations' fences are on disk before this one can step (and write replicas): a controller
        # killed now still tells the next workers what not to restore (``--resume``).
        out.append(SaveFences())
        if strategy == Strategy.START:
            self.result.resumed_from = plan.step if plan.step > 0 else -1
            gaps = []  # a resumed run: the controller before this one logged those steps
        for gap in gaps:
            # Committed by the member(s) restored from before the old group could report them all: the new
            # group continues from them, so they count as the group's committed steps.
            out.append(Publish(self._completed(gap, 0.0)))
        for worker in members:
            self.pool[worker].step = plan.step
        restore = Restore(
            generation=group.generation,
            step=plan.step,
            source=plan.source,
            target_steps=self.target_steps,
            from_neighbour=plan.from_neighbour,
        )
        out.extend(Send(worker, restore) for worker in members)
        self.restored = True
        for worker in members:
            self.monitor.expect_progress(worker, True)
        out.append(WarmSpares())
        self.result.world_size_history.append(len(members))
        self.result.strategies.append(strategy)
        formed = GroupFormed(
            step=plan.step,
            source="controller",
            generation=group.generation,
            members=tuple(members),
            coordinator=self._coordinator,
            strategy=strategy,
            seconds=self.clock() - self._started,
            restore_step=plan.step,
            restore_source=max(plan.source, 0),
            phases=_slowest_phases([self.pool[w].joined for w in members]),
            traced=sum(len(j.traced) for w in members if (j := self.pool[w].joined) is not None),
            instances=tuple(self._instance(w) for w in members),
        )
        out.append(Publish(formed))
        if strategy == Strategy.START:
            started = RunStarted(
                step=plan.step,
                source="controller",
                target_steps=self.target_steps,
                mesh_shape=self.mesh_shape(),
                devices=tuple(range(len(members) * self.config.local_devices)),
            )
            out.append(Publish(started))
        recovery = self.recovery.current
        if recovery is not None:
            self.recovery.restored(
                plan.step, restored_from=plan.restored_from, lost_steps=plan.lost_steps, strategy=strategy
            )
            state = StateRestored(
                step=plan.step,
                source="controller",
                restored_from=plan.restored_from,
                lost_steps=plan.lost_steps,
                seconds=self.clock() - recovery.started,
            )
            out.append(Publish(state))
        # Only now: a new spare importing JAX would compete for the CPUs with the re-forming group.
        out.append(TopUpSpares())
        self.phase, self.deadline = Phase.IDLE, None

    def _instance(self, worker: int) -> str:
        hello = self.pool[worker].hello
        return hello.instance if hello is not None else ""

    # --- training ------------------------------------------------------------------------------------------

    def _completed(self, step: int, seconds: float) -> StepCompleted:
        shape = self.mesh_shape()
        return StepCompleted(step=step, source="controller", duration_s=seconds, mesh_shape=shape, data_position=step)

    def _progress(self, out: list[Action], worker: int, step_time_s: float | None) -> None:
        members = self.group.members
        if not self.restored or not members:
            return
        for step in self.group.report(worker, self.pool[worker].step):
            out.append(Publish(self._completed(step, step_time_s or 0.0)))
            recovery = self.recovery.current
            completed = self.recovery.committed(step, self.mesh_shape())
            if recovery is not None and completed is not None:
                self.result.recoveries.append(
                    {
                        "cause": recovery.cause,
                        "strategy": recovery.strategy,
                        "recovery_s": completed.recovery_s,
                        "lost_steps": recovery.lost_steps,
                        "restored_from": recovery.restored_from,
                        "failed_step": recovery.failed_step,
                        "bytes_by_tier": dict(self.restored_bytes),
                    }
                )
                out.append(Publish(completed))


def _slowest_phases(joins: list[Joined | None]) -> dict[str, float]:
    """Each phase of a join (``Joined.phases``) at its longest among the members: the one the group waited for."""
    slowest: dict[str, float] = {}
    for joined in joins:
        for phase, seconds in (joined.phases if joined is not None else {}).items():
            slowest[phase] = max(slowest.get(phase, 0.0), round(seconds, 4))
    return slowest
