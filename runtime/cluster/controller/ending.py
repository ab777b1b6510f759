"""How a run ends, in the shell: SIGTERM or SIGINT drains it, the members' final states are compared (the run is
marked finished only when every member's digest agrees), the workers are stopped, what the run held is let go,
``RunFinished`` and ``summary.json`` say how it went, and the first error in the controller's task group is the
one raised.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from typing import Any

import anyio

from elastic_runtime.cluster.controller.drain import final_checkpoint
from elastic_runtime.cluster.controller.runfolder import mark_finished
from elastic_runtime.cluster.controller.state import ControllerState
from elastic_runtime.cluster.controller.workers import stop_all
from elastic_runtime.core.errors import BusClosed
from elastic_runtime.core.events import RunFinished

__all__ = ["close_down", "conclude", "first_leaf", "publish_finished", "stop_workers", "watch_signals", "write_summary"]

log = logging.getLogger(__name__)


async def watch_signals(controller: ControllerState) -> None:
    """SIGTERM (what ``timeout``, systemd and Kubernetes send) and SIGINT drain the run: workers stopped,
    ``RunFinished`` and ``summary.json`` written, the replica folder in /dev/shm removed."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            log.warning("controller: %s at step %d; stopping the workers", name, controller.group_step)
            if not controller.signalled:
                controller.signalled, controller.signalled_at = name, time.monotonic()
            controller.supervisor.stopped = True
            if controller.supervision is not None:
                controller.supervision.cancel()


def conclude(controller: ControllerState) -> bool:
    """Whether the run finished (then the run folder says so): every member's final state the same."""
    digests = {controller.result.digests.get(w) for w in controller.members}
    if controller.result.ok and len(digests) != 1:
        # Replicas must agree bit for bit; if they do not, the run's result cannot be trusted.
        log.error("members %s finished with different states: %s", controller.members, controller.result.digests)
        controller.result.ok, controller.result.reason = False, "replicas diverged"
    if controller.result.ok:
        mark_finished(controller.run_dir, controller.record.run_id)
    return controller.result.ok


async def stop_workers(controller: ControllerState, reason: str) -> tuple[str, bool]:
    """Every worker stopped, after the members' states were compared and, for a drain with a durable store, a
    final checkpoint taken. Returns the run's reason (the drain's note added) and whether the replica files
    stay for ``--resume`` (a drain that could not checkpoint)."""
    done = conclude(controller)  # before the Stop that lets the workers remove replicas
    keep_replicas = False
    if controller.signalled and controller.durable is not None and controller.supervisor.restored:
        drained = await final_checkpoint(controller, reason, controller.signalled_at)
        reason = f"{reason}; {drained.note}"
        controller.result.drain_checkpoint = drained.checkpoint
        keep_replicas = drained.checkpoint < 0  # --resume reads them instead
    await stop_all(controller, reason or "run finished", finished=done)
    if controller.signalled:
        controller.result.drain_s = round(time.monotonic() - controller.signalled_at, 3)
    return reason, keep_replicas


async def close_down(controller: ControllerState) -> None:
    """The workers' listener, the stand-ins and every generation's coordination service let go, once the wire's
    helpers have ended."""
    # Closed before the last refusals are counted: a connection the kernel queued after that would be neither
    # served nor counted.
    await controller.server.aclose()
    await controller.server.flush()
    for standin in controller.standins:  # past its timeout, or its service is going now
        standin.kill()
        await anyio.to_thread.run_sync(standin.wait)
    for service in controller.services:
        await anyio.to_thread.run_sync(service.shutdown)


async def publish_finished(controller: ControllerState, reason: str, bus_done: anyio.Event) -> None:
    """``RunFinished``, the last event, then the bus closed once every pending event is dispatched and logged."""
    finished = RunFinished(
        step=controller.group_step,
        source="controller",
        ok=controller.result.ok,
        reason=reason or ("" if controller.result.ok else "cancelled"),
        memory={str(p.worker): p.memory for p in controller.pool if p.memory},
    )
    try:
        await controller.bus.publish(finished)
        await controller.bus.close()
        with anyio.move_on_after(5):
            await bus_done.wait()
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, BusClosed):
        controller.event_log.append(finished)  # cancelled from outside: the bus is gone
        await controller.bus.close()


def write_summary(controller: ControllerState, reason: str) -> None:
    controller.result.step = controller.group_step
    controller.result.survivor_restarts = controller.supervisor.survivor_restarts
    controller.result.target_steps = controller.target_steps
    controller.result.reason = controller.result.reason or reason
    controller.result.longest_heartbeat_gap_s = round(controller.monitor.longest_gap_s, 3)
    controller.result.longest_training_heartbeat_gap_s = round(controller.monitor.longest_training_gap_s, 3)
    (controller.run_dir / "summary.json").write_text(json.dumps(controller.result.__dict__, default=str))


def first_leaf(
    group: BaseExceptionGroup[Any], kind: type[BaseException] | tuple[type[BaseException], ...]
) -> BaseException | None:
    """The first exception of type ``kind`` in a (nested) exception group."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            found = first_leaf(exc, kind)
            if found is not None:
                return found
        elif isinstance(exc, kind):
            return exc
    return None
