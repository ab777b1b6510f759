"""The multi-process controller: starts the worker processes, supervises them and re-forms their group.

The controller starts N worker processes (plus warm spares), hands them a ``jax.distributed`` group on a
free loopback port, watches their heartbeats and, when one is lost or hangs, replaces it and re-forms the
group. It is never restarted because a worker failed: it is the one process that knows the run's history.

Recovery (see ``docs/multiprocess.md``) is a chain of events on the controller's bus: ``WorkerLost`` or
``WorkerHung`` (the handlers see it first) -> the supervisor kills and replaces it -> ``RecoveryStarted``
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
The shell's own parts, functions over its state (``state.py``, below them all): ``messages.py`` and
``admission.py`` (what workers say), ``commits.py`` (durable commits), ``workers.py`` (their processes),
``ending.py`` (signals, the summary).
"""

from __future__ import annotations

import functools
import logging
import shutil
import threading

import anyio

from elastic_runtime.cluster.config import LaunchConfig, LaunchError, LaunchResult
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
from elastic_runtime.cluster.controller.heartbeat import watch
from elastic_runtime.cluster.controller.messages import (
    VERDICT_PRIORITY,
    heal_on_formed,
    mark_closed,
    on_message,
    publish_report,
    publish_verdict,
    take_corruption,
    take_verdict,
)
from elastic_runtime.cluster.controller.relay import EventRelay
from elastic_runtime.cluster.controller.server import WorkerServer
from elastic_runtime.cluster.controller.state import ControllerState
from elastic_runtime.cluster.controller.workers import reap, renew_leases, spawn
from elastic_runtime.core.bus import EventBus
from elastic_runtime.core.errors import ElasticRuntimeError
from elastic_runtime.core.events import Event, GroupFormed, SilentCorruption, WorkerHung, WorkerLost

__all__ = ["Controller"]

log = logging.getLogger(__name__)

# How long the first workers wait for the fork server's imports (2-5 s here, more under load) before they start as
# new processes instead: a bound on what a slow server costs, far above what a working one takes.
_FORK_SERVER_WAIT_S = 60.0


class Controller(ControllerState):
    """Starts, supervises and re-forms a group of worker processes. Single use.

    With an empty ``config.command`` it starts nothing (the service mode, ``elastic-runtime controller``): it
    coordinates the workers that say hello with the run's secret, judges them by their heartbeats only, and
    takes a replacement in when the orchestrator brings one up.

    It subscribes handlers of its own (``elastic_runtime.defaults.default_controller`` adds the built-in ones):
    the relay that forwards the group's events to the training script's handlers in the workers (``relay.py``),
    and, after every other handler, the ones that hand a ``WorkerLost``, ``WorkerHung`` or persistent
    ``SilentCorruption`` to the supervisor (and say a corruption healed once the group re-formed without it).

    Its state and the requests its parts make of it are
    :class:`~elastic_runtime.cluster.controller.state.ControllerState`'s.

    Raises:
        LaunchError: asked to listen on an address other hosts can reach, or to coordinate workers it does
            not start, without a secret from the user (``config.secret``).
    """

    def __init__(self, config: LaunchConfig) -> None:
        super().__init__(config)
        self.context = ControllerContext(self)
        self.bus = EventBus(self.context, handler_timeout=30.0, log=self.event_log)
        self.relay = EventRelay(self)
        self.relay.attach(self.bus)
        self.bus.subscribe(Event, self.outcome.on_event, timeout=None)
        for lost in (WorkerLost, WorkerHung):
            self.bus.subscribe(lost, functools.partial(take_verdict, self), priority=VERDICT_PRIORITY, timeout=None)
        corrupt = functools.partial(take_corruption, self)
        self.bus.subscribe(SilentCorruption, corrupt, priority=VERDICT_PRIORITY, timeout=None)
        self.bus.subscribe(GroupFormed, functools.partial(heal_on_formed, self), timeout=None)
        self.server = WorkerServer(
            secret=self.secret,
            on_hello=functools.partial(hello, self),
            on_message=functools.partial(on_message, self),
            on_report=functools.partial(publish_report, self),
            on_closed=functools.partial(mark_closed, self),
            auth_timeout_s=config.auth_timeout_s,
            max_pending=max(32, config.nprocs + config.spares),  # all of them may connect at once
        )
        if config.progress:
            console = GroupConsole(self.waiting_for)
            console.attach(self.bus)
            self.companions.append(console.run)

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
