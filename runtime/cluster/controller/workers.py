"""The workers' processes, as the shell handles them: started (spares topped up and warmed up), their exits
noticed at once by the reaper, their leases renewed in the service mode, and all of them stopped when the run ends.
"""

from __future__ import annotations

import logging
import time

import anyio

from elastic_runtime.cluster.config import LaunchError
from elastic_runtime.cluster.controller.processes import WorkerProcess, log_tail
from elastic_runtime.cluster.controller.state import ControllerState
from elastic_runtime.cluster.controller.supervision import WorkerChanged
from elastic_runtime.cluster.protocol import Lease, Stop, Warm
from elastic_runtime.core.errors import BusClosed
from elastic_runtime.core.events import WorkerExited, WorkerStarted
from elastic_runtime.core.progress import say

__all__ = ["reap", "renew_leases", "spawn", "stop_all", "top_up_spares", "warm_spares"]

log = logging.getLogger(__name__)

# Workers in a row that exit before their Hello: the script fails before it reaches the runtime (an import error, a
# raise at its top), and every replacement would fail the same way. The run ends, the traceback on the console.
START_FAILURES = 3
_TELL_AFTER_S = 10.0  # a finished run's workers still running their scripts this long: the console says so
# A worker's lease, as a share of the heartbeat timeout: it stops stepping before the controller, having heard
# nothing either, re-forms the group without it.
_LEASE_SHARE = 0.75
_LOOK_S = 1.0  # the reaper's look at every process when no exit woke it


def spawn(controller: ControllerState) -> WorkerProcess:
    proc = controller.pool.spawn()
    controller.publish_nowait(WorkerStarted(source="controller", worker=proc.worker, pid=proc.pid, spare=True))
    return proc


async def reap(controller: ControllerState) -> None:
    """Notice exited processes at once: a local kill -9 needs no heartbeat timeout to be seen. Woken by their
    exits (``exits.py``), with a look every second besides: a wake missed costs a second, not a run."""
    exits = controller.pool.exits
    try:
        while controller.config.starts_workers:  # none started here: nothing to reap
            await reap_exited(controller)
            await anyio.to_thread.run_sync(exits.wait, _LOOK_S, abandon_on_cancel=True)
    finally:
        exits.close()  # once its thread returned, woken for it


async def reap_exited(controller: ControllerState) -> None:
    """Mark each newly exited process gone and publish its exit."""
    exited = controller.pool.newly_exited()
    if exited:
        controller.changes.tell()  # stop_all waits for the last exit
    for proc, code in exited:
        controller.monitor.mark_gone(proc.worker, f"process exited with {code}")
        controller.feed(WorkerChanged(proc.worker))  # marked gone: a group forming with it forms again
        try:
            await controller.bus.publish(
                WorkerExited(step=controller.group_step, source="controller", worker=proc.worker, returncode=code)
            )
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, BusClosed):
            continue  # the run was cancelled from outside and its bus is gone: still reaped, for stop_all
        if proc.hello is None and not controller.stopping:
            controller.dead_before_hello += 1
            if controller.dead_before_hello >= START_FAILURES:
                controller.end(LaunchError(start_failure(controller, proc, code)))
            else:
                # A spare (a seat needs a hello), never watched, so no verdict would replace it: start its
                # successor now, not at the next failure (which would then wait for a cold start).
                top_up_spares(controller)


def start_failure(controller: ControllerState, proc: WorkerProcess, code: int) -> str:
    """Why the run ends: the last of ``START_FAILURES`` workers in a row that exited before their Hello."""
    path = controller.pool.logs / f"worker-{proc.worker}.log"
    return (
        f"{controller.dead_before_hello} workers in a row exited before connecting (the last, worker "
        f"{proc.worker}, with exit code {code}): the worker command fails before it reaches the runtime, and "
        f"every replacement would too. The end of {path}:\n{log_tail(path)}"
    )


async def renew_leases(controller: ControllerState) -> None:
    """Renew every live worker's lease each heartbeat interval (service mode: workers on other hosts, which a
    partition can cut off while they still run; see ``Lease``)."""
    lease = Lease(seconds=controller.config.heartbeat_timeout_s * _LEASE_SHARE)
    while True:
        departing = controller.supervisor.departing  # drained: they step on with the old group to a planned step
        for proc in controller.pool:
            live = not proc.gone or proc.worker in departing
            if proc.stream is not None and live and not proc.closed and not controller.stopping:
                await controller.server.send(proc, lease)
        await anyio.sleep(controller.config.heartbeat_interval_s)


async def stop_all(controller: ControllerState, reason: str, *, finished: bool = False) -> None:
    """Every worker told to stop (one still starting, or stopped, killed) and waited for, then killed. After a
    finished run each worker's ``run()`` returns and the script goes on (an evaluation, a save): those get
    ``finish_timeout_s`` to end on their own, the others ``drain_timeout_s``."""
    for proc in controller.pool:
        if not proc.running():
            continue
        if proc.popen is not None and (proc.stream is None or proc.stopped()):
            # Still starting (nothing to save, no need to wait for its Hello), or stopped (SIGSTOP: it
            # cannot read a Stop): killed, not asked.
            proc.popen.kill()
        else:
            await controller.server.send(proc, Stop(reason=reason, finished=finished))
    config = controller.config
    running = controller.pool.running
    with anyio.move_on_after(config.finish_timeout_s if finished else config.drain_timeout_s):
        # Woken by each exit (reap) and each connection's end (a worker not started here).
        told_at = time.monotonic() + _TELL_AFTER_S
        if finished and config.progress and not await controller.changes.until(lambda: not running(), told_at):
            still = sum(proc.running() for proc in controller.pool)
            say(
                f"the run finished; {still} worker(s) still run the script's code after run() (their logs: "
                f"{controller.pool.logs}); killed after {config.finish_timeout_s:g} s (--finish-timeout)"
            )
        await controller.changes.until(lambda: not running())
    controller.pool.kill_all()


def top_up_spares(controller: ControllerState) -> None:
    for _ in range(controller.pool.spares_missing()):
        spawn(controller)


async def warm_spares(controller: ControllerState) -> None:
    """Idle spares compile the step once now, rather than when they are needed."""
    for proc in controller.pool:
        if proc.ready_spare and not proc.warmed:
            proc.warmed = True
            await controller.server.send(proc, Warm(programs=controller.programs))
