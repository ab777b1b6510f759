"""A clean stop that loses nothing: on SIGTERM or SIGINT, with a durable tier, the group's newest step is made
durable before the workers exit.

Kubernetes and SLURM deliver preemption and node drains as a SIGTERM with a grace period. The controller then
(:func:`final_checkpoint`) tells every member to hold (``Stop(hold=True)``: the step in flight is finished or
abandoned, no new one starts) and to say the step it holds at (``Heartbeat.held``); the members of a group
differ by at most the step in flight, so the newest step every member holds is the smallest of those. Unless
that step is durable already, the first slice writes its parts of it (``Stop(durable_step=...)``: from RAM, or
from the replica file when the process went one step further) and the controller commits it as it commits any
durable step. All within ``LaunchConfig.grace_s`` of the signal; what did not fit is said in the run's reason.
``launch --resume`` then continues from that step with nothing run again. The ``/dev/shm`` replicas are removed
only once it is committed (``Controller.run_async``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from elastic_runtime.cluster.controller.state import ControllerState
from elastic_runtime.cluster.protocol import Stop

__all__ = ["Drained", "final_checkpoint"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Drained:
    """What the drain's final checkpoint came to."""

    held_at: int  # the newest step every member held; -1: the group did not hold in time
    checkpoint: int  # the durable step the run can resume from with nothing run again; -1: none
    seconds: float  # from the signal to the commit (or to giving up)
    note: str  # for the run's reason and the log


async def final_checkpoint(controller: ControllerState, reason: str, signalled_at: float) -> Drained:
    """Hold the group and commit a durable checkpoint of its newest step, within the grace period."""
    deadline = signalled_at + controller.config.grace_s
    pool, members = controller.pool, list(controller.members)

    def drained(held_at: int, checkpoint: int, note: str) -> Drained:
        seconds = time.monotonic() - signalled_at
        (log.info if checkpoint >= 0 else log.warning)("controller: drain: %s (%.2f s)", note, seconds)
        return Drained(held_at, checkpoint, seconds, f"{note} ({seconds:.2f} s after the signal)")

    if not members or any(pool[w].gone for w in members):
        return drained(-1, -1, "no final durable checkpoint: the group was not whole")
    for worker in members:
        await controller.server.send(pool[worker], Stop(reason=reason, hold=True))
    if not await controller.changes.until(lambda: all(pool[w].held >= 0 for w in members), deadline):
        why = f"the group did not hold within the grace period of {controller.config.grace_s} s"
        return drained(-1, -1, f"no final durable checkpoint: {why}")
    step = min(pool[w].held for w in members)
    if step <= max(controller.result.resumed_from, 0):
        return drained(step, -1, f"no final durable checkpoint: no step committed since the start (step {step})")
    if step <= controller.durable_newest:
        return drained(step, step, f"step {step} was durable already")
    for worker in members:
        await controller.server.send(pool[worker], Stop(reason=reason, durable_step=step))
    if not await controller.changes.until(lambda: controller.durable_newest >= step, deadline):
        why = f"not committed within the grace period of {controller.config.grace_s} s"
        return drained(step, -1, f"final durable checkpoint of step {step} {why}")
    return drained(step, step, f"final durable checkpoint of step {step} committed")
