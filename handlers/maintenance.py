"""Act on Google Cloud notices before they hurt: checkpoint durably now, drain before the window opens.

The chain, every link an event a user can watch or replace:

- ``MaintenanceScheduled`` -> :func:`checkpoint_on_notice` asks for a durable checkpoint now
  (``SaveCheckpoint``), and :func:`plan_drain` asks for a ``Drain`` of the instance with its deadline
  ``drain_lead_s`` before the window starts.
- ``MaintenanceStarted`` -> the same, with the deadline now (the window opened unannounced, or the metadata
  server's 60-second warning).
- ``Drain`` -> :class:`DrainScheduler` waits for the deadline, then cordons the instance's devices
  (``instance_devices``) and re-meshes onto the rest, while every device still works, so the live state is
  resharded instead of lost (``MeshChanged``, reason "drain ...").
- ``MaintenanceCompleted`` -> :meth:`DrainScheduler.readmit` drops a drain still pending and uncordons the
  devices; the scale-up watcher then offers them back (``ScaleUpAvailable`` -> re-mesh).
- ``Preempted`` -> :func:`checkpoint_on_preemption` asks for an emergency checkpoint at once (the grace period
  is about 30 s on Compute Engine) and a drain now.

A handler never waits for a later event: the bus dispatches one event at a time, so waiting inside a handler
for the checkpointer's ``CheckpointCommitted`` would wait forever. Timed work lives in the scheduler's
``run``, a runtime component.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio

from elastic_runtime.core.errors import MeshUnavailable
from elastic_runtime.core.events import Drain, MaintenanceCompleted, MaintenanceScheduled, MaintenanceStarted, Preempted

if TYPE_CHECKING:
    from elastic_runtime.core.context import RuntimeContext

__all__ = [
    "DrainScheduler",
    "checkpoint_on_notice",
    "checkpoint_on_preemption",
    "devices_of",
    "drain_on_start",
    "plan_drain",
]

log = logging.getLogger(__name__)


def devices_of(instance: str, instance_devices: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The devices ``instance`` hosts: an exact key of ``instance_devices``, else the first glob key it matches."""
    if instance in instance_devices:
        return instance_devices[instance]
    for pattern, devices in instance_devices.items():
        if fnmatch.fnmatchcase(instance, pattern):
            return devices
    return ()


def _when(epoch: float | None) -> str:
    return "unknown time" if epoch is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


async def checkpoint_on_notice(event: MaintenanceScheduled | MaintenanceStarted, ctx: RuntimeContext) -> None:
    """On a maintenance notice: save the newest snapshot to the durable tiers now."""
    start = event.window_start if isinstance(event, MaintenanceScheduled) else time.time()
    await ctx.request_checkpoint(
        ctx.config.maintenance_checkpoint_tiers,
        reason=f"maintenance of {event.instance} ({event.kind or 'unspecified'}) from {_when(start)}",
    )


async def plan_drain(event: MaintenanceScheduled, ctx: RuntimeContext) -> None:
    """On MaintenanceScheduled: ask for a drain of the instance ``drain_lead_s`` before its window starts."""
    deadline = None if event.window_start is None else event.window_start - ctx.config.drain_lead_s
    await ctx.publish(
        Drain(
            step=ctx.step,
            source="maintenance",
            instance=event.instance,
            deadline=deadline,
            reason=f"maintenance window of {event.instance} opens at {_when(event.window_start)}",
        )
    )


async def drain_on_start(event: MaintenanceStarted, ctx: RuntimeContext) -> None:
    """On MaintenanceStarted: drain the instance now."""
    await ctx.publish(
        Drain(
            step=ctx.step,
            source="maintenance",
            instance=event.instance,
            deadline=time.time(),
            reason=f"maintenance of {event.instance} started ({event.kind or 'unspecified'})",
        )
    )


async def checkpoint_on_preemption(event: Preempted, ctx: RuntimeContext) -> None:
    """On Preempted: an emergency checkpoint now, within the grace period, then drain the instance."""
    await ctx.request_checkpoint(
        ctx.config.preemption_checkpoint_tiers, reason=f"emergency: {event.instance} is being preempted"
    )
    await ctx.publish(
        Drain(
            step=ctx.step,
            source="maintenance",
            instance=event.instance,
            deadline=time.time(),
            reason=f"{event.instance} is being preempted",
        )
    )


class DrainScheduler:
    """Carries out ``Drain`` requests at their deadline and re-admits instances after their maintenance.

    A runtime component: :meth:`run` sleeps until the earliest pending deadline. Its handlers only record
    and wake, so they return at once. A later ``Drain`` of the same instance replaces the pending one (a
    rescheduled window).

    Args:
        clock: wall clock (epoch s), injectable for tests.
    """

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.pending: dict[str, Drain] = {}
        self.drained: set[str] = set()
        self._wake = anyio.Event()

    def attach(self, ctx: RuntimeContext) -> None:
        """Subscribe the scheduler's handlers (call once, before the run starts)."""
        ctx.subscribe(Drain, self.plan)
        ctx.subscribe(MaintenanceCompleted, self.readmit)

    async def plan(self, event: Drain, ctx: RuntimeContext) -> None:
        """On Drain: due now -> drain now; otherwise remember it for :meth:`run`."""
        if event.deadline is None or event.deadline <= self.clock():
            self.pending.pop(event.instance, None)
            await self.drain(event.instance, event.reason, ctx)
            return
        self.pending[event.instance] = event
        self._wake.set()

    async def readmit(self, event: MaintenanceCompleted, ctx: RuntimeContext) -> None:
        """On MaintenanceCompleted: forget a pending drain and let the instance's devices back in."""
        self.pending.pop(event.instance, None)
        self._wake.set()
        if event.instance not in self.drained:
            return
        self.drained.discard(event.instance)
        devices = devices_of(event.instance, ctx.config.instance_devices)
        ctx.uncordon(devices)
        log.info("maintenance of %s completed: devices %s re-admitted", event.instance, list(devices))

    async def drain(self, instance: str, reason: str, ctx: RuntimeContext) -> None:
        """Cordon ``instance``'s devices and re-mesh onto the rest (live state is resharded, not lost)."""
        devices = devices_of(instance, ctx.config.instance_devices)
        if not devices:
            log.warning("drain of %s: no devices configured for it (instance_devices); nothing to move", instance)
            return
        self.drained.add(instance)
        ctx.cordon(devices)
        if not set(devices) & set(ctx.mesh_devices):
            return  # the mesh already avoids them
        try:
            mesh = ctx.policy.fit(await ctx.healthy_devices())
        except MeshUnavailable as exc:
            # Nothing to move onto: the durable checkpoint requested with the notice is the protection left.
            log.warning("drain of %s: no mesh without devices %s (%s); keeping the current one", instance, devices, exc)
            ctx.uncordon(devices)
            self.drained.discard(instance)
            return
        ctx.remesh(mesh, reason=f"drain {instance}: {reason}")

    async def run(self, ctx: RuntimeContext) -> None:
        """Drain each pending instance when its deadline comes."""
        while True:
            self._wake = anyio.Event()
            now = self.clock()
            due = [d for d in self.pending.values() if d.deadline is not None and d.deadline <= now]
            for request in due:
                del self.pending[request.instance]
                await self.drain(request.instance, request.reason, ctx)
            deadlines = [d.deadline for d in self.pending.values() if d.deadline is not None]
            wait = min(deadlines) - self.clock() if deadlines else math.inf
            with anyio.move_on_after(max(wait, 0)):
                await self._wake.wait()
