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
worker's ``StepFailed``: ``StepError``), a job this mode cannot run (``JobUnsupported``), a spent failure budget
or a step that keeps failing (``RecoveryError``), or SIGTERM/SIGINT (drained; the run folder resumes it).

This module is the async shell; the decisions live in synchronous parts tested on their own: when and how the
group forms and re-forms, retries and gives up (``supervisor.py``, fed one input at a time from a memory
stream, its actions carried out by ``actions.py``), the group (``membership.py``), the failure budget and
recovery timing (``runtime/core/recovery.py``), the processes (``processes.py``) and the wire (``server.py``).
The shell's own parts: ``messages.py`` and ``admission.py`` (what workers say), ``commits.py`` (durable
commits), ``workers.py`` (their processes), ``ending.py`` (signals, the summary).
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import math
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from elastic_runtime.cluster import auth
from elastic_runtime.cluster.config import LaunchConfig, LaunchError, LaunchResult, Strategy
from elastic_runtime.cluster.controller.actions import supervise
from elastic_runtime.cluster.controller.admission import hello
from elastic_runtime.cluster.controller.commits import commit_durable
from elastic_runtime.cluster.controller.console import GroupConsole
from elastic_runtime.cluster.controller.context import ControllerContext
from elastic_runtime.cluster.controller.ending import (
    close_down,
    first_leaf,
    publish_finished,
    stop_workers,
    watch_signals,
    write_summary,
)
from elastic_runtime.cluster.controller.heartbeat import HeartbeatMonitor, watch
from elastic_runtime.cluster.controller.membership import Membership
from elastic_runtime.cluster.controller.messages import mark_closed, on_message, publish_report, publish_verdict
from elastic_runtime.cluster.controller.processes import ProcessPool
from elastic_runtime.cluster.controller.relay import EventRelay
from elastic_runtime.cluster.controller.runfolder import default_replica_dir, open_run
from elastic_runtime.cluster.controller.server import WorkerServer
from elastic_runtime.cluster.controller.supervision import (
    DrainRequested,
    Input,
    LeaveRequested,
    Readmitted,
    RegroupRequested,
)
from elastic_runtime.cluster.controller.supervisor import Supervisor
from elastic_runtime.cluster.controller.workers import reap, renew_leases, spawn
from elastic_runtime.core.bus import EventBus
from elastic_runtime.core.errors import BusClosed, ElasticRuntimeError
from elastic_runtime.core.eventlog import EventLog
from elastic_runtime.core.events import Event, WorkerKilled
from elastic_runtime.core.folders import PROGRAMS_PREFIX
from elastic_runtime.core.recovery import RecoveryTracker

if TYPE_CHECKING:
    from elastic_runtime.cluster.controller.durable import DurableCommits

__all__ = ["Controller"]

log = logging.getLogger(__name__)

# How long the first workers wait for the fork server's imports (2-5 s here, more under load) before they start as
# new processes instead: a bound on what a slow server costs, far above what a working one takes.
_FORK_SERVER_WAIT_S = 60.0


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


class Controller:
    """Starts, supervises and re-forms a group of worker processes. Single use.

    With an empty ``config.command`` it starts nothing (the service mode, ``elastic-runtime controller``): it
    coordinates the workers that say hello with the run's secret, judges them by their heartbeats only, and
    takes a replacement in when the orchestrator brings one up.

    It subscribes no handler of its own (``elastic_runtime.defaults.default_controller`` adds the built-in ones) but the
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
        self.programs = f"{PROGRAMS_PREFIX}{secrets.token_hex(8)}"
        self.event_log = EventLog(self.run_dir / "events.jsonl")
        self.context = ControllerContext(self)
        self.bus = EventBus(self.context, handler_timeout=30.0, log=self.event_log)
        self.relay = EventRelay(self)
        self.relay.attach(self.bus)
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
        # A worker started here is lost when its process exits or its connection closes; its silence alone says
        # only that the machine is loaded, until the hang timeout (the heartbeat's docstring).
        self.monitor = HeartbeatMonitor(
            timeout_s=config.heartbeat_timeout_s,
            start_timeout_s=config.heartbeat_start_timeout_s,
            hang_timeout_s=config.hang_timeout_s,
            alive=self.pool.runs_here,
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
        self.inputs_in, self.inputs = anyio.create_memory_object_stream[Input](max_buffer_size=math.inf)
        self.server = WorkerServer(
            secret=self.secret,
            on_hello=functools.partial(hello, self),
            on_message=functools.partial(on_message, self),
            on_report=functools.partial(publish_report, self),
            on_closed=functools.partial(mark_closed, self),
            auth_timeout_s=config.auth_timeout_s,
            max_pending=max(32, config.nprocs + config.spares),  # all of them may connect at once
        )
        self.port = 0
        # The durable checkpoints' store, opened by ``run`` once the fork server is starting (``open_durable``).
        self.durable: DurableCommits | None = None
        # Durable steps whose every part is in, committed one after another by ``commits.commit_durable``: a commit
        # (manifest, then pruning, seconds in GCS) awaited where messages are read would hold back the writer's
        # heartbeats, and the monitor would take a healthy worker for lost.
        self.to_commit: MemoryObjectSendStream[int] | None = None  # made (and closed) by ``run``
        self.commits_pending = 0
        self.commits_settled = anyio.Event()  # set when a commit ends
        self.durable_newest = -1  # the newest durable step this controller committed
        self.kill_times: dict[int, float] = {}  # worker -> when it was signalled, to time the detection
        # Every generation's coordination service stays up until the run ends: stopping one while a live
        # worker's client is still attached makes that client terminate its process.
        self.services: list[Any] = []
        self.standins: list[subprocess.Popen[bytes]] = []  # filling given-up generations' seats (``standin.py``)
        self.dead_before_hello = 0  # workers in a row that exited before their Hello: reset by any Hello
        self.settings_checked = False  # the script's own settings (Hello.settings), taken from the first Hello
        # Ending the run early: an error that ends it (a worker's StepError, JobUnsupported) or a signal
        # (SIGTERM, SIGINT) cancels the supervision, and the run drains like any other end.
        self.supervision: anyio.CancelScope | None = None  # made in the event loop, by run_async
        self._error: ElasticRuntimeError | LaunchError | None = None
        self.signalled = ""
        self.signalled_at = 0.0
        self.skipped_seen: set[str] = set()
        # Tasks run beside the wire and the monitor, and cancelled with them before the bus closes: a scheduler
        # backend's placement and watch loop (``runtime/cluster/controller/ray_backend.py``).
        self.companions: list[Callable[[], Coroutine[Any, Any, None]]] = []
        if config.progress:
            console = GroupConsole(self.waiting_for)
            console.attach(self.bus)
            self.companions.append(console.run)

    def waiting_for(self) -> str:
        """What the first group waits for, in words (the console says it while a real model starts)."""
        procs = [p for p in self.pool if not p.gone]
        connected = sum(p.hello is not None for p in procs)
        joined = sum(p.joined is not None for p in procs)
        n = self.config.nprocs
        if joined:
            return f"{joined} of {n} workers joined the first group; the others are joining (connecting, compiling)"
        if connected >= n:  # the spares count: the group forms from the first n to be ready
            return f"{connected} workers connected for a group of {n}; forming it"
        return (
            f"{connected} of {n} workers connected; the others are starting (importing the script and JAX, and "
            "the script's own code before it calls run())"
        )

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
            error = first_leaf(group, (LaunchError, ElasticRuntimeError))
            if error is not None:
                raise error from group
            raise

    async def run_async(self) -> LaunchResult:
        """Run the group to completion, or until SIGTERM/SIGINT (then ``ok`` is False and the run can be
        resumed). Raises LaunchError, RecoveryError, StepError or JobUnsupported when it cannot go on."""
        self.supervision = anyio.CancelScope()
        host = self.config.listen_host
        listener = await self.server.listen(host, self.config.listen_port)
        self.port = listener.port
        self.pool.controller_address = f"{host}:{self.port}"
        reason = ""
        keep_replicas = False
        self.to_commit, commit_queue = anyio.create_memory_object_stream[int](max_buffer_size=1024)
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
                                inner.start_soon(watch, self.monitor, functools.partial(publish_verdict, self))
                                inner.start_soon(reap, self)
                                inner.start_soon(self.server.report_due)
                                inner.start_soon(commit_durable, self, commit_queue)
                                if not self.config.starts_workers:
                                    inner.start_soon(renew_leases, self)
                                for companion in self.companions:
                                    inner.start_soon(companion)
                                if threading.current_thread() is threading.main_thread():  # signals go to it only
                                    inner.start_soon(watch_signals, self)
                    finally:
                        helpers_done.set()  # also when the run is cancelled from outside

                tg.start_soon(run_bus)
                tg.start_soon(run_helpers)
                try:
                    self.pool.start_fork_server()  # none without a command of its own to start (service mode)
                    self.durable = self.open_durable()  # its JAX import runs beside the server's
                    if self.config.starts_workers:
                        # The first workers too are forked once the server has imported JAX: one import on the
                        # machine, not one a worker (docs/benchmarks.md, "Start-up"). A server gone or slower
                        # than that, and they start as new processes.
                        if self.pool.forks is not None:
                            await anyio.to_thread.run_sync(
                                self.pool.forks.wait_ready, _FORK_SERVER_WAIT_S, abandon_on_cancel=True
                            )
                        for _ in range(self.config.nprocs + self.config.spares):
                            spawn(self)
                    with self.supervision:  # ended early by end() and by signals
                        await supervise(self)
                    if self._error is not None:
                        raise self._error
                    if self.signalled:
                        reason = f"stopped by {self.signalled} at step {self.group_step}; the run can be resumed"
                    elif self.target_steps >= 0 and self.group_step < self.target_steps:
                        # Every member said it finished, yet the group's committed step is short of the target:
                        # never a success (a member that finished early would make one).
                        reason = f"the workers finished at step {self.group_step} of {self.target_steps}"
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
                        reason, keep_replicas = await stop_workers(self, reason)
                        helpers.cancel()
                        with anyio.move_on_after(5):
                            await helpers_done.wait()
                        await close_down(self)
                        await publish_finished(self, reason, bus_done)
                    tg.cancel_scope.cancel()
        finally:
            if self.pool.forks is not None:  # the run ended before its workers were stopped
                self.pool.forks.close()
            self.to_commit.close()
            commit_queue.close()
            self.inputs_in.close()
            self.inputs.close()
            with anyio.CancelScope(shield=True):
                await listener.aclose()
            self.event_log.close()
            if self.config.replica_dir is None and not keep_replicas:  # ours, in /dev/shm: memory, not storage
                shutil.rmtree(self.replica_dir, ignore_errors=True)
            write_summary(self, reason)  # also when the run failed: summary.json then says why
        return self.result

    def open_durable(self) -> DurableCommits | None:
        """The store of ``--durable``'s checkpoints, None without one. Its storage modules import JAX, which
        the controller needs for nothing else: opened after the fork server's start, the two imports overlap."""
        config, location = self.config, self.config.durable_dir
        if not location:
            return None
        from elastic_runtime.cluster.controller.durable import DurableCommits  # imports JAX: not before the fork server

        metadata = {"run_id": self.record.run_id}
        return DurableCommits(location, writers=config.slice_size, keep=config.durable_keep, metadata=metadata)

    def end(self, error: ElasticRuntimeError | LaunchError) -> None:
        """End the run with ``error`` (the first one wins): every worker is stopped, the run fails with it."""
        if self._error is None:
            self._error = error
        self.supervisor.stopped = True
        if self.supervision is not None:
            self.supervision.cancel()

    def feed(self, event: Input) -> None:
        """Hand the supervisor an input; it takes them one at a time, in order (``actions.supervise``)."""
        try:
            self.inputs_in.send_nowait(event)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):  # the run is over
            log.debug("after the run, dropped %s", type(event).__name__)

    # --- processes -----------------------------------------------------------------------------------------

    def publish_nowait(self, event: Event) -> None:
        """Publish ``event`` from synchronous code; dropped once the bus is closed."""
        try:
            self.bus.publish_nowait(event)
        except BusClosed:  # the run is over; nothing reads events any more
            log.debug("after the bus closed, dropped %s", type(event).__name__)

    def kill(self, worker: int, sig: str, reason: str) -> None:
        """Send ``SIG<sig>`` to ``worker``'s process and log it as ``WorkerKilled`` (nothing if it has exited)."""
        if self.pool.signal(worker, sig):
            self.kill_times[worker] = time.monotonic()
            self.publish_nowait(
                WorkerKilled(step=self.group_step, source="controller", worker=worker, signal=sig, reason=reason)
            )

    # --- requests from handlers -----------------------------------------------------------------------------

    def request_drain(self, instance: str, reason: str) -> None:
        """Take ``instance``'s workers out of the group at a planned step; seat none of it until readmitted."""
        if not self.stopping:
            self.feed(DrainRequested(instance, reason))

    def readmit(self, instance: str) -> None:
        """Workers on ``instance`` may be seated again."""
        self.feed(Readmitted(instance))

    def request_leave(self, worker: int, reason: str) -> None:
        """Take member ``worker`` out at a planned step, as if it had asked to leave (``Leaving``)."""
        if not self.stopping:
            self.feed(LeaveRequested(worker, reason))

    def request_regroup(self, lost: set[int], reason: str, strategy: Strategy | None) -> None:
        """Replace ``lost`` workers and re-form the group; each lost member counts against the budget."""
        if not self.stopping:
            self.feed(RegroupRequested(frozenset(lost), reason, strategy))
