"""The controller's decisions as a synchronous state machine: inputs in, actions out.

The :class:`Supervisor` is told what happened (workers failed, a spare said hello, a member joined, a restore
failed, steps were committed, every member finished, time passed) and answers with what to do (start spares,
kill a worker, send a message, hand a new generation its ``Form``, publish an event, end the run). It decides
when the group re-forms, when a re-forming falls back to restarting every worker, whether a step that keeps
failing is tried again (``config.retry``) and when the failure budget is spent. What it changes outside its own
state it changes by actions: the heartbeat monitor's watch as the group forms and trains (``Watch``), where each
worker stands (``Place``: seated, a spare again, lost, told to stop; it keeps its own record of them and reads
what the shell saw of each process from the pool, writing nothing there). No processes, sockets or clocks of its
own: the controller (``runtime/cluster/controller/shell.py``) feeds it each input with the time it is decided at,
carries its actions out and calls :meth:`handle` with :class:`Tick` at :attr:`Supervisor.deadline`; its tests
drive it alone, with a time of their own.

Forming a generation: recruit spares (started if need be) to fill the group around the survivors, seat them
(``Membership.seat``), send every member ``Form``, wait for every ``Joined``, then send ``RestoreStep`` with the plan
(``Membership.plan_restore``). A member lost while the group forms drops out of that forming, and nobody else
is replaced: once a member is in the generation (it joined, or its heartbeat names the generation) every member
got past JAX's start, so the rest re-form at once as after any loss; before that the others wait in JAX's start
for the lost one's seat, so a spare takes that seat in the same generation (started if none is ready), or,
where the controller starts none and none is ready, the generation is given up and the rest re-form without it at
once (``forming.give_up``). Only a group that does not form in time (``form_timeout_s``) restarts with every
worker replaced. Its inputs, actions and phases are in ``supervision.py``; forming a generation is in
``forming.py``, its restore plan in ``formed.py``, the planned re-formings (draining a host or a member that asked to
leave, growing back) in ``planned.py``: functions over its state (``supervisor_state.py``, below them all).
"""

from __future__ import annotations

import logging

from elastic_runtime.cluster.config import Strategy
from elastic_runtime.cluster.controller.forming import (
    await_joins,
    departure_code,
    form_generation,
    recruit,
    release_given_up,
)
from elastic_runtime.cluster.controller.planned import can_grow, drain
from elastic_runtime.cluster.controller.supervision import (
    Action,
    BackingOff,
    Done,
    DrainRequested,
    Finish,
    Idle,
    Input,
    Joining,
    Kill,
    LeaveRequested,
    MemberFinished,
    MemberJoined,
    MemberRestored,
    Progress,
    Publish,
    Readmitted,
    Recruiting,
    RegroupRequested,
    RestoreFailed,
    Send,
    SendForm,
    Settling,
    Start,
    Status,
    Tick,
    TopUpSpares,
    Watch,
    WorkerChanged,
    WorkerFailed,
)
from elastic_runtime.cluster.controller.supervisor_state import SupervisorState
from elastic_runtime.cluster.protocol import EXIT_REPLACE, Stop
from elastic_runtime.core.errors import RecoveryError
from elastic_runtime.core.events import WorkerLost

__all__ = ["Supervisor"]

log = logging.getLogger(__name__)

# Near-simultaneous losses (a host, a slice) are answered by one re-forming, not one each.
SETTLE_S = 0.05
# Workers on other hosts are found lost by their silence, each one timeout after its own last heartbeat: those
# lost together are found within about one heartbeat interval of each other. Settling waits for them while any
# worker has been silent for half the timeout (a healthy one never is) or a loss found is still on its way here
# (``HeartbeatMonitor.losing``): a single loss settles in SETTLE_S, a rack once its last worker is found.


class Supervisor(SupervisorState):
    """Decides how the group is formed, re-formed and ended. Single use. Its state and the arguments it takes are
    :class:`~elastic_runtime.cluster.controller.supervisor_state.SupervisorState`'s."""

    def handle(self, event: Input, now: float) -> list[Action]:
        """What to do about ``event``, at ``now`` (monotonic seconds): the one time every part of this decision
        reads."""
        self.now = now
        out: list[Action] = []
        if self.done:
            return out
        # A heartbeat's progress, a join or a restore changes no worker's record that recruiting reads: only the
        # other inputs make the supervisor look at every worker again (a heartbeat must cost O(1)).
        frequent = isinstance(event, Progress | MemberJoined | MemberRestored)
        if not frequent:
            self.growable = None
        match event:
            case Start():
                form_generation(self, out, Strategy.START, "start")
            case WorkerFailed(worker=worker, cause=cause, message=message):
                out.append(Kill(worker, f"{cause}: {message}"))  # even as the run ends: it must not come back
                self._regroup_requested(out, {worker}, cause, None, message)
            case RegroupRequested(workers=workers, reason=reason, strategy=strategy):
                self._regroup_requested(out, set(workers), reason, strategy)
            case RestoreFailed(generation=generation, step=step, reason=reason, recovered_from=recovered_from):
                # Once per failed restore, however many tiers or members found it damaged; not at all when
                # the member read the step from the next tier instead.
                failed = (generation, step)
                if not recovered_from and failed not in self.failed_restores:
                    self.failed_restores.add(failed)
                    self.unreadable = reason
            case MemberRestored():
                self.restore_tally.add(event)
            case Progress(worker=worker, step=step, step_time_s=seconds, loss=loss, metrics=metrics):
                if 0 <= self.target_steps <= step:  # done: finishing (its last writes) is no hang
                    out.append(Watch(worker, "starting"))  # nor judged by the training timeout
                self._progress(out, worker, step, seconds, loss, metrics)
            case MemberFinished():
                members = self.group.members
                if members and all(self.pool[w].finished is not None for w in members):
                    self.stopped = True
                    self.phase = Done()
                    out.append(Finish())
                    return out
            case DrainRequested(instance=instance, reason=reason):
                self.cordoned.add(instance)
                self.drains[instance] = reason
            case LeaveRequested(worker=worker, reason=reason):
                self._leave_requested(out, worker, reason)
            case Readmitted(instance=instance):
                self.cordoned.discard(instance)
                self.drains.pop(instance, None)
            case WorkerChanged(worker=worker) if worker in self.departing:
                self._departed(out, worker)
            case WorkerChanged() | MemberJoined() | Tick():
                pass
        if self.given_up:  # for seconds after a give-up: a heartbeat names a later generation, a loss is counted
            release_given_up(self, out)
        if not self.done:
            self._advance(out, event, frequent)
        return out

    # --- failures ------------------------------------------------------------------------------------------

    def _regroup_requested(
        self, out: list[Action], lost: set[int], reason: str, strategy: Strategy | None, message: str = ""
    ) -> None:
        if self.stopped:
            return
        self.strategy = strategy or self.strategy
        lost -= self.requests.keys()  # a handler's request for a worker whose verdict came first: counted once
        whys = {worker: f"worker {worker}: {reason}" + (f" ({message})" if message else "") for worker in sorted(lost)}
        for worker in whys:
            out.append(Watch(worker, "unwatched"))
            if self.pool.get(worker) is not None:
                self.place(out, worker, Status.LOST)
            if worker not in self.group.members:
                # A spare (or an already replaced worker): keep the pool of spares full, no re-forming.
                out.append(TopUpSpares())
                continue
            self.requests[worker] = whys[worker]
            self.count_failure(out, reason)
        self.spent(out, f"{'; '.join(whys.values())} at step {self.group.step + 1}", lost)

    def _leave_requested(self, out: list[Action], worker: int, reason: str) -> None:
        """A member leaves at the next planned step (``planned.drain``), a spare at once; neither is a failure."""
        if self.stopped or self.pool.get(worker) is None or self.gone(worker):
            return  # the run is ending (every worker gets its Stop), or it was replaced already
        if worker in self.group.members:
            self.departures[worker] = reason
            return
        self.place(out, worker, Status.STOPPED)
        out.append(Watch(worker, "unwatched"))
        out.append(Send(worker, Stop(reason=f"spare worker {worker} leaves: {reason}", exit_code=departure_code(self))))
        out.append(TopUpSpares())

    def _departed(self, out: list[Action], worker: int) -> None:
        """A member that was to leave at a planned step exited or closed its connection. At that step (or with
        the exit code of a worker that obeyed its Stop) that is its departure; before it, the old group's next
        collective waits for it in vain and the planned forming would never come: a loss. The generation planned
        without it forms now: its members that still step with the old group are told to join at once (their
        step in flight abandoned); those seated from the spares wait in its start already."""
        generation, at_step = self.departing.pop(worker)
        phase = self.phase
        if not isinstance(phase, Joining) or self.group.generation != generation:
            return  # that forming is over: formed after all, or replaced by another
        proc = self.pool[worker]
        stepping = [w for w in self.group.members if w in phase.forming.survivors]
        # A member that committed the planned step, or joined the planned generation after it, stepped there
        # with this one (every step's collectives need every member): it left at its step, its last heartbeat
        # lost with it. Told to join again, such a member would join the same coordination service twice.
        reached = any(self.pool[w].step >= at_step or self.pool[w].joined is not None for w in stepping)
        if proc.step >= at_step or reached or proc.exit_code() in (0, EXIT_REPLACE):
            return
        why = f"worker {worker} ended at step {proc.step}, before step {at_step}, where it was to leave"
        log.warning("%s; the group planned without it forms now", why)
        lost = WorkerLost(step=self.group.step, source="controller", worker=worker, silent_s=0.0, message=why)
        out.append(Publish(lost))
        self.count_failure(out, why)
        if self.spent(out, why, {worker}):
            return
        out.append(SendForm(generation, tuple(self.group.members), phase.forming.strategy, -1, seats=tuple(stepping)))

    # --- the state machine ---------------------------------------------------------------------------------

    def _advance(self, out: list[Action], event: Input, frequent: bool) -> None:
        """Do what the current phase allows now; called after every input."""
        now, phase = self.now, self.phase
        due = phase.deadline is not None and now >= phase.deadline
        match phase:
            case Idle() if self.group.generation and self.restored:
                if self.requests:
                    self.quiet(out, self.group.members)  # at once: the survivors wait in a broken collective now
                    # Workers the controller started are found lost by their exit, all at once; others by silence.
                    spread = 0.0 if self.config.starts_workers else self.config.heartbeat_timeout_s
                    self.phase = Settling(now + SETTLE_S, until=now + max(SETTLE_S, spread))
                elif self.unreadable:
                    reason, self.unreadable = self.unreadable, ""
                    self._regroup(out, set(), reason)  # the same members, from another step
                elif self.drains or self.departures:
                    drain(self, out)
                elif can_grow(self):
                    form_generation(self, out, Strategy.GROW, "a spare is ready")
            case Settling(until=until) if due:
                if now < until and self.monitor.losing(self.monitor.timeout_s / 2):
                    self.phase = Settling(min(until, now + SETTLE_S), until)  # more of them may be found soon
                else:
                    self._regroup(out, set(self.requests), "; ".join(self.requests.values()))
            case BackingOff(reason=reason) if due:
                form_generation(self, out, self.strategy or self.config.strategy, reason)
            case Recruiting() if not frequent:
                recruit(self, out, now, event.worker if isinstance(event, WorkerChanged) else None)
            case Joining() if due or not frequent or isinstance(event, MemberJoined):
                await_joins(self, out, phase, due, event)

    def _regroup(self, out: list[Action], lost: set[int], reason: str) -> None:
        """Re-form after a failure. A step that failed before is tried again only after the retry policy's
        backoff, and not at all once the policy gives up."""
        if self.restored:  # the group was training: its attempt at the next step failed
            attempt = self.recovery.attempt_failed(self.group.step + 1)
            wait = self.config.retry(attempt)
            if wait is None:
                why = f"step {attempt.step} failed {attempt.attempts} times ({reason}); giving up{self.why(lost)}"
                self.end(out, RecoveryError(why, last_committed_step=self.group.step))
                return
            if wait > 0:
                log.warning("step %d failed %d times; retrying in %.2f s", attempt.step, attempt.attempts, wait)
                self.phase = BackingOff(self.now + wait, reason)
                return
        form_generation(self, out, self.strategy or self.config.strategy, reason)

    # --- training ------------------------------------------------------------------------------------------

    def _progress(
        self,
        out: list[Action],
        worker: int,
        reported: int,
        step_time_s: float | None,
        loss: float | None,
        metrics: dict[str, float],
    ) -> None:
        # ``reported`` is the heartbeat's own step, not the worker's newest: a supervisor behind its queue would
        # otherwise give this heartbeat's loss to a later step.
        members = self.group.members
        if not self.restored or not members:
            return
        for step in self.group.report(worker, reported):
            # The loss is that of the step the worker reported; the steps before it, counted now, have none here.
            mine = step == reported
            out.append(
                Publish(self.completed(step, step_time_s or 0.0, loss if mine else None, metrics if mine else {}))
            )
            tally = self.restore_tally
            completed = self.recovery.committed(
                step,
                self.mesh_shape(),
                bytes_by_tier=tally.bytes_by_tier,
                read_s_by_tier=tally.read_s_by_tier,
                transfer_s=tally.transfer_s,
            )
            if completed is not None:  # the step ends a recovery
                out.append(Publish(completed))
