"""A backlog of notices queued on the subscription before the run starts (a restart within the subscription's
retention), on the real emulator and a real run: the run ends in the state the newest notice implies, not in the
one a replay in arrival order would leave."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import notices
import pytest
from pubsub_support import Topic

from elastic_runtime import (
    ElasticRuntime,
    Event,
    MaintenanceCompleted,
    MeshChanged,
    MeshPolicy,
    Notice,
    RunFinished,
    RuntimeConfig,
    read_events,
)
from elastic_runtime.core.events import NoticeSourceReady
from elastic_runtime.testing.demo_model import demo_job

pytestmark = pytest.mark.anyio

ALL = tuple(range(8))
DRAINED = (6, 7)  # the devices "worker-1" hosts


async def test_a_scheduled_started_completed_backlog_ends_on_the_full_mesh(topic: Topic, tmp_path: Path) -> None:
    now = time.time()
    start, end = now + 30, now + 600  # the window opens 30 s from now: inside the drain lead, a drain at once

    def notice(issued: float, **status: str) -> bytes:
        return notices.upcoming(name="worker-1", instance_id="101", start=start, end=end, issued=issued, **status)

    topic.publish(notice(now))
    topic.publish(notice(now + 1, status="ONGOING"))
    topic.publish(notice(now + 2, status_message="Maintenance window has completed"))
    config = RuntimeConfig(
        run_dir=str(tmp_path),
        maintenance_subscription=topic.subscription,
        instance_devices={"worker-0": (0, 1, 2, 3, 4, 5), "worker-1": DRAINED},
        scale_up_poll_s=0.2,
        precompile=False,
        disk_every=10_000,
        checkpoint_on_finish=False,
        progress=False,
    )
    policy = MeshPolicy({"data": 4, "model": 2}, global_batch=24, slice_size=2)
    rt = ElasticRuntime(demo_job(global_batch=24, features=16, hidden=64), config=config, mesh_policy=policy)
    assert rt.maintenance.listener is not None
    received: list[str] = []
    rt.maintenance.listener.on_message = lambda message_id, published, at: received.append(message_id)

    @rt.on(Notice, priority=1000, timeout=None)
    async def together(event: Event, ctx: object) -> None:
        """The backlog arrives as one: the first notice is handled once all three are in (each is queued on the
        bus as it is received), so every handler's Drain is dispatched after the three notices."""
        with anyio.fail_after(60):  # a guard against a hang, not a measurement
            while len(received) < 3:
                await anyio.sleep(0.01)

    completed = anyio.Event()

    @rt.on(MaintenanceCompleted)
    async def note(event: Event, ctx: object) -> None:
        completed.set()

    async def pace(step: int) -> None:
        if step < 5:
            return
        if step == 5:
            # The newest notice is never dropped as stale, so once it is in, the older two were handled before
            # it. Then the bus carries out what they led to.
            with anyio.fail_after(60):
                await completed.wait()
            await rt.bus.join()
        # A drain carried out on the way is undone by a scale-up once nothing is cordoned: leave it the time.
        if not rt.health.cordoned and set(rt.context.mesh_devices) != set(ALL):
            await anyio.sleep(0.05)

    rt.at_step_boundary(pace)
    await rt.run_async(600)

    events = read_events(tmp_path / "events.jsonl")
    meshes = [e for e in events if isinstance(e, MeshChanged)]
    final = meshes[-1].devices if meshes else ALL
    assert set(final) == set(ALL), f"the run ended on devices {final}, not the full mesh: {meshes}"
    assert rt.maintenance.scheduler is not None and not rt.maintenance.scheduler.drained
    assert not rt.health.cordoned, "the maintenance is over: nothing stays cordoned"
    assert not meshes, "the newest notice says the maintenance is over: nothing to drain on the way either"
    [finished] = [e for e in events if isinstance(e, RunFinished)]
    assert finished.ok and finished.step == 600
    # The log says the run had a working notice source.
    [ready] = [e for e in events if isinstance(e, NoticeSourceReady)]
    assert ready.source == "pubsub" and ready.address == topic.subscription
