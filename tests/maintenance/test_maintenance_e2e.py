"""End to end: a maintenance notice published on Pub/Sub during a training run.

The notice leads to a durable (disk) checkpoint and a drain of the instance's devices before the window
opens, then to their re-admission after the maintenance completed; all of it read back from the event log.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import notices
import pytest
from metadata_server import FakeMetadataServer
from pubsub_support import Topic

from elastic_runtime import (
    CheckpointCommitted,
    Drain,
    ElasticRuntime,
    Event,
    MaintenanceCompleted,
    MaintenanceScheduled,
    MaintenanceStarted,
    MeshChanged,
    MeshPolicy,
    Preempted,
    RunFinished,
    RuntimeConfig,
    SaveCheckpoint,
    read_events,
)
from elastic_runtime.testing.demo_model import demo_job

pytestmark = pytest.mark.anyio

DRAINED = (6, 7)  # the devices "worker-1" hosts


def runtime_for(topic: Topic, tmp_path: Path, **overrides: Any) -> ElasticRuntime:
    values: dict[str, Any] = {
        "run_dir": str(tmp_path),
        "maintenance_subscription": topic.subscription,
        "instance_devices": {"worker-0": (0, 1, 2, 3, 4, 5), "worker-1": DRAINED},
        "drain_lead_s": 1.5,
        "scale_up_poll_s": 0.2,
        "precompile": False,
        # Only the notice's explicit request may commit to disk while the test watches.
        "disk_every": 10_000,
        "checkpoint_on_finish": False,
    }
    config = RuntimeConfig(**(values | overrides))
    policy = MeshPolicy({"data": 4, "model": 2}, global_batch=24, slice_size=2)
    return ElasticRuntime(demo_job(global_batch=24, features=16, hidden=64), config=config, mesh_policy=policy)


def first(events: list[Event], cls: type[Any], /, **match: Any) -> Any:
    for event in events:
        if isinstance(event, cls) and all(getattr(event, k) == v for k, v in match.items()):
            return event
    raise AssertionError(f"no {cls.__name__} with {match} in the event log")


async def run_with(rt: ElasticRuntime, steps: int, scenario: Any) -> None:
    """Run ``steps`` steps, paced, while ``scenario`` runs; the last step waits for the scenario to end."""
    finished = anyio.Event()

    async def pace(step: int) -> None:
        await anyio.sleep(0.01)
        if step == steps:
            with anyio.fail_after(60):
                await finished.wait()

    rt.at_step_boundary(pace)

    async def drive() -> None:
        try:
            await scenario()
        finally:
            finished.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(drive)
        await rt.run_async(steps)


async def test_scheduled_maintenance_checkpoints_and_drains_before_the_window(topic: Topic, tmp_path: Path) -> None:
    rt = runtime_for(topic, tmp_path)
    seen: list[Event] = []

    @rt.on(Event, priority=-1)
    async def record(event: Event, ctx: object) -> None:
        seen.append(event)

    async def until(predicate: Any, timeout: float = 30) -> None:
        with anyio.fail_after(timeout):
            while not any(predicate(e) for e in seen):
                await anyio.sleep(0.02)

    window: dict[str, float] = {}

    async def scenario() -> None:
        await until(lambda e: type(e).__name__ == "StepCompleted" and e.step >= 3)
        now = time.time()
        window["start"] = now + 5.0  # room for a loaded machine: delivery, checkpoint and drain must fit
        data = notices.upcoming(name="worker-1", instance_id="101", start=window["start"], end=now + 600, issued=now)
        await anyio.to_thread.run_sync(topic.publish, data)
        # Someone else's maintenance is none of ours.
        other = notices.upcoming(name="worker-9", instance_id="109", start=now + 1, end=now + 600, issued=now)
        await anyio.to_thread.run_sync(topic.publish, other)
        await until(lambda e: isinstance(e, MeshChanged) and e.reason.startswith("drain worker-1"))
        done = notices.upcoming(
            name="worker-1",
            instance_id="101",
            start=window["start"],
            end=now + 600,
            issued=now + 1,
            status_message="Maintenance window has completed",
        )
        await anyio.to_thread.run_sync(topic.publish, done)
        await until(lambda e: isinstance(e, MeshChanged) and set(DRAINED) <= set(e.devices))

    await run_with(rt, 400, scenario)

    events = read_events(tmp_path / "events.jsonl")
    notice = first(events, MaintenanceScheduled)
    assert notice.instance == "worker-1"
    assert notice.window_start == pytest.approx(window["start"], abs=1e-3)
    assert not [e for e in events if isinstance(e, MaintenanceScheduled) and e.instance != "worker-1"]

    save = first(events, SaveCheckpoint)
    assert "worker-1" in save.reason and save.wall_time >= notice.wall_time
    committed = first(events, CheckpointCommitted, tier="disk")
    assert committed.wall_time > save.wall_time
    assert committed.wall_time < notice.window_start, "the durable checkpoint must be there before the window"
    assert committed.step is not None and committed.step >= (save.step or 0)
    assert (tmp_path / "checkpoints").is_dir()

    drain = first(events, Drain, instance="worker-1")
    assert drain.deadline == pytest.approx(notice.window_start - 1.5)
    moved = first(events, MeshChanged)  # the first mesh change of the run
    assert moved.reason.startswith("drain worker-1")
    assert not set(DRAINED) & set(moved.devices)
    assert not moved.needs_restore, "a drain moves live state: nothing is lost, nothing restored"
    assert drain.deadline - 0.5 <= moved.wall_time < notice.window_start

    completed = first(events, MaintenanceCompleted, instance="worker-1")
    back = [e for e in events if isinstance(e, MeshChanged) and e.wall_time > completed.wall_time]
    assert back and set(back[0].devices) == set(range(8))
    finished = first(events, RunFinished)
    assert finished.ok and finished.step == 400


async def test_preemption_asks_for_an_emergency_checkpoint_at_once(topic: Topic, tmp_path: Path) -> None:
    rt = runtime_for(topic, tmp_path, scale_up_poll_s=None)
    seen: list[Event] = []

    @rt.on(Event, priority=-1)
    async def record(event: Event, ctx: object) -> None:
        seen.append(event)

    async def scenario() -> None:
        with anyio.fail_after(30):
            while not any(type(e).__name__ == "StepCompleted" for e in seen):
                await anyio.sleep(0.02)
            await anyio.to_thread.run_sync(topic.publish, notices.log_entry("preempted", name="worker-1"))
            while not any(isinstance(e, CheckpointCommitted) for e in seen):
                await anyio.sleep(0.02)

    await run_with(rt, 200, scenario)
    events = read_events(tmp_path / "events.jsonl")
    preempted = first(events, Preempted, instance="worker-1")
    save = first(events, SaveCheckpoint)
    assert "preempted" in save.reason
    committed = first(events, CheckpointCommitted, tier="disk")
    # Compute Engine gives a preempted VM 30 s; here the save must be done well within that.
    assert committed.wall_time - preempted.wall_time < 30
    moved = first(events, MeshChanged)
    assert moved.reason.startswith("drain worker-1") and not set(DRAINED) & set(moved.devices)


async def test_metadata_server_warning_drains_this_vm_at_once(tmp_path: Path) -> None:
    """``metadata_host`` alone turns the watcher on; its 60-second warning drains the VM's devices now."""
    with FakeMetadataServer() as server:
        config = RuntimeConfig(
            run_dir=str(tmp_path),
            metadata_host=server.host,
            instance_devices={"meta-vm": DRAINED},
            scale_up_poll_s=0.2,
            precompile=False,
            disk_every=10_000,
            checkpoint_on_finish=False,
        )
        policy = MeshPolicy({"data": 4, "model": 2}, global_batch=24, slice_size=2)
        rt = ElasticRuntime(demo_job(global_batch=24, features=16, hidden=64), config=config, mesh_policy=policy)
        seen: list[Event] = []

        @rt.on(Event, priority=-1)
        async def record(event: Event, ctx: object) -> None:
            seen.append(event)

        async def until(predicate: Any) -> None:
            with anyio.fail_after(30):
                while not any(predicate(e) for e in seen):
                    await anyio.sleep(0.02)

        async def scenario() -> None:
            await until(lambda e: type(e).__name__ == "StepCompleted")
            server.set("instance/maintenance-event", b"MIGRATE_ON_HOST_MAINTENANCE")
            await until(lambda e: isinstance(e, MeshChanged))
            server.set("instance/maintenance-event", b"NONE")
            await until(lambda e: isinstance(e, MeshChanged) and set(DRAINED) <= set(e.devices))

        await run_with(rt, 100, scenario)

    events = read_events(tmp_path / "events.jsonl")
    started = first(events, MaintenanceStarted, instance="meta-vm", kind="MIGRATE_ON_HOST_MAINTENANCE")
    assert first(events, SaveCheckpoint).wall_time >= started.wall_time
    drained = first(events, MeshChanged)
    assert drained.reason.startswith("drain meta-vm") and not set(DRAINED) & set(drained.devices)
    assert first(events, CheckpointCommitted, tier="disk").wall_time > started.wall_time
    completed = first(events, MaintenanceCompleted, instance="meta-vm")
    assert [e for e in events if isinstance(e, MeshChanged) and e.wall_time > completed.wall_time]
