"""Drain a host's workers out of a multi-process group before its maintenance window (controller-side handlers).

The multi-process counterpart of ``handlers/maintenance.py``, written with the controller's public ``ctx``
(``runtime/cluster/controller/context.py``); ``elastic_runtime.defaults.default_controller`` subscribes it. Workers say
which instance (host) they run on in their ``Hello`` (``ctx.instances``), so a notice maps to workers:

- ``MaintenanceScheduled`` -> :meth:`HostDrains.plan`: with a durable tier (``launch --durable``), a
  ``SaveCheckpoint`` now, which the workers answer with a durable checkpoint (:func:`save_when_asked`, run in
  every worker); then, ``drain_lead_s`` before the window starts (at once if that is past),
  ``ctx.drain(instance)``: the members on it leave the group at a planned step boundary, the others re-form
  there from their own memory (0 steps lost, no failure counted), and no worker of the host is seated again
  until its maintenance is over.
- A notice whose window is already open (a ``MaintenanceScheduled`` that came late, ``MaintenanceStarted``,
  ``Preempted``) -> :meth:`HostDrains.lose`: too late to plan; the members on the host are handled as lost
  now (``ctx.regroup``: a failure, counted), and the log and the recovery's cause say the notice was late.
- ``MaintenanceCompleted`` (or cancelled) -> :meth:`HostDrains.readmit`: ``ctx.readmit(instance)``; the group
  grows back once a worker is ready (a replacement, on that host or any other, grows it back sooner). With no
  ``Completed`` (a metadata server's notice, whose worker left with its host), the host is readmitted when
  its announced window has ended.
- A notice about an instance none of the workers runs on changes nothing and is counted: ``NoticeIgnored``.

As in one process, each notice is folded into its host's reconciled window
(``elastic_runtime.maintenance.reconcile``) and acted on as that window and the current time imply: a notice of
a window whose announced end has passed (a backlog found after a restart) drains nothing and counts no loss,
and a planned drain that comes due after its window ended is not carried out.

Timed work (the drain at its deadline) lives in :meth:`HostDrains.run`, a companion task of the controller: a
handler must return at once (the bus dispatches one event at a time).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio

from elastic_runtime.core.bus import EventBus
from elastic_runtime.core.errors import UnsupportedInMode
from elastic_runtime.core.events import (
    MaintenanceCompleted,
    MaintenanceScheduled,
    MaintenanceStarted,
    Notice,
    NoticeIgnored,
    Preempted,
    SaveCheckpoint,
)
from elastic_runtime.maintenance.reconcile import Verdict, Window, fold, verdict, when

if TYPE_CHECKING:
    from elastic_runtime.cluster.controller.context import ControllerContext

__all__ = ["HostDrains", "save_when_asked"]

log = logging.getLogger(__name__)


class HostDrains:
    """Plans drains of hosts before their maintenance windows, and re-admits them after.

    Args:
        clock: wall clock (epoch s), injectable for tests.
    """

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.pending: dict[str, tuple[float, str]] = {}  # instance -> (when to drain it, why)
        self.windows: dict[str, Window] = {}  # instance -> its maintenance window, as its notices so far tell it
        self._wake = anyio.Event()

    def attach(self, bus: EventBus) -> None:
        """Subscribe the handlers on the controller's bus (once, before the run starts)."""
        bus.subscribe(MaintenanceScheduled, self.plan)
        bus.subscribe(MaintenanceStarted, self.lose)
        bus.subscribe(Preempted, self.lose)
        bus.subscribe(MaintenanceCompleted, self.readmit)

    async def plan(self, event: MaintenanceScheduled, ctx: ControllerContext) -> None:
        """On MaintenanceScheduled: drain the host ``drain_lead_s`` before its window (a late notice: a loss; a
        window already over: nothing)."""
        if not await self._ours(event, ctx):
            return
        decided = self._reconcile(event, ctx)
        if decided.drain_at is None:
            self._over(event.instance, decided, ctx)
            return
        if decided.opened:
            self._lose(event, ctx)
            return
        why = f"maintenance of {event.instance} ({event.kind or 'unspecified'}) from {when(event.window_start)}"
        if ctx.config.durable_dir:
            # Before the drain is asked for: the workers hear of it (relayed) before the group re-forms.
            await ctx.publish(SaveCheckpoint(step=ctx.step, source="controller", tiers=("durable",), reason=why))
        if decided.drain_at <= self.clock():
            self.pending.pop(event.instance, None)
            ctx.drain(event.instance, why)
            return
        self.pending[event.instance] = (decided.drain_at, why)
        self._wake.set()

    async def lose(self, event: Notice, ctx: ControllerContext) -> None:
        """The host's window is open (or it is being preempted): its members are lost now, and counted. A
        ``Started`` of a window whose announced end has passed changes nothing but the readmission."""
        if not await self._ours(event, ctx):
            return
        decided = self._reconcile(event, ctx)
        if decided.drain_at is None:
            self._over(event.instance, decided, ctx)
            return
        self._lose(event, ctx)

    async def readmit(self, event: MaintenanceCompleted, ctx: ControllerContext) -> None:
        """On MaintenanceCompleted: forget a pending drain; the host's workers may be seated again."""
        self.pending.pop(event.instance, None)
        self.windows.pop(event.instance, None)  # over: nothing of it is kept
        if event.instance in ctx.cordoned:
            log.info("maintenance of %s is over: its workers may join again", event.instance)
            ctx.readmit(event.instance)
        elif not await self._ours(event, ctx):
            return

    def _reconcile(self, event: Notice, ctx: ControllerContext) -> Verdict:
        """Fold ``event`` into its host's window; what that window implies now."""
        now = self.clock()
        window = fold(self.windows.get(event.instance), event, now)
        self.windows[event.instance] = window
        self._wake.set()
        return verdict(window, now, ctx.config.drain_lead_s)

    def _lose(self, event: Notice, ctx: ControllerContext) -> None:
        self.pending.pop(event.instance, None)
        on_host = {w for w, where in ctx.instances.items() if where == event.instance}
        members = on_host & set(ctx.members)
        what = type(event).__name__
        why = f"{what} for {event.instance}: the notice came too late for a planned drain (its window is open)"
        if members:
            log.warning("%s; workers %s handled as lost", why, sorted(members))
            ctx.regroup(members, reason=why)
        ctx.drain(event.instance, why)  # no worker of it is seated until its maintenance is over

    def _over(self, instance: str, decided: Verdict, ctx: ControllerContext) -> None:
        """The host's window is over: nothing pending, and its workers may be seated again."""
        self.pending.pop(instance, None)
        self.windows.pop(instance, None)
        if instance in ctx.cordoned:
            log.info("maintenance of %s is over (%s): its workers may join again", instance, decided.reason)
            ctx.readmit(instance)
        else:
            log.info("maintenance of %s: %s", instance, decided.reason)

    async def _ours(self, event: Notice, ctx: ControllerContext) -> bool:
        """Whether a worker of the run runs on the notice's instance; if not, the notice is counted as ignored."""
        if event.instance in ctx.instances.values() or event.instance in ctx.cordoned:
            return True
        log.info("%s for %s: no worker of this run runs there; ignored", type(event).__name__, event.instance)
        await ctx.publish(
            NoticeIgnored(
                step=ctx.step,
                source="controller",
                instance=event.instance,
                message_id=event.message_id,
                reason=f"{type(event).__name__}: no worker of this run runs on {event.instance}",
            )
        )
        return False

    async def run(self, ctx: ControllerContext) -> None:
        """Drain each pending host when its time comes, and readmit one whose window has ended (a companion task
        of the controller)."""
        while True:
            self._wake = anyio.Event()
            lead = ctx.config.drain_lead_s
            for instance, (deadline, why) in list(self.pending.items()):
                if deadline <= self.clock():
                    del self.pending[instance]
                    window = self.windows.get(instance)
                    if window is not None and verdict(window, self.clock(), lead).drain_at is None:
                        continue  # its window ended before the drain came due: readmitted below
                    ctx.drain(instance, why)
            ends: list[float] = []
            for instance, window in list(self.windows.items()):
                decided = verdict(window, self.clock(), lead)
                if decided.drain_at is None:
                    self._over(instance, decided, ctx)
                elif decided.ends_at is not None:
                    ends.append(decided.ends_at)
            times = [d for d, _ in self.pending.values()] + ends
            wait = min(times, default=math.inf) - self.clock()
            with anyio.move_on_after(max(wait, 0)):
                await self._wake.wait()


async def save_when_asked(event: SaveCheckpoint, ctx: Any) -> None:
    """In every worker of a group (``ElasticRuntime`` subscribes it under ``launch``): the controller's
    ``SaveCheckpoint`` (a host is about to be drained) becomes a durable checkpoint of the step the group's
    handlers run at. Without a durable tier there is nothing to write."""
    try:
        await ctx.request_checkpoint(event.tiers, reason=event.reason)
    except UnsupportedInMode as exc:
        log.info("checkpoint asked for (%s) not written: %s", event.reason, exc)
