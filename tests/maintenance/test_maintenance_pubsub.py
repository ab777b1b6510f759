"""The Pub/Sub listener against the real emulator: every format, repeats, order, strangers, garbage, outages."""

from __future__ import annotations

import datetime
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.to_thread
import notices
import pytest
from pubsub_emulator import PubSubEmulator
from pubsub_support import Topic, make_topic

from elastic_runtime.core.bus import EventBus
from elastic_runtime.core.events import (
    Event,
    HostError,
    MaintenanceCompleted,
    MaintenanceScheduled,
    MaintenanceStarted,
    MalformedNotice,
    Notice,
    Preempted,
)
from elastic_runtime.maintenance import BusContext, NoticeIntake, PubSubListener

pytestmark = pytest.mark.anyio


class Harness:
    """A bus and a listener running in the test's loop; ``events`` is what reached the handlers."""

    def __init__(self, listener: PubSubListener) -> None:
        self.listener = listener
        self.events: list[Event] = []

    async def wait_for(self, predicate: Callable[[list[Event]], bool], timeout: float = 30.0) -> None:
        with anyio.fail_after(timeout):
            while not predicate(self.events):
                await anyio.sleep(0.02)

    async def wait_count(self, n: int, timeout: float = 30.0) -> None:
        await self.wait_for(lambda events: len(events) >= n, timeout)

    async def settle(self, seconds: float = 1.0) -> None:
        """Give stray redeliveries a chance to show up."""
        await anyio.sleep(seconds)


@asynccontextmanager
async def listening(subscription: str, instances: tuple[str, ...] = (), **kwargs: Any) -> AsyncIterator[Harness]:
    bus = EventBus()
    listener = PubSubListener(subscription, NoticeIntake(instances), **kwargs)
    harness = Harness(listener)

    async def record(event: Event, _: object) -> None:
        harness.events.append(event)

    bus.subscribe(Notice, record)
    bus.subscribe(MalformedNotice, record)
    async with anyio.create_task_group() as tg:
        tg.start_soon(bus.run)
        tg.start_soon(listener.run, BusContext(bus))
        try:
            yield harness
        finally:
            tg.cancel_scope.cancel()
    await bus.close()


async def publish(topic: Topic, data: bytes, **attributes: str) -> str:
    return await anyio.to_thread.run_sync(lambda: topic.publish(data, **attributes))


async def test_cloud_logging_formats(topic: Topic) -> None:
    now = time.time()
    async with listening(topic.subscription, ("worker-0",)) as h:
        scheduled_id = await publish(topic, notices.upcoming(start=now + 3600, end=now + 7200, issued=now))
        await h.wait_count(1)
        await publish(
            topic,
            notices.upcoming(start=now + 3600, end=now + 7200, status="ONGOING", issued=now + 1),
        )
        await h.wait_count(2)
        await publish(
            topic,
            notices.upcoming(
                start=now + 3600, end=now + 7200, issued=now + 2, status_message="Maintenance window has completed"
            ),
        )
        await h.wait_count(3)
        await publish(topic, notices.log_entry("terminateOnHostMaintenance", issued=now + 3))
        await h.wait_count(4)
        await publish(
            topic, notices.log_entry("migrateOnHostMaintenance", issued=now + 4, operation={"id": "op", "last": True})
        )
        await h.wait_count(5)
        await publish(topic, notices.log_entry("preempted", issued=now + 5))
        await h.wait_count(6)
        await publish(topic, notices.log_entry("hostError", issued=now + 6))
        await h.wait_count(7)
    kinds = [type(e) for e in h.events]
    assert kinds == [
        MaintenanceScheduled,
        MaintenanceStarted,
        MaintenanceCompleted,
        MaintenanceStarted,
        MaintenanceCompleted,
        Preempted,
        HostError,
    ]
    first = h.events[0]
    assert isinstance(first, MaintenanceScheduled)
    assert first.instance == "worker-0"
    assert first.message_id == scheduled_id
    assert first.window_start == pytest.approx(now + 3600, abs=1e-3)
    assert first.window_end == pytest.approx(now + 7200, abs=1e-3)
    assert first.can_reschedule is True
    assert first.source == "cloud-logging"
    assert [getattr(e, "kind", "") for e in h.events][3:5] == [
        "TERMINATE_ON_HOST_MAINTENANCE",
        "MIGRATE_ON_HOST_MAINTENANCE",
    ]


async def test_instance_id_and_tpu_worker_globs(topic: Topic) -> None:
    now = time.time()
    # Instances are named by numeric id or by a glob over TPU VM worker names.
    async with listening(topic.subscription, ("9001", "t1v-n-1a2b3c4d-w-*")) as h:
        await publish(topic, notices.log_entry("preempted", name="anything", instance_id="9001"))
        await publish(topic, notices.log_entry("hostError", name="t1v-n-1a2b3c4d-w-3", instance_id="5"))
        await publish(topic, notices.log_entry("hostError", name="t1v-n-ffffffff-w-0", instance_id="6"))
        await publish(topic, notices.upcoming(name="other-vm", instance_id="7", start=now + 60, end=now + 120))
        await h.wait_count(2)
        await h.settle()
    # Pub/Sub does not keep the order of messages: compared as a set, with no duplicate.
    found = [(type(e), e.instance) for e in h.events if isinstance(e, Notice)]
    assert len(found) == 2 and set(found) == {(Preempted, "9001"), (HostError, "t1v-n-1a2b3c4d-w-3")}


async def test_gke_and_custom_formats(topic: Topic) -> None:
    now = time.time()
    pool = "projects/elastic-test/locations/us-central1/clusters/train/nodePools/tpu-pool"
    async with listening(topic.subscription, ("train/tpu-pool", "worker-7")) as h:
        await publish(
            topic,
            b"Node pool upgrade scheduled",
            **notices.gke(
                "UpgradeInfoEvent",
                {
                    "resourceType": "NODE_POOL",
                    "resource": pool,
                    "startTime": notices.rfc3339(now + 3600),
                    "endTime": notices.rfc3339(now + 7200),
                    "currentVersion": "1.30.1",
                    "targetVersion": "1.30.2",
                },
            ),
        )
        # Pub/Sub does not keep the order of messages, and these carry no time to order them by: each is
        # published once the one before it has been handled.
        await h.wait_count(1)
        await publish(
            topic,
            b"Node pool upgrade started",
            **notices.gke("UpgradeEvent", {"resourceType": "NODE_POOL", "resource": pool, "operation": "op-1"}),
        )
        await h.wait_count(2)
        await publish(
            topic,
            b"Upgrade done",
            **notices.gke("UpgradeInfoEvent", {"resourceType": "NODE_POOL", "resource": pool, "state": "SUCCEEDED"}),
        )
        await h.wait_count(3)
        # Informational GKE notifications touch no worker: acked, no event.
        await publish(topic, b"Security bulletin", **notices.gke("SecurityBulletinEvent", {"bulletinId": "x"}))
        await publish(
            topic, b"Control plane", **notices.gke("UpgradeEvent", {"resourceType": "MASTER", "resource": "c"})
        )
        await publish(
            topic,
            notices.custom(
                "maintenance_scheduled",
                "worker-7",
                window_start=now + 600,
                window_end=notices.rfc3339(now + 1200),
                can_reschedule=True,
            ),
        )
        await h.wait_count(4)
        await publish(topic, notices.custom("preempted", "worker-7"))
        await h.wait_count(5)
        await h.settle()
    assert [(type(e).__name__, e.instance) for e in h.events if isinstance(e, Notice)] == [
        ("MaintenanceScheduled", "train/tpu-pool"),
        ("MaintenanceStarted", "train/tpu-pool"),
        ("MaintenanceCompleted", "train/tpu-pool"),
        ("MaintenanceScheduled", "worker-7"),
        ("Preempted", "worker-7"),
    ]
    gke_window = h.events[0]
    assert isinstance(gke_window, MaintenanceScheduled)
    assert gke_window.window_start == pytest.approx(now + 3600, abs=1e-3)
    custom_window = h.events[3]
    assert isinstance(custom_window, MaintenanceScheduled)
    assert custom_window.window_start == pytest.approx(now + 600)
    assert custom_window.window_end == pytest.approx(now + 1200, abs=1e-3)
    assert custom_window.can_reschedule


async def test_duplicates_are_published_once(topic: Topic) -> None:
    now = time.time()
    window = notices.upcoming(start=now + 3600, end=now + 7200, issued=now)
    async with listening(topic.subscription, ("worker-0",)) as h:
        # The same window announced three times under three message ids: one event.
        for _ in range(3):
            await publish(topic, window)
        # A moved window (rescheduled) is news.
        await publish(topic, notices.upcoming(start=now + 9000, end=now + 9900, issued=now + 1))
        await h.wait_count(2)
        await h.settle()
    assert [type(e) for e in h.events] == [MaintenanceScheduled, MaintenanceScheduled]


class FakeMessage:
    """What the listener reads of a Pub/Sub message (for driving ``_handle`` directly)."""

    def __init__(self, data: bytes, message_id: str) -> None:
        self.data = data
        self.message_id = message_id
        self.attributes: dict[str, str] = {}
        self.publish_time = datetime.datetime.fromtimestamp(1_800_000_000, datetime.UTC)


async def test_a_redelivery_during_handling_shares_the_first_outcome() -> None:
    """Pub/Sub may deliver again while the first delivery is still in its handlers: one event, both acked."""
    seen: list[Event] = []
    release = anyio.Event()
    bus = EventBus(handler_timeout=None)

    async def slow(event: Event, _: object) -> None:
        seen.append(event)
        await release.wait()

    bus.subscribe(Notice, slow)
    listener = PubSubListener("projects/p/subscriptions/s")
    ctx = BusContext(bus)
    listener._tracker.attach(ctx)
    outcomes: list[bool] = []
    message = FakeMessage(notices.custom("host_error", "w"), "42")

    async def deliver() -> None:
        outcomes.append(await listener._handle(message, time.time(), ctx))

    async with anyio.create_task_group() as tg:
        tg.start_soon(bus.run)
        tg.start_soon(deliver)
        tg.start_soon(deliver)
        with anyio.fail_after(5):
            while not seen:
                await anyio.sleep(0.01)
        await anyio.sleep(0.1)
        release.set()
        with anyio.fail_after(5):
            while len(outcomes) < 2:
                await anyio.sleep(0.01)
        outcomes.append(await listener._handle(message, time.time(), ctx))  # a later redelivery
        await bus.close()
    assert len(seen) == 1
    assert outcomes == [True, True, True]


async def test_out_of_order_delivery_drops_stale_notices(topic: Topic) -> None:
    now = time.time()
    async with listening(topic.subscription, ("worker-0",)) as h:
        # Completed (issued last) arrives first; the older Started and Scheduled must not undo it.
        await publish(topic, notices.log_entry("terminateOnHostMaintenance", issued=now + 2, operation={"last": True}))
        await h.wait_count(1)
        await publish(topic, notices.log_entry("terminateOnHostMaintenance", issued=now + 1, operation={"first": True}))
        await publish(topic, notices.upcoming(start=now + 60, end=now + 120, issued=now))
        # Preemption is never stale.
        await publish(topic, notices.log_entry("preempted", issued=now - 100))
        await h.wait_count(2)
        await h.settle()
    assert [type(e) for e in h.events] == [MaintenanceCompleted, Preempted]


async def test_malformed_messages_become_events_and_are_acked(topic: Topic) -> None:
    bad = [
        b"not json",
        b"[1, 2]",
        b'{"protoPayload": {"methodName": 7}}',
        notices.log_entry("reboot"),
        notices.upcoming(start=0, end=0).replace(b'"windowStartTime": "', b'"windowStartTime": "x'),
        notices.custom("maintenance_scheduled", "w", window_start="tomorrow"),
    ]
    async with listening(topic.subscription) as h:
        ids = [await publish(topic, data) for data in bad]
        ids.append(await publish(topic, b"summary", **notices.gke("NoSuchEvent", {})))
        await h.wait_count(len(bad) + 1)
        # Acked: nothing comes back even after the 10 s ack deadline would have passed for a nacked one.
        await h.settle(1.5)
    assert all(isinstance(e, MalformedNotice) for e in h.events)
    assert len(h.events) == len(bad) + 1
    # Pub/Sub does not keep the order of messages without an ordering key (seen out of order on Python 3.13).
    by_id = {e.message_id: e.reason for e in h.events if isinstance(e, MalformedNotice)}
    reasons = [by_id[message_id] for message_id in ids]
    assert "at `$.protoPayload.methodName`" in reasons[2]
    assert "unknown methodName 'compute.instances.reboot'" in reasons[3]
    assert "at `$.protoPayload.metadata.windowStartTime`" in reasons[4]
    assert "at `$.window_start`" in reasons[5]
    assert "type_url" in reasons[6]


async def test_listener_waits_for_a_subscription_that_appears_later(pubsub_clients: tuple[Any, Any]) -> None:
    publisher, subscriber = pubsub_clients
    name = f"late{int(time.time() * 1000)}"
    subscription = subscriber.subscription_path("elastic-test", f"{name}-sub")
    async with listening(subscription, reconnect_max_s=0.5) as h:
        await anyio.sleep(1.0)  # the check fails with NOT_FOUND (no stream is opened), and is retried
        assert h.listener.status.ready is False and h.listener.streams_opened == 0
        late = await anyio.to_thread.run_sync(make_topic, publisher, subscriber, name)
        await h.wait_for(lambda _: h.listener.streams_opened >= 1)
        deadline = time.monotonic() + 30
        while not h.events and time.monotonic() < deadline:
            # Until the reopened stream is attached, a message could sit unseen: publish until one arrives.
            await publish(late, notices.custom("host_error", f"w-{len(h.events)}"))
            await anyio.sleep(0.5)
        assert h.events, "no notice arrived after the subscription was created"
    assert h.listener.status.ready is True


async def test_reconnects_after_emulator_restart_and_misses_nothing(pubsub_emulator: PubSubEmulator) -> None:
    """Its own emulator: the restart must not disturb the other tests' one (the fixture only checks that the
    emulator is installed)."""
    from google.cloud import pubsub_v1

    emulator = PubSubEmulator()
    emulator.start()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("PUBSUB_EMULATOR_HOST", emulator.host)
            publisher, subscriber = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
            topic = make_topic(publisher, subscriber, "restart")
            async with listening(topic.subscription, reconnect_max_s=1.0) as h:
                for i in range(3):
                    await publish(topic, notices.custom("host_error", f"before-{i}"))
                await h.wait_count(3)
                await anyio.to_thread.run_sync(emulator.restart)
                # The emulator keeps nothing across a restart: the operator would re-create the topic.
                topic = await anyio.to_thread.run_sync(make_topic, publisher, subscriber, "restart")
                after = [await publish(topic, notices.custom("host_error", f"after-{i}")) for i in range(5)]
                await h.wait_count(8, timeout=60)
                await h.settle(0.5)
            subscriber.close()
    finally:
        emulator.stop()
    # Each batch is complete; within one, Pub/Sub does not keep the order (seen out of order on Python 3.13).
    names = [e.instance for e in h.events if isinstance(e, Notice)]
    assert sorted(names[:3]) == [f"before-{i}" for i in range(3)]
    assert sorted(names[3:]) == [f"after-{i}" for i in range(5)]
    # The ids restart at 1 in a new emulator: the listener must not take them for redeliveries.
    assert sorted(e.message_id for e in h.events[3:]) == sorted(after)


async def test_a_client_that_cannot_be_created_is_retried_not_fatal(topic: Topic) -> None:
    from google.cloud import pubsub_v1

    calls = 0

    def factory() -> pubsub_v1.SubscriberClient:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("Your default credentials were not found")
        return pubsub_v1.SubscriberClient()

    async with listening(topic.subscription, client_factory=factory, reconnect_max_s=0.2) as h:
        await publish(topic, notices.custom("host_error", "w"))
        await h.wait_count(1)
    assert calls == 2


async def test_a_stream_that_breaks_after_a_healthy_life_is_reopened_at_once(
    topic: Topic, pubsub_clients: tuple[Any, Any]
) -> None:
    _, subscriber = pubsub_clients
    async with listening(topic.subscription, reconnect_max_s=0.5, healthy_stream_s=1.0) as h:
        await publish(topic, notices.custom("host_error", "first"))
        await h.wait_count(1)
        await anyio.sleep(1.0)  # the stream has now lived long enough to count as healthy
        await anyio.to_thread.run_sync(lambda: subscriber.delete_subscription(subscription=topic.subscription))
        # Reopened at once: the check before the new stream finds the subscription gone.
        await h.wait_for(lambda _: h.listener.status.ready is False, timeout=30)
        await anyio.to_thread.run_sync(
            lambda: subscriber.create_subscription(name=topic.subscription, topic=topic.topic)
        )
        deadline = time.monotonic() + 30
        while len(h.events) < 2 and time.monotonic() < deadline:
            await publish(topic, notices.custom("host_error", f"again-{len(h.events)}"))
            await anyio.sleep(0.5)
    assert len(h.events) >= 2 and h.listener.streams_opened >= 2
