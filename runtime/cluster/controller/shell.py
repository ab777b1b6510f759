"""The multi-process controller: starts the worker processes, supervises them and re-forms their group.

The controller starts N worker processes (plus warm spares), hands them a ``jax.distributed`` group on a
free loopback port, watches their heartbeats and, when one is lost or hangs, replaces it and re-forms the
group. It is never restarted because a worker failed: it is the one process that knows the run's history.

Recovery (see ``docs/multiprocess.md``) is a chain of events on the controller's bus: ``WorkerLost`` or
``WorkerHung`` -> the regroup handler (``handlers/regroup.py``) asks for a new group -> ``RecoveryStarted``
-> ``GroupFormed`` -> ``StateRestored`` -> ``RecoveryCompleted`` at the first step the new group commits.
Strategies: ``reform`` (survivors re-initialize ``jax.distributed`` in-process and a spare joins, taking
the state from its peers) and ``restart`` (every worker process replaced, state from the replica files in
``/dev/shm``), the fallback when a re-forming group does not come together in time.

A run ends early, every worker stopped and ``summary.json`` written, on an error in the user's code (a
worker's ``Failed``: ``StepError``), a job this mode cannot run (``JobUnsupported``), a spent failure budget
or a step that keeps failing (``RecoveryError``), or SIGTERM/SIGINT (drained; the run folder resumes it).

This module is the async shell; the decisions live in synchronous parts tested on their own: when and how the
group forms and re-forms, retries and gives up (``supervisor.py``, fed one input at a time from a memory
stream, its actions carried out here), the group (``membership.py``), the failure budget and recovery timing
(``runtime/core/recovery.py``), the processes (``processes.py``) and the wire (``server.py``).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import secrets
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from runtime.cluster import auth
from runtime.cluster.config import LaunchConfig, LaunchError, LaunchResult, Strategy
from runtime.cluster.controller.connection import Connection
from runtime.cluster.controller.context import ControllerContext
from runtime.cluster.controller.coordination import host_service
from runtime.cluster.controller.drain import final_checkpoint
from runtime.cluster.controller.durable import DurableCommits
from runtime.cluster.controller.heartbeat import HeartbeatMonitor, Lost, UnknownWorker, Verdict, verdict_event, watch
from runtime.cluster.controller.membership import Membership
from runtime.cluster.controller.processes import ProcessPool, WorkerProcess, descends_from
from runtime.cluster.controller.relay import EventRelay
from runtime.cluster.controller.runfolder import default_replica_dir, mark_finished, open_run, save_fences
from runtime.cluster.controller.server import Report, WorkerServer
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
from runtime.cluster.controller.supervisor import Supervisor
from runtime.cluster.protocol import (
    EXIT_REPLACE,
    Committed,
    Failed,
    Finished,
    Form,
    Heartbeat,
    Hello,
    Joined,
    Lease,
    Message,
    Noticed,
    Published,
    Requested,
    Restored,
    Saved,
    Stop,
    Unreadable,
    Warm,
)
from runtime.core.bus import EventBus
from runtime.core.errors import (
    BusClosed,
    CheckpointInvalid,
    ConfigError,
    ElasticRuntimeError,
    JobUnsupported,
    StepError,
    StorageError,
)
from runtime.core.eventlog import EventLog, decode_event
from runtime.core.events import (
    CheckpointCommitted,
    CheckpointCorrupt,
    CheckpointFailed,
    ConnectionRefused,
    Event,
    MalformedHeartbeat,
    Notice,
    NoticeIgnored,
    ReplicaSkipped,
    RunFinished,
    StepFailed,
    WorkerExited,
    WorkerHung,
    WorkerKilled,
    WorkerStarted,
)
from runtime.core.programs import PROGRAMS_PREFIX
from runtime.core.recovery import RecoveryTracker
from runtime.faults.process import worker_faults_text

__all__ = ["Controller"]

log = logging.getLogger(__name__)

_SPARE_RETRIES = 3  # spares in a row replaced at once when they die before their Hello
_MAX_WORKER_ID = 2**31 - 1  # ids a worker not started here may claim
# A worker's lease, as a share of the heartbeat timeout: it stops stepping before the controller, having heard
# nothing either, re-forms the group without it.
_LEASE_SHARE = 0.75
# Supervisor inputs taken in a row without yielding to the event loop (see ``_supervise``).
_INPUTS_IN_A_ROW = 256


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def _first_leaf(
    group: BaseExceptionGroup[Any], kind: type[BaseException] | tuple[type[BaseException], ...]
) -> BaseException | None:
    """The first exception of type ``kind`` in a (nested) exception group."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            found = _first_leaf(exc, kind)
            if found is not None:
                return found
        elif isinstance(exc, kind):
            return exc
    return None


class Controller:
    """Starts, supervises and re-forms a group of worker processes. Single use.

    With an empty ``config.command`` it starts nothing (the service mode, ``elastic-runtime controller``): it
    coordinates the workers that say hello with the run's secret, judges them by their heartbeats only, and
    takes a replacement in when the orchestrator brings one up.

    It subscribes no handler of its own (``runtime.defaults.default_controller`` adds the built-in ones) but the
    relay that forwards the group's events to the training script's handlers in the workers (``relay.py``).

    Raises:
        LaunchError: asked to listen on an address other hosts can reach, or to coordinate workers it does
            not start, without a secret from the user (``config.secret``).
    """

    def __init__(self, config: LaunchConfig) -> None:
        if config.secret is None and not is_loopback(config.listen_host):
            raise LaunchError(
                f"refusing to listen on {config.listen_host} without a secret: anyone who reaches it could steer "
                f"the run; set {auth.ENV_TOKEN} or {auth.ENV_TOKEN_FILE} (the same secret on every worker)"
            )
        if config.secret is None and not config.starts_workers:
            raise LaunchError(
                f"workers this controller does not start must prove a secret they know: set {auth.ENV_TOKEN} "
                f"or {auth.ENV_TOKEN_FILE} for the controller and every worker"
            )
        self.config = config
        self.run_dir = Path(config.run_dir or tempfile.mkdtemp(prefix="elastic-launch-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "workers").mkdir(exist_ok=True)
        self.record = open_run(self.run_dir, resume=config.resume)
        self.replica_dir = config.replica_dir or default_replica_dir(self.run_dir)
        # This controller's folder of the workers' compiled programs (Form.programs): a new one each time, so a
        # resumed run (the script maybe edited) never loads an earlier controller's.
        self._programs = f"{PROGRAMS_PREFIX}{secrets.token_hex(8)}"
        self.event_log = EventLog(self.run_dir / "events.jsonl")
        self.context = ControllerContext(self)
        self.bus = EventBus(self.context, handler_timeout=30.0, log=self.event_log)
        self.relay = EventRelay(self)
        self.relay.attach(self.bus)
        self.monitor = HeartbeatMonitor(timeout_s=config.heartbeat_timeout_s, hang_timeout_s=config.hang_timeout_s)
        # Never logged, never on a command line: the workers get it in their environment.
        self.secret = config.secret or auth.new_secret()
        self.pool = ProcessPool(
            config,
            self.run_dir / "workers",
            self.replica_dir,
            self.secret,
            run_id=self.record.run_id,
            run_dir=self.run_dir,
        )
        # A resumed run's generations go on from its record, its fences with them (see Membership.fences).
        self.group = Membership(
            config.nprocs, config.slice_size, generation=self.record.generation, fences=self.record.fences
        )
        self.recovery = RecoveryTracker("controller", config.max_failures)
        self.result = LaunchResult(
            ok=False,
            step=0,
            target_steps=-1,
            digests={},
            world_size_history=[],
            strategies=[],
            recoveries=[],
            detected_after_s=[],
            survivor_restarts=0,
            events_path=str(self.event_log.path),
            run_dir=str(self.run_dir),
            run_id=self.record.run_id,
        )
        # The controller's target, never a worker's to change: fixed by the config, else by the first worker's
        # Hello (see ``target_steps``).
        target = config.target_steps if config.target_steps is not None else -1
        self.supervisor = Supervisor(
            config, self.pool, self.group, self.monitor, self.recovery, self.result, target_steps=target
        )
        # The supervisor's inputs, from the message handlers, the monitor's verdicts and the reaper, in order.
        self._inputs_in, self._inputs = anyio.create_memory_object_stream[Input](max_buffer_size=math.inf)
        self.server = WorkerServer(
            secret=self.secret,
            on_hello=self._hello,
            on_message=self._on_message,
            on_report=self._report,
            on_closed=self._closed,
            auth_timeout_s=config.auth_timeout_s,
            max_pending=max(32, config.nprocs + config.spares),  # all of them may connect at once
        )
        self.port = 0
        self.durable = (
            DurableCommits(
                config.durable_dir,
                writers=config.slice_size,
                keep=config.durable_keep,
                metadata={"run_id": self.record.run_id},
            )
            if config.durable_dir
            else None
        )
        # Durable steps whose every part is in, committed one after another by ``_commit_durable``: a commit
        # (manifest, then pruning, seconds in GCS) awaited where messages are read would hold back the writer's
        # heartbeats, and the monitor would take a healthy worker for lost.
        self._to_commit: MemoryObjectSendStream[int] | None = None  # made (and closed) by ``run``
        self._commits_pending = 0
        self._commits_settled = anyio.Event()  # set when a commit ends
        self.durable_newest = -1  # the newest durable step this controller committed
        self._kill_times: dict[int, float] = {}  # worker -> when it was signalled, to time the detection
        # Every generation's coordination service stays up until the run ends: stopping one while a live
        # worker's client is still attached makes that client terminate its process.
        self._services: list[Any] = []
        self._spares_dead_before_hello = 0  # in a row: reset by any Hello
        # Ending the run early: an error that ends it (a worker's StepError, JobUnsupported) or a signal
        # (SIGTERM, SIGINT) cancels the supervision, and the run drains like any other end.
        self._supervision: anyio.CancelScope | None = None  # made in the event loop, by run_async
        self._error: ElasticRuntimeError | LaunchError | None = None
        self._signal = ""
        self._signalled_at = 0.0
        self._skipped_seen: set[str] = set()
        # Tasks run beside the wire and the monitor, and cancelled with them before the bus closes: a scheduler
        # backend's placement and watch loop (``runtime/cluster/controller/ray_backend.py``).
        self.companions: list[Callable[[], Coroutine[Any, Any, None]]] = []

    @property
    def members(self) -> list[int]:
        """Worker ids of the current group, in process-id order."""
        return self.group.members

    @property
    def group_step(self) -> int:
        """The newest step the whole group committed."""
        return self.group.step

    @property
    def stopping(self) -> bool:
        """The run is ending: nothing is replaced any more."""
        return self.supervisor.stopped

    @property
    def target_steps(self) -> int:
        """The run's target step; -1 until the first of the controller's own workers says hello."""
        return self.supervisor.target_steps

    @target_steps.setter
    def target_steps(self, steps: int) -> None:
        self.supervisor.target_steps = steps

    def mark_lost(self, worker: int, reason: str, *, detected_by: str) -> bool:
        """A scheduler says ``worker`` is gone (Ray: its actor or node died). It becomes a ``WorkerLost`` with
        ``detected_by`` at the monitor's next check, unless another signal was first (then nothing happens).
        False when the worker is not watched (it never said hello, or it was already judged lost)."""
        if worker not in self.monitor.workers:
            return False
        self.monitor.mark_gone(worker, reason, detected_by=detected_by)
        return True

    # --- running -------------------------------------------------------------------------------------------

    def run(self) -> LaunchResult:
        """Run in a new event loop. Raises LaunchError, RecoveryError, StepError or JobUnsupported (unwrapped
        from the task group) when it cannot go on."""
        try:
            return anyio.run(self.run_async)
        except BaseExceptionGroup as group:
            error = _first_leaf(group, (LaunchError, ElasticRuntimeError))
            if error is not None:
                raise error from group
            raise

    async def run_async(self) -> LaunchResult:
        """Run the group to completion, or until SIGTERM/SIGINT (then ``ok`` is False and the run can be
        resumed). Raises LaunchError, RecoveryError, StepError or JobUnsupported when it cannot go on."""
        self._supervision = anyio.CancelScope()
        host = self.config.listen_host
        listener = await self.server.listen(host, self.config.listen_port)
        self.port = listener.port
        self.pool.controller_address = f"{host}:{self.port}"
        reason = ""
        keep_replicas = False
        self._to_commit, commit_queue = anyio.create_memory_object_stream[int](max_buffer_size=1024)
        try:
            async with anyio.create_task_group() as tg:
                bus_done = anyio.Event()

                async def run_bus() -> None:
                    await self.bus.run()
                    bus_done.set()

                helpers = anyio.CancelScope()
                helpers_done = anyio.Event()

                async def run_helpers() -> None:
                    # The wire, the monitor and the reaper publish events: they end before the bus closes.
                    try:
                        with helpers:
                            async with anyio.create_task_group() as inner:
                                inner.start_soon(self.server.serve)
                                inner.start_soon(watch, self.monitor, self._on_verdict)
                                inner.start_soon(self._reap)
                                inner.start_soon(self.server.report_due)
                                inner.start_soon(self._commit_durable, commit_queue)
                                if not self.config.starts_workers:
                                    inner.start_soon(self._renew_leases)
                                for companion in self.companions:
                                    inner.start_soon(companion)
                                if threading.current_thread() is threading.main_thread():  # signals go to it only
                                    inner.start_soon(self._watch_signals)
                    finally:
                        helpers_done.set()  # also when the run is cancelled from outside

                tg.start_soon(run_bus)
                tg.start_soon(run_helpers)
                try:
                    for _ in range(self.config.nprocs + self.config.spares if self.config.starts_workers else 0):
                        self._spawn()
                    with self._supervision:  # ended early by end() and by signals
                        await self._supervise()
                    if self._error is not None:
                        raise self._error
                    if self._signal:
                        reason = f"stopped by {self._signal} at step {self.group_step}; the run can be resumed"
                    else:
                        self.result.ok = True
                except Exception as exc:
                    reason = f"{type(exc).__name__}: {exc}"
                    raise
                finally:
                    self.supervisor.stopped = True
                    for worker in self.monitor.workers:
                        self.monitor.forget(worker)
                    with anyio.CancelScope(shield=True):
                        done = self._conclude()  # before the Stop that lets the workers remove replicas
                        if self._signal and self.durable is not None and self.supervisor.restored:
                            drained = await final_checkpoint(self, reason, self._signalled_at)
                            reason = f"{reason}; {drained.note}"
                            self.result.drain_checkpoint = drained.checkpoint
                            keep_replicas = drained.checkpoint < 0  # --resume reads them instead
                        await self._stop_all(reason or "run finished", finished=done)
                        if self._signal:
                            self.result.drain_s = round(time.monotonic() - self._signalled_at, 3)
                        helpers.cancel()
                        with anyio.move_on_after(5):
                            await helpers_done.wait()
                        # Closed before the last refusals are counted: a connection the kernel queued after
                        # that would be neither served nor counted.
                        await listener.aclose()
                        await self.server.flush()
                        for service in self._services:
                            await anyio.to_thread.run_sync(service.shutdown)
                        finished = RunFinished(
                            step=self.group_step,
                            source="controller",
                            ok=self.result.ok,
                            reason=reason or ("" if self.result.ok else "cancelled"),
                            memory={str(p.worker): p.memory for p in self.pool if p.memory},
                        )
                        try:
                            await self.bus.publish(finished)
                            await self.bus.close()
                            with anyio.move_on_after(5):
                                await bus_done.wait()  # every pending event dispatched and logged
                        except (anyio.BrokenResourceError, anyio.ClosedResourceError, BusClosed):
                            self.event_log.append(finished)  # cancelled from outside: the bus is gone
                            await self.bus.close()
                    tg.cancel_scope.cancel()
        finally:
            self._to_commit.close()
            commit_queue.close()
            self._inputs_in.close()
            self._inputs.close()
            with anyio.CancelScope(shield=True):
                await listener.aclose()
            self.event_log.close()
            if self.config.replica_dir is None and not keep_replicas:  # ours, in /dev/shm: memory, not storage
                shutil.rmtree(self.replica_dir, ignore_errors=True)
            self._write_summary(reason)  # also when the run failed: summary.json then says why
        return self.result

    def _conclude(self) -> bool:
        """Whether the run finished (then the run folder says so): every member's final state the same."""
        digests = {self.result.digests.get(w) for w in self.members}
        if self.result.ok and len(digests) != 1:
            # Replicas must agree bit for bit; if they do not, the run's result cannot be trusted.
            log.error("members %s finished with different states: %s", self.members, self.result.digests)
            self.result.ok, self.result.reason = False, "replicas diverged"
        if self.result.ok:
            mark_finished(self.run_dir, self.record.run_id)
        return self.result.ok

    def _write_summary(self, reason: str) -> None:
        self.result.step = self.group_step
        self.result.target_steps = self.target_steps
        self.result.reason = self.result.reason or reason
        (self.run_dir / "summary.json").write_text(json.dumps(self.result.__dict__, default=str))

    def _save_fences(self) -> None:
        save_fences(self.run_dir, self.record.run_id, self.group.generation, self.group.fences)

    def end(self, error: ElasticRuntimeError | LaunchError) -> None:
        """End the run with ``error`` (the first one wins): every worker is stopped, the run fails with it."""
        if self._error is None:
            self._error = error
        self.supervisor.stopped = True
        if self._supervision is not None:
            self._supervision.cancel()

    async def _watch_signals(self) -> None:
        """SIGTERM (what ``timeout``, systemd and Kubernetes send) and SIGINT drain the run: workers stopped,
        ``RunFinished`` and ``summary.json`` written, the replica folder in /dev/shm removed."""
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                name = signal.Signals(signum).name
                log.warning("controller: %s at step %d; stopping the workers", name, self.group_step)
                if not self._signal:
                    self._signal, self._signalled_at = name, time.monotonic()
                self.supervisor.stopped = True
                if self._supervision is not None:
                    self._supervision.cancel()

    async def _supervise(self) -> None:
        """Feed the supervisor its inputs, one at a time, and carry its actions out, until the run is over. A
        timer hands it a ``Tick`` at its deadline (a new one replaces the old: a stale tick changes nothing)."""
        async with anyio.create_task_group() as timers:
            timer = anyio.CancelScope()
            armed: float | None = None
            event: Input = Start()
            in_a_row = 0
            while True:
                await self._carry_out(self.supervisor.handle(event))
                if self.supervisor.done:
                    break
                deadline = self.supervisor.deadline
                if deadline is not None and (deadline != armed or isinstance(event, Tick)):
                    timer.cancel()
                    timer = anyio.CancelScope()
                    timers.start_soon(self._tick_at, deadline, timer)
                armed = deadline
                # Inputs already waiting are taken without a trip through the event loop each: one heartbeat's
                # input is O(1), but a loop iteration per input let a large group's backlog grow without bound.
                in_a_row = in_a_row + 1 if in_a_row < _INPUTS_IN_A_ROW else 0
                try:
                    event = self._inputs.receive_nowait() if in_a_row else await self._inputs.receive()
                except anyio.WouldBlock:
                    event = await self._inputs.receive()
            timers.cancel_scope.cancel()
        # The last durable step's parts came in before the members' Finished: its commit is part of the run.
        while self._commits_pending:
            self._commits_settled = anyio.Event()
            await self._commits_settled.wait()

    async def _tick_at(self, deadline: float, scope: anyio.CancelScope) -> None:
        with scope:
            await anyio.sleep(max(0.0, deadline - time.monotonic()) + 0.001)  # a timer may fire a little early
            self._feed(Tick())

    def _feed(self, event: Input) -> None:
        try:
            self._inputs_in.send_nowait(event)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):  # the run is over
            log.debug("after the run, dropped %s", type(event).__name__)

    async def _carry_out(self, actions: list[Action]) -> None:
        for action in actions:
            match action:
                case Spawn(count=count):
                    for _ in range(count):
                        self._spawn()
                case TopUpSpares():
                    self._top_up_spares()
                case Kill(worker=worker, reason=reason):
                    self.kill(worker, "KILL", reason)
                case Send(worker=worker, message=message):
                    await self.server.send(self.pool[worker], message)
                case SendForm():
                    await self._send_form(action)
                case SaveFences():
                    self._save_fences()
                case WarmSpares():
                    await self._warm_spares()
                case Publish(event=event):
                    await self.bus.publish(event)
                case EndRun(error=error):
                    self.end(error)
                case Finish():
                    pass  # the supervisor is done: the loop ends

    async def _send_form(self, form: SendForm) -> None:
        """Host the new generation's coordination service and tell every member to join it."""
        members, generation, strategy = form.members, form.generation, form.strategy
        if form.seats:  # spares take lost members' seats in this generation: its service is up
            coordinator = self.supervisor.coordinator
        else:
            if self.durable is not None:
                self.durable.new_generation(generation)
            # Bound where the controller's own port is (a local address, or a wildcard), and named to the workers
            # by the address they reach it at (a Kubernetes Service's name is not an address one can bind).
            host = self.config.listen_host
            port, service = host_service(host, len(members), generation, self.config.coordinator_ports)
            self._services.append(service)
            coordinator = f"{self.config.coordinator_host or host}:{port}"
            self.supervisor.hosted(generation, coordinator)
        for process_id, worker in enumerate(members):
            if form.seats and worker not in form.seats:
                continue
            message = Form(
                generation=generation,
                coordinator=coordinator,
                process_id=process_id,
                num_processes=len(members),
                # With a state sharded over a slice, a process's shards may be nowhere else: every member lists
                # its replica files too, so the group can roll back to a step the slice holds whole.
                read_files=strategy != Strategy.REFORM or self.config.slice_size > 1,
                faults=worker_faults_text(self.config.faults, process_id) if strategy == Strategy.START else "",
                at_step=form.at_step,
                run_id=self.result.run_id,
                slice_size=self.config.slice_size,
                durable_dir=self.config.durable_dir or "",
                durable_every=self.config.durable_every,
                neighbour_replicas=self.config.neighbour_replicas,
                fences=dict(self.group.fences),
                programs=self._programs,
            )
            await self.server.send(self.pool[worker], message)

    # --- processes -----------------------------------------------------------------------------------------

    def _spawn(self) -> WorkerProcess:
        proc = self.pool.spawn()
        self._publish_nowait(WorkerStarted(source="controller", worker=proc.worker, pid=proc.pid, spare=True))
        return proc

    def _closed(self, proc: WorkerProcess, reason: str) -> None:
        proc.closed = True
        self.monitor.mark_gone(proc.worker, reason)
        self._feed(WorkerChanged(proc.worker))

    def _publish_nowait(self, event: Event) -> None:
        try:
            self.bus.publish_nowait(event)
        except BusClosed:  # the run is over; nothing reads events any more
            log.debug("after the bus closed, dropped %s", type(event).__name__)

    def kill(self, worker: int, sig: str, reason: str) -> None:
        """Send ``SIG<sig>`` to ``worker``'s process and log it as ``WorkerKilled`` (nothing if it has exited)."""
        if self.pool.signal(worker, sig):
            self._kill_times[worker] = time.monotonic()
            self._publish_nowait(
                WorkerKilled(step=self.group_step, source="controller", worker=worker, signal=sig, reason=reason)
            )

    async def _reap(self) -> None:
        """Notice exited processes at once: a local kill -9 needs no heartbeat timeout to be seen."""
        if not self.config.starts_workers:
            return  # none started here: a look at every worker 50 times a second for nothing (O(N) each)
        while True:
            for proc, code in self.pool.newly_exited():
                self.monitor.mark_gone(proc.worker, f"process exited with {code}")
                self._feed(WorkerChanged(proc.worker))  # marked gone: a group forming with it forms again
                try:
                    await self.bus.publish(
                        WorkerExited(step=self.group_step, source="controller", worker=proc.worker, returncode=code)
                    )
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, BusClosed):
                    return  # the run was cancelled from outside and its bus is gone
                if proc.spare and proc.hello is None and not self.stopping:
                    # Never watched, so no verdict would replace it: start its successor now, not at the next
                    # failure (which would then wait for a cold start). Not forever, though: spares that keep
                    # dying before their Hello (a broken environment) are left to the next failure.
                    self._spares_dead_before_hello += 1
                    if self._spares_dead_before_hello <= _SPARE_RETRIES:
                        self._top_up_spares()
                    else:
                        log.warning("%d spares in a row died before their Hello; none started now", _SPARE_RETRIES + 1)
            await anyio.sleep(0.02)

    async def _renew_leases(self) -> None:
        """Renew every live worker's lease each heartbeat interval (service mode: workers on other hosts, which a
        partition can cut off while they still run; see ``Lease``)."""
        lease = Lease(seconds=self.config.heartbeat_timeout_s * _LEASE_SHARE)
        while True:
            for proc in self.pool:
                if proc.stream is not None and not proc.gone and not proc.closed and not self.stopping:
                    await self.server.send(proc, lease)
            await anyio.sleep(self.config.heartbeat_interval_s)

    async def _stop_all(self, reason: str, *, finished: bool = False) -> None:
        for proc in self.pool:
            if not proc.running():
                continue
            if proc.popen is not None and (proc.stream is None or proc.stopped()):
                # Still starting (nothing to save, no need to wait for its Hello), or stopped (SIGSTOP: it
                # cannot read a Stop): killed, not asked.
                proc.popen.kill()
            else:
                await self.server.send(proc, Stop(reason=reason, finished=finished))
        with anyio.move_on_after(self.config.drain_timeout_s):
            while self.pool.running():
                await anyio.sleep(0.05)
        self.pool.kill_all()

    def _top_up_spares(self) -> None:
        for _ in range(self.pool.spares_missing()):
            self._spawn()

    async def _warm_spares(self) -> None:
        """Idle spares compile the step once now, rather than when they are needed."""
        for proc in self.pool:
            if proc.ready_spare and not proc.warmed:
                proc.warmed = True
                await self.server.send(proc, Warm(programs=self._programs))

    # --- messages from workers -----------------------------------------------------------------------------

    async def _report(self, report: Report) -> None:
        """A (rate-limited) report of refused connections or malformed lines: one warning and one event."""
        what = "refused a connection" if report.kind == "refused" else "ignored a message"
        more = f" ({report.count} in the last {self.server.limiter.interval_s:.0f} s)" if report.count > 1 else ""
        log.warning("controller: %s from %s%s: %s", what, report.peer, more, report.reason)
        kind = ConnectionRefused if report.kind == "refused" else MalformedHeartbeat
        event = kind(
            step=self.group_step,
            source="controller",
            peer=report.peer,
            reason=report.reason,
            count=report.count,
            message=report.reason,
        )
        try:
            await self.bus.publish(event)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, BusClosed):
            self.event_log.append(event)  # the last summaries, when the run was cancelled from outside

    async def _hello(self, message: Message, stream: Connection, peer: str) -> WorkerProcess | str:
        """The worker an authenticated connection's first message names, or why it is refused."""
        if not isinstance(message, Hello):
            return f"first message must be Hello, got {type(message).__name__}"
        if not self.config.starts_workers:
            return await self._external_hello(message, stream)
        proc = self.pool.get(message.worker)
        if proc is None or proc.stream is not None or proc.gone:
            return f"worker id {message.worker} was not started by this controller, is already connected, or is gone"
        if not descends_from(message.pid, proc.pid):
            # A cross-check, not a proof (the pid is what the peer says): the secret is the proof.
            return f"worker {message.worker} is process {proc.pid}, not {message.pid}"
        if self.target_steps >= 0 and message.target_steps != self.target_steps:
            target = self.target_steps
            why = f"worker {message.worker} asks for {message.target_steps} steps; this run's target is {target}"
            # Our own process (it proved the secret, its pid checks out): the worker command disagrees with the
            # run, and every replacement would too. End the run rather than replace workers forever.
            self.end(ConfigError(f"{why}: the worker command and `launch --steps` must agree"))
            return why
        return await self._admit(proc, message, stream)

    async def _external_hello(self, message: Hello, stream: Connection) -> WorkerProcess | str:
        """A worker the controller did not start: any id not seen before in this run (ids are never reused, so
        that nothing the lost worker's connection still says can be taken for its replacement's); 0..N-1 are
        the first group's, a replacement takes a new one (see ``docs/multiprocess.md``, *Several hosts*)."""
        if not 0 <= message.worker <= _MAX_WORKER_ID:
            return f"worker id {message.worker} is out of range"
        if message.worker in self.pool.procs:
            return f"worker id {message.worker} is already connected or was lost; a replacement takes a new id"
        if self.target_steps >= 0 and message.target_steps != self.target_steps:
            target = self.target_steps
            return f"worker {message.worker} asks for {message.target_steps} steps; this run's target is {target}"
        return await self._admit(self.pool.admit(message.worker), message, stream)

    async def _admit(self, proc: WorkerProcess, message: Hello, stream: Connection) -> WorkerProcess:
        proc.stream, proc.hello = stream, message
        if self.stopping:
            await self.server.send(proc, Stop(reason="the run is over"))
            return proc
        if self.supervisor.restored:
            await self._warm_spares()
        if self.target_steps < 0:
            self.target_steps = message.target_steps  # the first of the controller's own workers to say hello
        self.monitor.register(proc.worker)
        self._spares_dead_before_hello = 0
        self._feed(WorkerChanged(proc.worker))
        return proc

    async def _on_message(self, proc: WorkerProcess, message: Message) -> None:
        match message:
            case Heartbeat(worker=worker, generation=gen, step=step, step_time_s=seconds):
                if message.held:  # draining: the step it holds at (drain.py)
                    proc.held = step
                if proc.gone and proc.popen is None and not proc.told_to_stop and not self.stopping:
                    # Judged lost (a partition that healed): its place is taken; it must not wait in a group
                    # that will never call it again. (One the controller started was killed instead.)
                    proc.told_to_stop = True
                    log.warning("controller: worker %d was judged lost and is back; told to exit", worker)
                    taken = Stop(reason=f"worker {worker} was judged lost; its place is taken", exit_code=EXIT_REPLACE)
                    await self.server.send(proc, taken)
                proc.memory = message.memory or proc.memory
                if proc.gone or self.stopping:
                    return
                try:
                    self.monitor.observe(worker, step, seconds)
                except UnknownWorker:
                    log.warning("controller: heartbeat from worker %d, which is not watched; ignored", worker)
                    return
                if gen == self.group.generation and self.group.has(worker):
                    proc.step, proc.generation = step, gen
                    self._feed(Progress(worker, seconds))
            case Joined(generation=gen) if gen == self.group.generation:
                proc.joined = message
                await self._skipped(proc, message.skipped)
                self._feed(MemberJoined(proc.worker))
            case Saved(generation=gen) if gen == self.group.generation and self.durable is not None:
                await self._saved(proc, message)
            case Unreadable(generation=gen) if gen == self.group.generation:
                await self._unreadable_step(message)
            case Restored(generation=gen, tier=tier, nbytes=nbytes) if gen == self.group.generation:
                self._feed(MemberRestored(tier, nbytes))
            case Failed(generation=gen) if gen == self.group.generation:
                await self._failed(proc, message)
            case Requested():
                await self.relay.requested(message)
            case Published():
                await self.relay.published(message)
            case Noticed():
                await self._noticed(proc, message)
            case Finished(generation=gen) if gen == self.group.generation:
                proc.finished = message
                self.result.digests[proc.worker] = message.digest
                self._feed(MemberFinished(proc.worker))
            case _:
                log.info("controller: stale %s from worker %d ignored", type(message).__name__, proc.worker)

    async def _noticed(self, proc: WorkerProcess, message: Noticed) -> None:
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
            ignored = NoticeIgnored(step=self.group_step, source=f"worker-{proc.worker}", instance=about, reason=why)
            await self.bus.publish(ignored)
            return
        await self.bus.publish(msgspec.structs.replace(event, source=f"metadata@worker-{proc.worker}"))

    async def _saved(self, proc: WorkerProcess, saved: Saved) -> None:
        """A writer's part of a durable checkpoint; the step is committed once every writer's part is in."""
        assert self.durable is not None
        if proc.worker not in self.members:
            return
        try:
            step = self.durable.add(saved, self.members.index(proc.worker))
        except (CheckpointInvalid, StorageError) as exc:
            await self._not_committed(saved.step, exc)
            return
        if step is not None and self._to_commit is not None:
            self._commits_pending += 1
            self._to_commit.send_nowait(step)

    async def _commit_durable(self, queue: MemoryObjectReceiveStream[int]) -> None:
        """Commit each durable step whose parts are all in, in order, apart from the reading of messages."""
        async for step in queue:
            try:
                await self._commit(step)
            finally:
                self._commits_pending -= 1
                self._commits_settled.set()

    async def _not_committed(self, step: int, exc: Exception) -> None:
        log.error("controller: durable checkpoint of step %d not committed: %s", step, exc)
        await self.bus.publish(CheckpointFailed(step=step, source="controller", tier="durable", reason=str(exc)))

    async def _commit(self, step: int) -> None:
        assert self.durable is not None
        try:
            committed = await anyio.to_thread.run_sync(self.durable.commit, step)
        except (CheckpointInvalid, StorageError) as exc:
            await self._not_committed(step, exc)
            return
        self.durable_newest = max(self.durable_newest, committed.step)
        for worker in self.members:  # their replicas pinned for older durable steps may go
            await self.server.send(self.pool[worker], Committed(step=committed.step))
        await self.bus.publish(
            CheckpointCommitted(
                step=committed.step,
                source="controller",
                tier="durable",
                path=committed.path,
                bytes=committed.nbytes,
                seconds=committed.seconds,
            )
        )

    async def _unreadable_step(self, message: Unreadable) -> None:
        """A member found its shards of the step being restored damaged: unless it read them from the next tier,
        the group re-forms from the next best step. A durable step is withdrawn (its manifest set aside, its
        files kept for a look); a replica file is never listed again by the member that found it."""
        log.error(
            "controller: %s step %d unreadable (%s: %s)", message.tier, message.step, message.path, message.reason
        )
        await self.bus.publish(
            CheckpointCorrupt(
                step=message.step,
                source=f"worker-{message.worker}",
                tier=message.tier,
                path=message.path,
                reason=message.reason,
            )
        )
        if message.tier == "durable" and self.durable is not None:
            await anyio.to_thread.run_sync(self.durable.withdraw, message.step)
        why = f"{message.tier} step {message.step} unreadable: {message.reason}"
        self._feed(RestoreFailed(message.generation, message.step, why, message.recovered_from))

    async def _skipped(self, proc: WorkerProcess, skipped: tuple[str, ...]) -> None:
        for entry in skipped:
            path, _, why = entry.partition(": ")
            if path not in self._skipped_seen:  # every worker reads the same folder: one event per path
                self._skipped_seen.add(path)
                log.warning("controller: replica %s not restored: %s", path, why)
                await self.bus.publish(
                    ReplicaSkipped(step=self.group_step, source=f"worker-{proc.worker}", path=path, reason=why)
                )

    async def _failed(self, proc: WorkerProcess, failed: Failed) -> None:
        """The user's code failed in a worker, or the job cannot run in this mode: the run ends now. Another
        group would run the same data and program into the same error, so nothing is replaced or retried."""
        await self.bus.publish(
            StepFailed(
                step=failed.step,
                source=f"worker-{proc.worker}",
                error_type=failed.error_type,
                message=failed.message,
            )
        )
        where = f"worker {proc.worker} (pid {proc.pid}, log {self.pool.logs / f'worker-{proc.worker}.log'})"
        if failed.unsupported:
            self.end(JobUnsupported(f"refused before step 1 by {where}: {failed.message}"))
            return
        text = f"step {failed.step} failed in {where}: {failed.error_type}: {failed.message}"
        self.end(StepError(f"{text}\n{failed.traceback}".rstrip(), step=failed.step))

    # --- progress and failures -----------------------------------------------------------------------------

    async def _on_verdict(self, verdict: Verdict) -> None:
        proc = self.pool.get(verdict.worker)
        event = verdict_event(verdict, step=self.group_step)
        if isinstance(verdict, Lost) and proc is not None and proc.stopped():
            event = WorkerHung(
                step=self.group_step,
                source="heartbeat",
                worker=verdict.worker,
                stalled_s=verdict.silent_s,
                message=f"process {proc.pid} is stopped (SIGSTOP?) and silent for {verdict.silent_s:.2f} s",
            )
        killed = self._kill_times.pop(verdict.worker, None)
        if killed is not None:
            self.result.detected_after_s.append(event.mono_time - killed)
        try:
            await self.bus.publish(event)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, BusClosed):
            self.event_log.append(event)  # the run was cancelled from outside and its bus is gone

    def request_drain(self, instance: str, reason: str) -> None:
        """Take ``instance``'s workers out of the group at a planned step; seat none of it until readmitted."""
        if not self.stopping:
            self._feed(DrainRequested(instance, reason))

    def readmit(self, instance: str) -> None:
        """Workers on ``instance`` may be seated again."""
        self._feed(Readmitted(instance))

    def request_regroup(self, lost: set[int], reason: str, strategy: Strategy | None) -> None:
        """Replace ``lost`` workers and re-form the group; each lost member counts against the budget."""
        if not self.stopping:
            self._feed(RegroupRequested(frozenset(lost), reason, strategy))
