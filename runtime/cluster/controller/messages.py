"""What the controller hears about its workers, in the shell: each message a worker sends (heartbeats, joins,
restores, failures, durable parts, the script's requests and events, notices, a wish to leave), a closed
connection, the wire's reports of refused connections and the heartbeat monitor's verdicts; each published on the
bus or handed to the supervisor as an input. Functions over the
:class:`~elastic_runtime.cluster.controller.shell.Controller`.
"""

from __future__ import annotations

import logging
import time
from typing import TypeVar

import anyio
import msgspec

from elastic_runtime.cluster.controller.commits import add_saved
from elastic_runtime.cluster.controller.forming import seatable
from elastic_runtime.cluster.controller.heartbeat import Lost, UnknownWorker, Verdict, verdict_event
from elastic_runtime.cluster.controller.processes import WorkerProcess
from elastic_runtime.cluster.controller.server import Report
from elastic_runtime.cluster.controller.state import ControllerState
from elastic_runtime.cluster.controller.stragglers import judge_straggler
from elastic_runtime.cluster.controller.supervision import (
    LeaveRequested,
    MemberFinished,
    MemberJoined,
    MemberRestored,
    Progress,
    RestoreFailed,
    Status,
    WorkerChanged,
    WorkerFailed,
)
from elastic_runtime.cluster.protocol import (
    EXIT_REPLACE,
    EventReport,
    Finished,
    Heartbeat,
    Joined,
    Leaving,
    Message,
    Noticed,
    Published,
    Requested,
    Restored,
    Saved,
    Stop,
)
from elastic_runtime.core.errors import BusClosed, JobUnsupported, StepError
from elastic_runtime.core.eventlog import decode_event
from elastic_runtime.core.events import (
    CheckpointBehind,
    CheckpointCorrupt,
    ConnectionRefused,
    CorruptionHealed,
    Event,
    GroupFormed,
    LikelyMeshesReady,
    MalformedHeartbeat,
    Notice,
    NoticeIgnored,
    ReplicaSkipped,
    SilentCorruption,
    StepFailed,
    Straggler,
    WorkerHung,
    WorkerLost,
    WorkerSignalled,
)

__all__ = [
    "VERDICT_PRIORITY",
    "end_on_failure",
    "handle_unreadable",
    "heard",
    "mark_closed",
    "on_message",
    "publish_or_log",
    "publish_report",
    "publish_skipped",
    "publish_verdict",
    "take_notice",
    "take_verdict",
]

log = logging.getLogger(__name__)

E = TypeVar("E", bound=Event)


async def publish_report(controller: ControllerState, report: Report) -> None:
    """A (rate-limited) report of refused connections or malformed lines: one warning and one event."""
    what = "refused a connection" if report.kind == "refused" else "ignored a message"
    more = f" ({report.count} in the last {controller.server.limiter.interval_s:.0f} s)" if report.count > 1 else ""
    log.warning("controller: %s from %s%s: %s", what, report.peer, more, report.reason)
    kind = ConnectionRefused if report.kind == "refused" else MalformedHeartbeat
    event = kind(
        step=controller.group_step,
        source="controller",
        peer=report.peer,
        reason=report.reason,
        count=report.count,
        message=report.reason,
    )
    await publish_or_log(controller, event)


async def publish_or_log(controller: ControllerState, event: Event) -> None:
    """Publish ``event``; when the run was cancelled from outside and its bus is gone, still log it (the last
    summaries, a verdict that came as the run ended)."""
    try:
        await controller.bus.publish(event)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, BusClosed):
        controller.event_log.append(event)


async def on_message(controller: ControllerState, proc: WorkerProcess, message: Message) -> None:
    match message:
        case Heartbeat(worker=worker, generation=gen, step=step, step_time_s=seconds, loss=loss):
            if message.held:  # draining: the step it holds at (drain.py)
                proc.held = step
                controller.changes.tell()
            if proc.gone and proc.popen is None and not proc.told_to_stop and not controller.stopping:
                # Judged lost (a partition that healed): its place is taken; it must not wait in a group
                # that will never call it again. (One the controller started was killed instead.)
                proc.place(Status.STOPPED)
                log.warning("controller: worker %d was judged lost and is back; told to exit", worker)
                taken = Stop(reason=f"worker {worker} was judged lost; its place is taken", exit_code=EXIT_REPLACE)
                await controller.server.send(proc, taken)
            proc.memory = message.memory or proc.memory
            if proc.told_to_stop:  # leaving at a planned step: the step it reached says whether it got there
                proc.step = max(proc.step, step)
            if proc.gone or controller.stopping:
                return
            try:
                pace = None
                if message.iteration_s is not None and message.outside_s is not None:
                    pace = (message.iteration_s, message.outside_s)
                controller.monitor.observe(worker, step, pace)
            except UnknownWorker:
                log.warning("controller: heartbeat from worker %d, which is not watched; ignored", worker)
                return
            if gen == controller.group.generation and controller.group.has(worker):
                proc.step, proc.generation = step, gen
                controller.feed(Progress(worker, step, seconds, loss, message.metrics))
        case Joined(generation=gen) if gen == controller.group.generation:
            proc.joined = message
            await publish_skipped(controller, proc, message.skipped)
            controller.feed(MemberJoined(proc.worker))
        case Saved(generation=gen) if gen == controller.group.generation and controller.durable is not None:
            await add_saved(controller, proc, message)
        case EventReport(generation=gen, event=CheckpointCorrupt() as corrupt) if gen == controller.group.generation:
            await handle_unreadable(controller, proc, message, heard(proc, corrupt))
        case EventReport(generation=gen, event=StepFailed() as failed) if gen == controller.group.generation:
            await end_on_failure(controller, proc, message, heard(proc, failed))
        case EventReport(generation=gen, event=SilentCorruption() as found) if gen == controller.group.generation:
            # The workers of the processes that hold its suspects, in this generation's seats.
            members = controller.group.members
            workers = tuple(members[p] for p in message.processes if 0 <= p < len(members))
            await controller.bus.publish(msgspec.structs.replace(heard(proc, found), workers=workers))
        case EventReport(
            generation=gen, event=LikelyMeshesReady() | CheckpointBehind() | CorruptionHealed() as told
        ) if gen == controller.group.generation:
            await controller.bus.publish(heard(proc, told))
        case Restored(generation=gen) if gen == controller.group.generation:
            controller.feed(MemberRestored(message.tier, message.nbytes, message.read_s, message.transfer_s))
        case Requested():
            await controller.relay.requested(message)
        case Published():
            await controller.relay.published(message)
        case Noticed():
            await take_notice(controller, proc, message)
        case Leaving(signal=signal):
            # A departure, not a loss: the supervisor plans it like a drained host's (planned.py).
            log.warning("controller: worker %d got %s and asks to leave the group", proc.worker, signal)
            leaving = WorkerSignalled(
                step=controller.group_step, source="controller", worker=proc.worker, signal=signal
            )
            # The run may be ending, its bus closed: scancel signals every worker and the controller at once.
            await publish_or_log(controller, leaving)
            controller.feed(LeaveRequested(proc.worker, f"it got {signal}"))
        case Finished(generation=gen) if gen == controller.group.generation:
            proc.finished = message
            controller.result.digests[proc.worker] = message.digest
            controller.feed(MemberFinished(proc.worker))
        case _:
            log.info("controller: stale %s from worker %d ignored", type(message).__name__, proc.worker)


async def take_notice(controller: ControllerState, proc: WorkerProcess, message: Noticed) -> None:
    """A notice from a worker's own metadata server: taken only about the host its Hello named (a worker
    cannot speak for another host)."""
    where = proc.hello.instance if proc.hello is not None else ""
    try:
        event = decode_event(bytes(message.event))
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        log.warning("controller: unreadable notice from worker %d: %s", proc.worker, exc)
        return
    if not isinstance(event, Notice) or not where or event.instance != where:
        about = getattr(event, "instance", "")
        why = f"{type(event).__name__} about {about!r} from worker {proc.worker}, which runs on {where!r}"
        log.warning("controller: %s; ignored", why)
        ignored = NoticeIgnored(step=controller.group_step, source=f"worker-{proc.worker}", instance=about, reason=why)
        await controller.bus.publish(ignored)
        return
    await controller.bus.publish(msgspec.structs.replace(event, source=f"metadata@worker-{proc.worker}"))


def heard(proc: WorkerProcess, event: E) -> E:
    """A worker's event as the controller publishes it: from ``worker-N`` (the id its connection proved), at the
    controller's own clocks (a worker's monotonic clock means nothing here, and the event log keeps one)."""
    return msgspec.structs.replace(
        event, source=f"worker-{proc.worker}", wall_time=time.time(), mono_time=time.monotonic()
    )


async def handle_unreadable(
    controller: ControllerState, proc: WorkerProcess, report: EventReport, corrupt: CheckpointCorrupt
) -> None:
    """A member found its shards of the step being restored damaged: unless it read them from the next tier
    (``report.recovered_from``), the group re-forms from the next best step. A durable step is withdrawn (its
    manifest set aside, its files kept for a look); a replica file is never listed again by the member that
    found it."""
    step = corrupt.step
    assert step is not None  # an EventReport's event names its step, or it does not decode
    log.error("controller: %s step %d unreadable (%s: %s)", corrupt.tier, step, corrupt.path, corrupt.reason)
    await controller.bus.publish(corrupt)
    if corrupt.tier == "durable" and controller.durable is not None:
        await anyio.to_thread.run_sync(controller.durable.withdraw, step)
    why = f"{corrupt.tier} step {step} unreadable: {corrupt.reason}"
    controller.feed(RestoreFailed(report.generation, step, why, report.recovered_from))


async def publish_skipped(controller: ControllerState, proc: WorkerProcess, skipped: tuple[str, ...]) -> None:
    for entry in skipped:
        path, _, why = entry.partition(": ")
        if path not in controller.skipped_seen:  # every worker reads the same folder: one event per path
            controller.skipped_seen.add(path)
            log.warning("controller: replica %s not restored: %s", path, why)
            await controller.bus.publish(
                ReplicaSkipped(step=controller.group_step, source=f"worker-{proc.worker}", path=path, reason=why)
            )


async def end_on_failure(
    controller: ControllerState, proc: WorkerProcess, report: EventReport, failed: StepFailed
) -> None:
    """The user's code failed in a worker, or the job cannot run in this mode (``report.unsupported``): the run
    ends now. Another group would run the same data and program into the same error, so nothing is replaced or
    retried."""
    assert failed.step is not None  # an EventReport's event names its step, or it does not decode
    await controller.bus.publish(failed)
    where = f"worker {proc.worker} (pid {proc.pid}, log {controller.pool.logs / f'worker-{proc.worker}.log'})"
    if report.unsupported:
        controller.end(JobUnsupported(f"refused before step 1 by {where}: {failed.message}"))
        return
    text = f"step {failed.step} failed in {where}: {failed.error_type}: {failed.message}"
    controller.end(StepError(f"{text}\n{report.traceback}".rstrip(), step=failed.step))


def mark_closed(controller: ControllerState, proc: WorkerProcess, reason: str) -> None:
    proc.closed = True
    controller.changes.tell()  # a worker not started here runs until its connection ends (stop_all)
    controller.monitor.mark_gone(proc.worker, reason)
    controller.feed(WorkerChanged(proc.worker))


async def publish_verdict(controller: ControllerState, verdict: Verdict) -> None:
    proc = controller.pool.get(verdict.worker)
    event = verdict_event(verdict, step=controller.group_step)
    if isinstance(event, Straggler):
        event = judged(controller, event)
    if isinstance(verdict, Lost) and proc is not None and proc.stopped():
        event = WorkerHung(
            step=controller.group_step,
            source="heartbeat",
            worker=verdict.worker,
            stalled_s=verdict.silent_s,
            message=f"process {proc.pid} is stopped (SIGSTOP?) and silent for {verdict.silent_s:.2f} s",
        )
    killed = controller.kill_times.pop(verdict.worker, None)
    if killed is not None:
        controller.result.detected_after_s.append(event.mono_time - killed)
    await publish_or_log(controller, event)


# The supervisor takes a loss after every other handler of its event ran: the handlers see it first, and one that
# prepares for the re-forming (a lost host's replica files wiped) or changes its strategy (``ctx.regroup``) is
# done before the group re-forms.
VERDICT_PRIORITY = -(2**31)


async def take_verdict(controller: ControllerState, event: WorkerLost | WorkerHung, ctx: object) -> None:
    """Hand the supervisor a lost or hung worker: the one decision taken on it (kill, replace, re-form)."""
    controller.feed(WorkerFailed(event.worker, type(event).__name__, event.message))


async def take_corruption(controller: ControllerState, event: SilentCorruption, ctx: object) -> None:
    """A persistent corruption under launch, after every other handler of it: its workers' devices compute wrong,
    so they are killed and replaced like lost ones (``WorkerFailed``), and the group re-forms without them. (A
    transient one was healed by the members' replay of the step: nothing to decide.)"""
    if not event.persistent or not event.workers:
        return
    controller.evicting.append(event)
    suspects = f"devices {list(event.suspects)} compute wrong (step {event.step}"
    why = "; no majority of the slices says which: every suspect goes)" if not event.attributed else ")"
    for worker in event.workers:
        controller.feed(WorkerFailed(worker, "SilentCorruption", suspects + why))


async def heal_on_formed(controller: ControllerState, event: GroupFormed, ctx: object) -> None:
    """The group re-formed without the workers of a persistent corruption: it is healed (``CorruptionHealed``)."""
    for found in controller.evicting:
        healed = CorruptionHealed(
            step=event.step,
            source="controller",
            kind="persistent",
            suspects=found.suspects,
            evicted=found.suspects,
            seconds=event.mono_time - found.mono_time,
        )
        await controller.bus.publish(healed)
    controller.evicting.clear()


def judged(controller: ControllerState, event: Straggler) -> Straggler:
    """``event`` with the controller's choice for its straggler and the reason (``judge_straggler``): a re-forming is
    costed at this run's newest one (its first, compile included, until it has re-formed)."""
    sup = controller.supervisor
    target = controller.target_steps
    action, reason = judge_straggler(
        excess_s=event.excess_s,
        slowdown=event.slowdown,
        remaining_steps=None if target < 0 else max(target - controller.group_step, 0),
        reform_s=sup.reform_s,
        spare_ready=any(seatable(sup, p) for p in controller.pool),
    )
    return msgspec.structs.replace(event, action=action, reason=reason)
