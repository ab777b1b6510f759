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
- ``MaintenanceCompleted`` (or a notice of a window whose end has passed) -> :meth:`DrainScheduler.reconcile`
  drops a drain still pending and uncordons the devices; the scale-up watcher then offers them back
  (``ScaleUpAvailable`` -> re-mesh).
- ``Preempted`` -> :func:`checkpoint_on_preemption` asks for an emergency checkpoint at once (the grace period
  is about 30 s on Compute Engine) and a drain now.

The scheduler acts on each instance's reconciled window (``elastic_runtime.maintenance.reconcile``), not on the
notices replayed in the order they came: a ``Drain`` asked for in answer to a notice that a newer one has
overtaken (a backlog's ``Started``, whose ``Drain`` is dispatched after its ``Completed``) is not carried out,
and a window already over leaves nothing drained.

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
from elastic_runtime.core.events import (
    Drain,
    MaintenanceCompleted,
    MaintenanceScheduled,
    MaintenanceStarted,
    Notice,
    Preempted,
)
from elastic_runtime.maintenance.reconcile import Window, fold, verdict, when

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

# The scheduler folds a notice into its instance's window before the notice's other handlers run, so that they
# (and a user's) see the reconciled state.
RECONCILE_FIRST = 100


def devices_of(instance: str, instance_devices: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The devices ``instance`` hosts: an exact key of ``instance_devices``, else the first glob key it matches."""
    if instance in instance_devices:
        return instance_devices[instance]
    for pattern, devices in instance_devices.items():
        if fnmatch.fnmatchcase(instance, pattern):
            return devices
    return ()


def _over(event: MaintenanceScheduled | MaintenanceStarted) -> bool:
    """Whether the notice announces a window whose end has already passed (a backlog's old news)."""
    end = event.window_end if isinstance(event, MaintenanceScheduled) else None
    return end is not None and end <= time.time()


async def checkpoint_on_notice(event: MaintenanceScheduled | MaintenanceStarted, ctx: RuntimeContext) -> None:
    """On a maintenance notice: save the newest snapshot to the durable tiers now (not for a window already over)."""
    if _over(event):
        return
    start = event.window_start if isinstance(event, MaintenanceScheduled) else time.time()
    await ctx.request_checkpoint(
        ctx.config.maintenance_checkpoint_tiers,
        reason=f"maintenance of {event.instance} ({event.kind or 'unspecified'}) from {when(start)}",
    )


async def plan_drain(event: MaintenanceScheduled, ctx: RuntimeContext) -> None:
    """On MaintenanceScheduled: ask for a drain of the instance ``drain_lead_s`` before its window starts (none
    for a window already over)."""
    if _over(event):
        log.info("maintenance of %s: its window ended at %s; nothing to drain", event.instance, when(event.window_end))
        return
    deadline = None if event.window_start is None else event.window_start - ctx.config.drain_lead_s
    await ctx.publish(
        Drain(
            step=ctx.step,
            source="maintenance",
            instance=event.instance,
            deadline=deadline,
            reason=f"maintenance window of {event.instance} opens at {when(event.window_start)}",
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
    """Carries out ``Drain`` requests at their deadline and re-admits instances whose maintenance is over.

    A runtime component: :meth:`run` sleeps until the earliest pending deadline. Its handlers only record and
    wake, so they return at once. A later ``Drain`` of the same instance replaces the pending one (a rescheduled
    window).

    Each notice is folded into its instance's window (``windows``, :meth:`reconcile`). A ``Drain`` the notice
    handlers asked for (source "maintenance") is carried out only while that window calls for one, when it comes
    due: one asked for in answer to a notice that a newer one has overtaken is dropped, and the instance is
    re-admitted when the window ends (its announced end, or a ``MaintenanceCompleted``). A ``Drain`` from any
    other source is carried out as asked (a ``MaintenanceCompleted`` of its instance undoes it too).

    Args:
        clock: wall clock (epoch s), injectable for tests.
    """

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.pending: dict[str, Drain] = {}
        self.drained: set[str] = set()
        self.by_notice: set[str] = set()  # drained at the notice handlers' request: re-admitted when its window ends
        self.windows: dict[str, Window] = {}  # instance -> its maintenance window, as its notices so far tell it
        self._wake = anyio.Event()

    def attach(self, ctx: RuntimeContext) -> None:
        """Subscribe the scheduler's handlers (call once, before the run starts)."""
        for kind in (MaintenanceScheduled, MaintenanceStarted, MaintenanceCompleted, Preempted):
            ctx.subscribe(kind, self.reconcile, priority=RECONCILE_FIRST)
        ctx.subscribe(Drain, self.plan)

    async def reconcile(self, event: Notice, ctx: RuntimeContext) -> None:
        """On a maintenance notice: fold it into its instance's window; a window that is over (completed,
        cancelled, or past its announced end) drops a pending drain and lets the instance's devices back in."""
        now = self.clock()
        window = fold(self.windows.get(event.instance), event, now)
        self.windows[event.instance] = window
        self._wake.set()
        decided = verdict(window, now, ctx.config.drain_lead_s)
        if decided.drain_at is None:
            self.readmit(event.instance, decided.reason, ctx)

    async def plan(self, event: Drain, ctx: RuntimeContext) -> None:
        """On Drain: due now -> carried out now; otherwise remembered for :meth:`run` (replacing a pending one)."""
        self.pending.pop(event.instance, None)
        if event.deadline is None or event.deadline <= self.clock():
            await self._carry_out(event, ctx)
            return
        self.pending[event.instance] = event
        self._wake.set()

    def readmit(self, instance: str, reason: str, ctx: RuntimeContext) -> None:
        """Forget a pending drain of ``instance`` and let its devices back in, if it was drained."""
        self.pending.pop(instance, None)
        self.by_notice.discard(instance)
        if instance not in self.drained:
            return
        self.drained.discard(instance)
        devices = devices_of(instance, ctx.config.instance_devices)
        ctx.uncordon(devices)
        log.info("maintenance of %s is over (%s): devices %s re-admitted", instance, reason, list(devices))

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

    async def _carry_out(self, request: Drain, ctx: RuntimeContext) -> None:
        """Drain ``request.instance`` now, unless its window no longer calls for the notice handlers' request."""
        window = self.windows.get(request.instance)
        if request.source == "maintenance" and window is not None:
            decided = verdict(window, self.clock(), ctx.config.drain_lead_s)
            if decided.drain_at is None:
                log.info("drain of %s not done (%s): %s", request.instance, request.reason, decided.reason)
                return
        await self.drain(request.instance, request.reason, ctx)
        if request.source == "maintenance" and request.instance in self.drained:
            self.by_notice.add(request.instance)

    async def run(self, ctx: RuntimeContext) -> None:
        """Drain each pending instance when its deadline comes (if its window still calls for it then), and
        re-admit one drained for a notice when its window's announced end has passed."""
        while True:
            self._wake = anyio.Event()
            now = self.clock()
            due = [d for d in self.pending.values() if d.deadline is not None and d.deadline <= now]
            for request in due:
                del self.pending[request.instance]
                await self._carry_out(request, ctx)
            ends: list[float] = []
            for instance in list(self.by_notice):
                window = self.windows.get(instance)
                if window is None:
                    continue
                decided = verdict(window, self.clock(), ctx.config.drain_lead_s)
                if decided.drain_at is None:
                    self.readmit(instance, decided.reason, ctx)
                elif decided.ends_at is not None:
                    ends.append(decided.ends_at)
            deadlines = [d.deadline for d in self.pending.values() if d.deadline is not None]
            wait = min(deadlines + ends, default=math.inf) - self.clock()
            with anyio.move_on_after(max(wait, 0)):
                await self._wake.wait()
