"""Replace a straggler at a planned step, where the controller chose it (a controller-side handler).

A lost or hung worker needs no handler: the controller's supervisor takes the heartbeat monitor's verdict itself
(it kills the worker, replaces it and re-forms the group, ``cluster/controller/supervisor.py``), and the
``WorkerLost`` or ``WorkerHung`` event is published for the handlers to see. A handler may change how the group
re-forms with ``ctx.regroup(..., strategy=Strategy.RESTART)`` (every worker replaced, the state from the replica
files): the worker is not counted twice.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from elastic_runtime.core.events import Straggler

if TYPE_CHECKING:
    from elastic_runtime.cluster.controller.context import ControllerContext

log = logging.getLogger(__name__)


async def replace_straggler(event: Straggler, ctx: ControllerContext) -> None:
    """On Straggler: do what the controller chose (``event.action``; ``cluster/controller/stragglers.py``): replace
    the worker with a ready spare at a planned step (nothing lost, no failure counted), or keep it; log which and
    why. Subscribe your own handler instead to decide otherwise (for example: keep every straggler, page someone)."""
    log.warning("worker %d is a straggler: %s", event.worker, event.reason)
    if event.action == "replace":
        ctx.replace(event.worker, reason=f"straggler: {event.reason}")
