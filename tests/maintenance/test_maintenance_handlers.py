"""The drain scheduler's timing rules, with a recording stand-in for the runtime context and a fake clock.

The real chain (real runtime, real emulator, real re-mesh) is in test_maintenance_e2e.py; these cover the
cases a run rarely meets: a window moved before its drain, a maintenance completed before its drain, a drain
that leaves no mesh, an instance without devices, a backlog's drains dispatched after its completion, a window
already over.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from elastic_runtime.core.config import RuntimeConfig
from elastic_runtime.core.errors import MeshUnavailable
from elastic_runtime.core.events import (
    Drain,
    MaintenanceCompleted,
    MaintenanceScheduled,
    MaintenanceStarted,
    Preempted,
)
from elastic_runtime.handlers.maintenance import DrainScheduler, devices_of

pytestmark = pytest.mark.anyio


class Recorder:
    """Records what the scheduler asks of the runtime."""

    def __init__(self, *, fits: bool = True) -> None:
        self.config = RuntimeConfig(instance_devices={"w-0": (0, 1), "w-1": (2, 3), "t1v-n-ab-w-*": (4, 5)})
        self.mesh_devices: tuple[int, ...] = (0, 1, 2, 3, 4, 5)
        self.cordoned: set[int] = set()
        self.remeshed: list[str] = []
        self.fits = fits
        self.policy = self

    def cordon(self, devices: tuple[int, ...]) -> None:
        self.cordoned |= set(devices)

    def uncordon(self, devices: tuple[int, ...]) -> None:
        self.cordoned -= set(devices)

    async def healthy_devices(self) -> list[int]:
        return [d for d in self.mesh_devices if d not in self.cordoned]

    def fit(self, devices: list[int]) -> Any:
        if not self.fits:
            raise MeshUnavailable("too few devices")
        return devices

    def remesh(self, mesh: Any, reason: str = "") -> None:
        self.remeshed.append(reason)
        self.mesh_devices = tuple(mesh)


def test_devices_of_exact_and_glob() -> None:
    mapping = {"w-0": (0,), "t1v-n-ab-w-*": (4, 5)}
    assert devices_of("w-0", mapping) == (0,)
    assert devices_of("t1v-n-ab-w-3", mapping) == (4, 5)
    assert devices_of("w-9", mapping) == ()


async def test_a_moved_window_replaces_the_pending_drain() -> None:
    now = [1000.0]
    scheduler, ctx = DrainScheduler(clock=lambda: now[0]), Recorder()
    await scheduler.plan(Drain(instance="w-1", deadline=1010.0, reason="first"), ctx)
    await scheduler.plan(Drain(instance="w-1", deadline=1100.0, reason="moved"), ctx)
    async with anyio.create_task_group() as tg:
        tg.start_soon(scheduler.run, ctx)
        now[0] = 1050.0  # past the first deadline, before the moved one
        scheduler._wake.set()
        await anyio.sleep(0.05)
        assert ctx.remeshed == []
        now[0] = 1100.0
        scheduler._wake.set()
        await anyio.sleep(0.05)
        tg.cancel_scope.cancel()
    assert ctx.remeshed == ["drain w-1: moved"]
    assert ctx.cordoned == {2, 3}


async def test_completion_before_the_drain_cancels_it_and_readmits_after_it() -> None:
    now = [1000.0]
    scheduler, ctx = DrainScheduler(clock=lambda: now[0]), Recorder()
    await scheduler.plan(Drain(instance="w-0", deadline=2000.0), ctx)
    await scheduler.reconcile(MaintenanceCompleted(instance="w-0"), ctx)
    assert scheduler.pending == {} and ctx.cordoned == set()
    await scheduler.plan(Drain(instance="t1v-n-ab-w-2", deadline=None), ctx)
    assert ctx.cordoned == {4, 5} and ctx.remeshed == ["drain t1v-n-ab-w-2: "]
    await scheduler.reconcile(MaintenanceCompleted(instance="t1v-n-ab-w-2"), ctx)
    assert ctx.cordoned == set()


async def test_a_drain_that_leaves_no_mesh_keeps_the_current_one() -> None:
    scheduler, ctx = DrainScheduler(), Recorder(fits=False)
    await scheduler.plan(Drain(instance="w-0"), ctx)
    assert ctx.remeshed == [] and ctx.cordoned == set() and scheduler.drained == set()
    await scheduler.plan(Drain(instance="w-unknown"), ctx)
    assert ctx.remeshed == [] and ctx.cordoned == set()


async def test_a_backlogs_drains_dispatched_after_its_completion_are_not_carried_out() -> None:
    """Scheduled, Started and Completed queued together: their handlers' Drains come after all three."""
    now = 1000.0
    scheduler, ctx = DrainScheduler(clock=lambda: now), Recorder()
    await scheduler.reconcile(MaintenanceScheduled(instance="w-1", window_start=now + 30, window_end=now + 600), ctx)
    await scheduler.reconcile(MaintenanceStarted(instance="w-1"), ctx)
    await scheduler.reconcile(MaintenanceCompleted(instance="w-1"), ctx)
    await scheduler.plan(Drain(source="maintenance", instance="w-1", deadline=now - 30, reason="opens soon"), ctx)
    await scheduler.plan(Drain(source="maintenance", instance="w-1", deadline=now, reason="started"), ctx)
    assert ctx.remeshed == [] and ctx.cordoned == set() and scheduler.drained == set() and scheduler.pending == {}
    # A drain asked for otherwise (not by the notice handlers) is carried out as asked.
    await scheduler.plan(Drain(source="operator", instance="w-1", deadline=None, reason="by hand"), ctx)
    assert ctx.cordoned == {2, 3}


async def test_a_window_already_over_drains_nothing_and_undoes_a_drain() -> None:
    now = 1000.0
    scheduler, ctx = DrainScheduler(clock=lambda: now), Recorder()
    await scheduler.reconcile(MaintenanceStarted(instance="w-0"), ctx)
    await scheduler.plan(Drain(source="maintenance", instance="w-0", deadline=now), ctx)
    assert ctx.cordoned == {0, 1}
    # A newer notice of the same window says it ended a minute ago: the drain is undone, and none is done again.
    ended = MaintenanceScheduled(instance="w-0", window_start=now - 600, window_end=now - 60)
    await scheduler.reconcile(ended, ctx)
    assert ctx.cordoned == set() and scheduler.drained == set()
    await scheduler.plan(Drain(source="maintenance", instance="w-0", deadline=now - 660), ctx)
    assert ctx.cordoned == set() and len(ctx.remeshed) == 1


async def test_an_instance_drained_for_a_window_is_readmitted_when_the_window_ends() -> None:
    now = [1000.0]
    scheduler, ctx = DrainScheduler(clock=lambda: now[0]), Recorder()
    await scheduler.reconcile(MaintenanceScheduled(instance="w-1", window_start=1010.0, window_end=1100.0), ctx)
    await scheduler.plan(Drain(source="maintenance", instance="w-1", deadline=1000.0), ctx)
    await scheduler.reconcile(MaintenanceStarted(instance="w-1"), ctx)
    assert ctx.cordoned == {2, 3}
    async with anyio.create_task_group() as tg:
        tg.start_soon(scheduler.run, ctx)
        await anyio.sleep(0.05)
        assert ctx.cordoned == {2, 3}
        now[0] = 1100.0  # no MaintenanceCompleted came, but the announced window is over
        scheduler._wake.set()
        with anyio.fail_after(5):
            while ctx.cordoned:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert scheduler.drained == set() and scheduler.by_notice == set()


async def test_a_preemption_after_a_completed_window_still_drains() -> None:
    scheduler, ctx = DrainScheduler(clock=lambda: 1000.0), Recorder()
    await scheduler.reconcile(MaintenanceCompleted(instance="w-1"), ctx)
    await scheduler.reconcile(Preempted(instance="w-1"), ctx)
    await scheduler.plan(Drain(source="maintenance", instance="w-1", deadline=1000.0, reason="preempted"), ctx)
    assert ctx.cordoned == {2, 3} and ctx.remeshed == ["drain w-1: preempted"]
