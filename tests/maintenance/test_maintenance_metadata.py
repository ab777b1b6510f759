"""The metadata watcher against a local HTTP server that behaves like the GCE metadata server."""

from __future__ import annotations

import time
from collections.abc import Iterator

import anyio
import pytest
from metadata_server import NO_NOTIFICATIONS, FakeMetadataServer

from elastic_runtime.core.bus import EventBus
from elastic_runtime.core.events import (
    Event,
    MaintenanceCompleted,
    MaintenanceScheduled,
    MaintenanceStarted,
    MalformedNotice,
    Notice,
    Preempted,
)
from elastic_runtime.maintenance import BusContext, MetadataWatcher, NoticeIntake
from elastic_runtime.maintenance.metadata import NoticeTracker


@pytest.fixture
def metadata_server() -> Iterator[FakeMetadataServer]:
    with FakeMetadataServer() as server:
        yield server


@pytest.mark.anyio
async def test_watcher_reports_transitions(metadata_server: FakeMetadataServer) -> None:
    bus = EventBus()
    events: list[Event] = []

    async def record(event: Event, _: object) -> None:
        events.append(event)

    bus.subscribe(Notice, record)
    bus.subscribe(MalformedNotice, record)
    watcher = MetadataWatcher(metadata_server.host, NoticeIntake(("not-this-vm",)), poll_timeout_s=2, retry_max_s=0.2)

    async def wait_count(n: int) -> None:
        with anyio.fail_after(15):
            while len(events) < n:
                await anyio.sleep(0.02)

    now = time.time()
    server = metadata_server
    async with anyio.create_task_group() as tg:
        tg.start_soon(bus.run)
        tg.start_soon(watcher.run, BusContext(bus))
        await anyio.sleep(0.5)
        assert events == []  # NONE, FALSE and "no notifications" announce nothing

        window = (
            b'{"can_reschedule": "true", "maintenance_status": "PENDING", "type": "SCHEDULED", '
            b'"window_start_time": "2030-01-01T10:00:00Z", "window_end_time": "2030-01-01T11:00:00Z", '
            b'"latest_window_start_time": "2030-01-01T10:00:00Z"}'
        )
        server.set("instance/upcoming-maintenance", window)
        await wait_count(1)
        server.set("instance/maintenance-event", b"TERMINATE_ON_HOST_MAINTENANCE")
        await wait_count(2)
        # During maintenance the server answers 503 for a while: that is no news.
        server.unavailable["instance/maintenance-event"] = 3
        await anyio.sleep(0.3)
        server.set("instance/maintenance-event", b"NONE")
        await wait_count(3)
        server.set(
            "instance/upcoming-maintenance",
            b'{"canReschedule": false, "maintenanceStatus": "ONGOING", "type": "SCHEDULED",'
            b' "windowStartTime": "2030-01-01T10:00:00Z", "windowEndTime": "2030-01-01T11:00:00Z"}',
        )
        await wait_count(4)
        server.set("instance/upcoming-maintenance", NO_NOTIFICATIONS, status=503)
        await wait_count(5)
        server.set("instance/upcoming-maintenance", b"{not json")
        await wait_count(6)
        server.set("instance/preempted", b"TRUE")
        await wait_count(7)
        await anyio.sleep(0.3)
        tg.cancel_scope.cancel()
    await bus.close()

    assert [type(e) for e in events] == [
        MaintenanceScheduled,
        MaintenanceStarted,
        MaintenanceCompleted,
        MaintenanceStarted,
        MaintenanceCompleted,
        MalformedNotice,
        Preempted,
    ]
    notices = [e for e in events if isinstance(e, Notice)]
    # The metadata server speaks of this VM only: its notices count whatever the configured instances.
    assert {e.instance for e in notices} == {"meta-vm"}
    scheduled = events[0]
    assert isinstance(scheduled, MaintenanceScheduled)
    assert scheduled.window_start == 1893492000.0
    assert scheduled.window_end == 1893495600.0
    assert scheduled.can_reschedule is True
    assert [e.kind for e in notices[1:3]] == ["TERMINATE_ON_HOST_MAINTENANCE", "TERMINATE_ON_HOST_MAINTENANCE"]
    malformed = events[5]
    assert isinstance(malformed, MalformedNotice) and "upcoming-maintenance" in malformed.reason
    # Long polls, not a busy loop: every request after the first of a key waits on its last ETag.
    waits = [q for key, q in server.requests if key == "instance/preempted"]
    assert waits[0].get("wait_for_change") is None
    assert all(q["wait_for_change"] == "true" and q["last_etag"] for q in waits[1:])
    assert len(server.requests) < 80, f"{len(server.requests)} requests in a few seconds: polling too hard"
    assert time.time() - now < 15


@pytest.mark.anyio
async def test_watcher_outlives_an_unreachable_server() -> None:
    """Nothing listens on the port at first: the watcher backs off, then finds the server once it is up."""
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        await anyio.sleep(0.01)

    with FakeMetadataServer() as server:
        host = server.host
    watcher = MetadataWatcher(host, poll_timeout_s=1, retry_max_s=5, sleep=sleep)
    bus = EventBus()
    async with anyio.create_task_group() as tg:
        tg.start_soon(bus.run)
        tg.start_soon(watcher.run, BusContext(bus))
        with anyio.fail_after(10):
            while len(slept) < 6:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    await bus.close()
    # Exponential backoff, capped (the jitter adds at most 0.1 s).
    assert slept[1] > slept[0]
    assert max(slept) <= 5.1


def test_tracker_reads_both_spellings_and_old_values() -> None:
    tracker = NoticeTracker("vm")
    assert tracker.update("instance/maintenance-event", 200, b"NONE") == []
    started = tracker.update("instance/maintenance-event", 200, b"SHUTDOWN_ON_HOST_MAINTENANCE", "e1")
    assert [(type(p.event), p.event.kind) for p in started] == [(MaintenanceStarted, "SHUTDOWN_ON_HOST_MAINTENANCE")]
    assert tracker.update("instance/maintenance-event", 503, b"") == []
    completed = tracker.update("instance/maintenance-event", 200, b"NONE", "e2")
    assert [type(p.event) for p in completed] == [MaintenanceCompleted]
    snake = b'{"window_start_time": "2030-01-01T10:00:00Z", "can_reschedule": "true"}'
    camel = b'{"windowStartTime": "2030-01-01T10:00:00Z", "canReschedule": true}'
    (a,) = tracker.update("instance/upcoming-maintenance", 200, snake, "u1")
    assert isinstance(a.event, MaintenanceScheduled) and a.event.can_reschedule
    assert tracker.update("instance/upcoming-maintenance", 200, camel, "u2") == []  # the same window
    assert tracker.update("instance/upcoming-maintenance", 200, b"{}", "u3")[0].event.kind == "SCHEDULED"
