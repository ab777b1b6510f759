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


async def log_straggler(event: Straggler, ctx: ControllerContext) -> None:
    """On Straggler: log it. Replacing a slow-but-correct worker costs more than it saves on this scale."""
    log.warning(
        "worker %d is a straggler: %.3f s per step against a group median of %.3f s",
        event.worker,
        event.step_time_s,
        event.group_median_s,
    )
