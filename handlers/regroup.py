"""Replace a lost or hung worker of a multi-process group and re-form the group (controller-side handlers)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from elastic_runtime.core.events import Straggler, WorkerHung, WorkerLost

if TYPE_CHECKING:
    from elastic_runtime.cluster.controller.context import ControllerContext

log = logging.getLogger(__name__)


async def regroup_on_worker_failure(event: WorkerLost | WorkerHung, ctx: ControllerContext) -> None:
    """On WorkerLost or WorkerHung: make sure the worker is gone, then ask for a new group without it.

    A hung (or SIGSTOPped) worker is killed first: it must not wake up half-way through the re-forming and
    rejoin a group that has moved on. The controller picks the strategy (in-process re-forming by default).
    """
    ctx.kill(event.worker, reason=f"{type(event).__name__}: {event.message}")
    ctx.regroup({event.worker}, reason=type(event).__name__)


async def replace_straggler(event: Straggler, ctx: ControllerContext) -> None:
    """On Straggler: do what the controller chose (``event.action``; ``cluster/controller/stragglers.py``): replace
    the worker with a ready spare at a planned step (nothing lost, no failure counted), or keep it; log which and
    why. Subscribe your own handler instead to decide otherwise (for example: keep every straggler, page someone)."""
    log.warning("worker %d is a straggler: %s", event.worker, event.reason)
    if event.action == "replace":
        ctx.replace(event.worker, reason=f"straggler: {event.reason}")
