"""How a run ends, in the shell: SIGTERM or SIGINT drains it, the members' final states are compared (the run is
marked finished only when every member's digest agrees), ``summary.json`` says how it went, and the first error
in the controller's task group is the one raised.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from typing import TYPE_CHECKING, Any

import anyio

from runtime.cluster.controller.runfolder import mark_finished

if TYPE_CHECKING:
    from runtime.cluster.controller.shell import Controller

__all__ = ["conclude", "first_leaf", "watch_signals", "write_summary"]

log = logging.getLogger(__name__)


async def watch_signals(controller: Controller) -> None:
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


def conclude(controller: Controller) -> bool:
    """Whether the run finished (then the run folder says so): every member's final state the same."""
    digests = {controller.result.digests.get(w) for w in controller.members}
    if controller.result.ok and len(digests) != 1:
        # Replicas must agree bit for bit; if they do not, the run's result cannot be trusted.
        log.error("members %s finished with different states: %s", controller.members, controller.result.digests)
        controller.result.ok, controller.result.reason = False, "replicas diverged"
    if controller.result.ok:
        mark_finished(controller.run_dir, controller.record.run_id)
    return controller.result.ok


def write_summary(controller: Controller, reason: str) -> None:
    controller.result.step = controller.group_step
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
