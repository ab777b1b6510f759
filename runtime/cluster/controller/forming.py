"""Forming a generation, the supervisor's longest decision: recruit spares (started if need be) around the
survivors, seat them, send every member ``Form`` and wait for every ``Joined``; a member lost meanwhile drops out
(the rest re-form), has its seat taken by a spare, or gives the generation up (the rest re-form without it at
once), and a group that does not form in time restarts. Functions over the
:class:`~elastic_runtime.cluster.controller.supervisor.Supervisor`'s state, synchronous like it.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from elastic_runtime.cluster.config import LaunchError, Strategy
from elastic_runtime.cluster.controller.formed import send_restore
from elastic_runtime.cluster.controller.processes import WorkerProcess
from elastic_runtime.cluster.controller.supervision import (
    Action,
    FillSeats,
    Forming,
    Input,
    Joining,
    Kill,
    MemberJoined,
    Publish,
    Recruiting,
    RestoreTally,
    SaveFences,
    Send,
    SendForm,
    Spawn,
    Status,
    Watch,
)
from elastic_runtime.cluster.controller.supervisor_state import GivenUp, SupervisorState
from elastic_runtime.cluster.protocol import EXIT_REPLACE, Stop
from elastic_runtime.core.events import GroupForming

__all__ = [
    "PLANNED_AHEAD",
    "await_joins",
    "cordoned",
    "departure_code",
    "form_generation",
    "give_up",
    "join_timeout",
    "recruit",
    "release_given_up",
    "seat_members",
    "seatable",
    "started_jax",
    "substitute",
]

log = logging.getLogger(__name__)

# A planned re-forming (growing, draining) happens this many steps after the newest step a member committed.
PLANNED_AHEAD = 3


def form_generation(
    sup: SupervisorState, out: list[Action], strategy: Strategy, reason: str, leaving: tuple[int, ...] = ()
) -> None:
    """Start forming a new generation: survivors stay (unless restarting; ``leaving``, a drain's, do not), spares
    are recruited."""
    sup.strategy = None
    sup.growable = None
    sup.unreadable = ""  # the new generation plans its own restore
    sup.restored = False
    started = sup.now
    survivors = [w for w in sup.group.members if not sup.gone(w) and w not in sup.requests and w not in leaving]
    sup.quiet(out, survivors)
    if strategy == Strategy.RESTART:
        for worker in survivors:
            why = "restart strategy: every worker is replaced"
            out.append(Kill(worker, why))
            if sup.pool[worker].popen is None:  # not ours to kill: asked to exit, the cluster replaces it
                out.append(Send(worker, Stop(reason=why, exit_code=EXIT_REPLACE)))
            sup.place(out, worker, Status.LOST)
            out.append(Watch(worker, "unwatched"))
        sup.survivor_restarts += len(survivors)
        survivors = []
    elif strategy == Strategy.REFORM and not survivors:
        strategy = Strategy.RESTART  # nobody left to re-form with: the state must come from the replica files
    forming = Forming(strategy, reason, started, tuple(survivors), leaving if strategy == Strategy.DRAIN else ())
    timeout = sup.config.start_timeout_s if strategy == Strategy.START else sup.config.spawn_timeout_s
    sup.phase = Recruiting(forming, started + timeout, timeout)
    recruit(sup, out, started, None)


def recruit(sup: SupervisorState, out: list[Action], now: float, changed: int | None) -> None:
    """Enough spares (started now if needed) to fill the group around the survivors, once they said hello.
    ``changed``: the one worker whose record changed (a hello, a close), if that is all that happened: only
    it is looked at, so N workers saying hello cost O(N), not O(N**2)."""
    phase = sup.phase
    assert isinstance(phase, Recruiting)
    forming = phase.forming
    survivors = [w for w in forming.survivors if not sup.gone(w)]
    need = sup.config.nprocs - len(survivors)
    chosen = dict.fromkeys(phase.chosen)
    if changed is None:
        chosen = {w: None for w in chosen if seatable(sup, sup.pool[w])}  # one chosen earlier may be gone since
        ready = (p.worker for p in sup.pool if seatable(sup, p) and p.worker not in chosen)
    else:
        proc = sup.pool.get(changed)
        if proc is None or not seatable(sup, proc):
            chosen.pop(changed, None)
        ready = (w for w in [changed] if proc is not None and seatable(sup, proc) and w not in chosen)
    for worker in ready:
        if len(chosen) >= need:
            break
        chosen[worker] = None
    sup.phase = phase = replace(phase, chosen=tuple(chosen))
    if len(chosen) >= need:
        seat_members(sup, out, forming, survivors, list(chosen))
        return
    if sup.config.starts_workers:
        # On their way: spares starting, and ready ones not chosen yet, whose hello the shell recorded but whose
        # ``changed`` is still in the supervisor's queue (counted as missing, they had a worker started for them).
        coming = [p for p in sup.pool if sup.spare(p.worker) and p.worker not in chosen]
        coming = [p for p in coming if p.hello is None or seatable(sup, p)]
        if len(coming) + len(chosen) < need:
            out.append(Spawn(need - len(coming) - len(chosen)))
        # After a loss with no ready spare for a seat (only processes still starting: a cold start, seconds to
        # minutes for a real model), going on smaller at once beats waiting idle: the survivors train while the
        # replacement starts, and the group grows back at a step boundary once it has joined (planned.py).
        cold = forming.strategy == Strategy.REFORM and not any(p.hello is not None for p in coming)
    else:
        cold = False
    # Workers the controller does not start are the orchestrator's to replace: after a loss the group goes
    # on without them at once where min_nprocs allows, and grows back when they say hello.
    soon = (not sup.config.starts_workers or forming.strategy == Strategy.DRAIN or cold) and bool(survivors)
    assert sup.config.min_nprocs is not None
    late = now > phase.deadline
    enough = (soon or late) and len(sup.group.seat(survivors, phase.chosen)) >= sup.config.min_nprocs  # slices
    if (soon or late) and enough:
        short = sup.config.nprocs - len(survivors) - len(phase.chosen)
        if short > 0:
            why = "no ready spare for its seat" if soon else f"no replacement ready within {phase.timeout_s:g} s"
            smaller = (
                f"; going on with {sup.config.nprocs - short} of {sup.config.nprocs} workers ({why}; at least "
                f"{sup.config.min_nprocs}), growing back once a replacement joins"
            )
            forming = replace(forming, reason=forming.reason + smaller)
        seat_members(sup, out, forming, survivors, list(phase.chosen))  # go on smaller; growing back re-forms
    elif late:
        sup.end(out, LaunchError(recruiting_timed_out(sup, phase, len(survivors) + len(chosen))))


def recruiting_timed_out(sup: SupervisorState, phase: Recruiting, ready: int) -> str:
    """Why the run ends when too few workers said hello in time: which wait ran out, and what the rest were doing."""
    starting = [p for p in sup.pool if sup.spare(p.worker) and p.hello is None and p.running()]
    if phase.forming.strategy == Strategy.START:
        what, flag = "the first group", "--start-timeout"
    else:
        what, flag = "a replacement", "--spawn-timeout"
    doing = (
        f"{len(starting)} more still starting (their processes run: importing the script and JAX, and the "
        f"script's own code before it calls run(); a real model's first start takes minutes on a slow host)"
        if starting
        else "no other worker process is running"
    )
    return (
        f"{what} did not come together: {ready} of {sup.config.nprocs} workers connected within "
        f"{phase.timeout_s:.1f} s ({flag}, at least {sup.config.min_nprocs} needed), {doing}; raise {flag}"
    )


def seat_members(
    sup: SupervisorState, out: list[Action], forming: Forming, survivors: list[int], recruits: list[int]
) -> None:
    members = sup.group.seat(survivors, recruits)
    seated = set(members)
    for worker in set(survivors) | set(recruits):
        if worker not in seated:  # in a slice short of a process: it waits, as a spare, for a replacement
            sup.place(out, worker, Status.SPARE)
            out.append(Watch(worker, "starting"))
    sup.requests.clear()
    generation = sup.group.new_generation(members)
    out.append(SaveFences())  # a resumed controller numbers its generations after this one
    sup.restore_tally = RestoreTally()
    sup.coordinator = ""
    for worker in members:
        sup.place(out, worker, Status.MEMBER)
        out.append(Watch(worker, "starting"))  # it joins, restores and compiles: the longer timeout until it trains
    # Growing is planned: every member re-forms after committing the same step, so no collective is cut
    # off; after a failure the group re-forms now (in-flight steps are abandoned).
    planned = forming.strategy in (Strategy.GROW, Strategy.DRAIN) and survivors
    at_step = max(sup.pool[w].step for w in [*survivors, *forming.leaving]) + PLANNED_AHEAD if planned else -1
    out.append(SendForm(generation, tuple(members), forming.strategy, at_step))
    for worker in forming.leaving:
        # It steps with the old group up to ``at_step``, then exits: a replacement may take its place once
        # its host is back (``Readmitted``). Not watched by heartbeat from now: its leaving is no failure,
        # but an end before ``at_step`` is (``Supervisor._departed``).
        sup.place(out, worker, Status.STOPPED)
        out.append(Watch(worker, "unwatched"))
        sup.departing[worker] = (generation, at_step)
        why = f"drained at step {at_step}: {forming.reason}"
        code = departure_code(sup) if sup.departures.pop(worker, None) is not None else EXIT_REPLACE
        out.append(Send(worker, Stop(reason=why, exit_code=code, at_step=at_step)))
    out.append(
        Publish(
            GroupForming(
                step=sup.group.step,
                source="controller",
                generation=generation,
                members=tuple(members),
                strategy=forming.strategy,
                reason=forming.reason,
            )
        )
    )
    sup.unjoined = set(members)
    sup.phase = Joining(forming, sup.now + join_timeout(sup, forming.strategy))


def departure_code(sup: SupervisorState) -> int:
    """The exit code of a worker that asked to leave (SIGTERM from its host) and was let go: 0 where this
    controller starts the workers (it starts its own spares); where a cluster scheduler starts them,
    EXIT_REPLACE, so that it starts another in its place (a Kubernetes Job never replaces a pod that exited 0)."""
    return 0 if sup.config.starts_workers else EXIT_REPLACE


def join_timeout(sup: SupervisorState, strategy: Strategy) -> float:
    """How long the members may take to join: the first group, its start-up (imports, the first compile);
    a later one the configured time, or twice the slowest join seen, when a real model compiles longer."""
    if strategy == Strategy.START:
        return max(sup.config.start_timeout_s, sup.config.form_timeout_s)
    return max(sup.config.form_timeout_s, 2 * sup.slowest_join)


def await_joins(sup: SupervisorState, out: list[Action], phase: Joining, due: bool, event: Input) -> None:
    if isinstance(event, MemberJoined) and not due:
        sup.unjoined.discard(event.worker)
        if sup.unjoined:
            return  # O(1) a join: every member is looked at once all have joined
    procs = [sup.pool[w] for w in sup.group.members]
    lost = [p.worker for p in procs if sup.gone(p.worker)]
    if lost and not due and started_jax(sup, procs):
        # Every member got past JAX's start (one is in the generation): nobody waits for the lost ones there.
        # They drop out of this forming and the rest re-form now, as after any loss (counted when reported).
        log.warning("generation %d: %s lost while forming; re-forming without", sup.group.generation, lost)
        form_generation(sup, out, sup.config.strategy, lost_while_forming(sup, lost))
        return
    if lost and not due and can_give_up(sup, procs):
        give_up(sup, out, lost)
        return
    if lost and not due:
        substitute(sup, out, phase, lost)  # the others wait in JAX's start for those seats: spares take them
        return
    if lost:
        outcome = "member lost while forming"
    elif all(p.joined is not None for p in procs):
        sup.slowest_join = max(sup.slowest_join, *(p.joined.join_s for p in procs if p.joined is not None))
        send_restore(sup, out, phase.forming)
        return
    elif due:
        outcome = (
            f"not joined within {join_timeout(sup, phase.forming.strategy):.1f} s (the slowest join so far took "
            f"{sup.slowest_join:.1f} s; raise --form-timeout or --start-timeout if joining compiles longer)"
        )
    else:
        return
    # The group did not form in time (a member stalled, or no spare came for a lost one's seat). Members
    # blocked in initialize() wait until JAX's initialization timeout, so they are replaced too: restart.
    generation = sup.group.generation
    log.warning("generation %d did not form (%s); restarting its workers", generation, outcome)
    if not lost:  # a stall; a lost member was counted when it was reported
        sup.count_failure(out, outcome)
    if sup.spent(out, f"{outcome} in generation {generation}", set(lost)):  # members dying while forming, again
        return
    why = f"generation {generation} did not form ({outcome}): every worker replaced"
    form_generation(sup, out, Strategy.RESTART, why)


def lost_while_forming(sup: SupervisorState, lost: list[int]) -> str:
    """Why the next generation forms: the members lost while this one formed (what was seen of each)."""
    whys = "; ".join(sup.requests.get(worker, f"worker {worker} lost") for worker in lost)
    return f"{whys}, while generation {sup.group.generation} formed"


def started_jax(sup: SupervisorState, procs: list[WorkerProcess]) -> bool:
    """Whether a member is in the generation being formed (joined, or named it in a heartbeat): JAX's start
    waits for every seat, so then every member got past it."""
    generation = sup.group.generation
    return any(p.joined is not None or (p.generation == generation and not sup.gone(p.worker)) for p in procs)


def can_give_up(sup: SupervisorState, procs: list[WorkerProcess]) -> bool:
    """Whether the rest of a generation that lost members before it formed should re-form without them now:
    where the controller starts no workers (the orchestrator replaces them, when it does), no spare is ready
    for the seats, and the rest are enough (``min_nprocs``) and all seated again (no slice short)."""
    if sup.config.starts_workers or not sup.coordinator or any(seatable(sup, p) for p in sup.pool):
        return False
    rest = [p.worker for p in procs if not sup.gone(p.worker)]
    assert sup.config.min_nprocs is not None
    return len(rest) >= sup.config.min_nprocs and sup.group.seat(rest, []) == rest


def give_up(sup: SupervisorState, out: list[Action], lost: list[int]) -> None:
    """Give the generation being formed up and form the next without ``lost``: its other members wait in JAX's
    start for the lost seats, and a later Form frees them (``runtime/cluster/worker/group.py``); once they all
    went on, stand-ins fill those seats so that their waiting ends too (``release_given_up``)."""
    generation, members = sup.group.generation, sup.group.members
    seats = tuple(members.index(worker) for worker in lost)
    sup.given_up[generation] = GivenUp(sup.coordinator, seats, {w for w in members if w not in lost})
    log.warning("generation %d: %s lost before it formed; given up, re-forming without", generation, lost)
    form_generation(sup, out, sup.config.strategy, lost_while_forming(sup, lost))


def release_given_up(sup: SupervisorState, out: list[Action]) -> None:
    """Fill the lost seats of each given-up generation whose members all went on (or were lost since)."""
    for generation, given in list(sup.given_up.items()):
        given.waiting = {w for w in given.waiting if not sup.gone(w) and sup.pool[w].generation <= generation}
        if not given.waiting:
            del sup.given_up[generation]
            out.append(FillSeats(generation, given.coordinator, given.seats))


def substitute(sup: SupervisorState, out: list[Action], phase: Joining, lost: list[int]) -> None:
    """Seat a ready spare in each lost member's seat of the generation being formed (its Form names the
    seat's process id, the same coordinator); start spares for the seats none is ready for."""
    ready = [p.worker for p in sup.pool if seatable(sup, p)]
    members, generation = sup.group.members, sup.group.generation
    seated = []
    for worker in lost:
        if not ready:
            break
        spare = ready.pop(0)
        seat = sup.group.take_seat(worker, spare)
        sup.unjoined.discard(worker)  # the seat waits for the spare's join now
        sup.unjoined.add(spare)
        sup.requests.pop(worker, None)  # replaced in this forming: no re-forming for it after
        sup.place(out, spare, Status.MEMBER)
        out.append(Watch(spare, "starting"))
        seated.append(spare)
        log.warning("generation %d: worker %d takes lost worker %d's seat %d", generation, spare, worker, seat)
    if seated:
        out.append(SendForm(generation, tuple(members), phase.forming.strategy, -1, seats=tuple(seated)))
        sup.phase = replace(phase, deadline=sup.now + sup.config.form_timeout_s)  # the newcomer's time to join
    missing = len(lost) - len(seated)
    starting = [p for p in sup.pool if sup.spare(p.worker) and p.hello is None]
    if sup.config.starts_workers and len(starting) < missing:
        out.append(Spawn(missing - len(starting)))


def seatable(sup: SupervisorState, proc: WorkerProcess) -> bool:
    """A spare that said hello, can be seated at once, and is on a host that is not under maintenance."""
    return sup.spare(proc.worker) and proc.connected and not cordoned(sup, proc)


def cordoned(sup: SupervisorState, proc: WorkerProcess) -> bool:
    return proc.hello is not None and proc.hello.instance in sup.cordoned
