"""Bus semantics: order, priorities, base-type delivery, failing and hanging handlers, draining shutdown."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from elastic_runtime.core.bus import EventBus
from elastic_runtime.core.errors import BusClosed
from elastic_runtime.core.eventlog import EventLog, read_events
from elastic_runtime.core.events import DeviceLost, Event, Failure, HandlerFailed, SliceLost, StepCompleted

pytestmark = pytest.mark.anyio


def step_event(n: int) -> StepCompleted:
    return StepCompleted(step=n, duration_s=0.0, mesh_shape={"data": 1}, data_position=n)


async def run_bus(bus: EventBus, publish: Any) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(bus.run)
        await publish()
        await bus.close()


async def test_events_are_dispatched_in_publish_order() -> None:
    bus = EventBus()
    seen: list[int | None] = []

    async def record(event: StepCompleted, ctx: Any) -> None:
        seen.append(event.step)

    bus.subscribe(StepCompleted, record)

    async def publish() -> None:
        for n in range(100):
            await bus.publish(step_event(n))

    await run_bus(bus, publish)
    assert seen == list(range(100))


async def test_priorities_run_highest_first_and_ties_in_subscription_order() -> None:
    bus = EventBus()
    calls: list[str] = []

    def handler(name: str) -> Any:
        async def handle(event: Event, ctx: Any) -> None:
            calls.append(name)

        return handle

    bus.subscribe(StepCompleted, handler("low"), priority=-5)
    bus.subscribe(StepCompleted, handler("first-default"))
    bus.subscribe(StepCompleted, handler("high"), priority=10)
    bus.subscribe(StepCompleted, handler("second-default"))

    async def publish() -> None:
        await bus.publish(step_event(1))

    await run_bus(bus, publish)
    assert calls == ["high", "first-default", "second-default", "low"]


async def test_a_handler_for_a_base_type_sees_subclasses_only() -> None:
    bus = EventBus()
    failures: list[str] = []
    device_losses: list[str] = []

    async def on_failure(event: Failure, ctx: Any) -> None:
        failures.append(type(event).__name__)

    async def on_device_lost(event: DeviceLost, ctx: Any) -> None:
        device_losses.append(type(event).__name__)

    bus.subscribe(Failure, on_failure)
    bus.subscribe(DeviceLost, on_device_lost)

    async def publish() -> None:
        await bus.publish(step_event(1))
        await bus.publish(DeviceLost(devices=(1,)))
        await bus.publish(SliceLost(devices=(2, 3), slices=(1,), slice_size=2))

    await run_bus(bus, publish)
    assert failures == ["DeviceLost", "SliceLost"]
    assert device_losses == ["DeviceLost", "SliceLost"]


async def test_a_raising_handler_becomes_handler_failed_and_the_bus_goes_on() -> None:
    bus = EventBus()
    later: list[int | None] = []
    failed: list[HandlerFailed] = []

    async def broken(event: StepCompleted, ctx: Any) -> None:
        if event.step == 1:
            raise ValueError("bad value 42")

    async def after(event: StepCompleted, ctx: Any) -> None:
        later.append(event.step)

    async def on_failed(event: HandlerFailed, ctx: Any) -> None:
        failed.append(event)

    bus.subscribe(StepCompleted, broken, priority=1)
    bus.subscribe(StepCompleted, after)
    bus.subscribe(HandlerFailed, on_failed)

    async def publish() -> None:
        for n in (1, 2):
            await bus.publish(step_event(n))

    await run_bus(bus, publish)
    assert later == [1, 2]  # the next handler and the next event were still delivered
    assert len(failed) == 1
    assert failed[0].error_type == "ValueError" and failed[0].message == "bad value 42"
    assert failed[0].event_type == "StepCompleted" and failed[0].step == 1 and not failed[0].timed_out
    assert "broken" in failed[0].handler


async def test_a_hanging_handler_is_cut_off_by_its_timeout() -> None:
    bus = EventBus(handler_timeout=0.2)
    failed: list[HandlerFailed] = []
    delivered: list[int | None] = []

    async def hangs(event: StepCompleted, ctx: Any) -> None:
        await anyio.sleep(3600)

    async def on_failed(event: HandlerFailed, ctx: Any) -> None:
        failed.append(event)

    async def record(event: StepCompleted, ctx: Any) -> None:
        delivered.append(event.step)

    bus.subscribe(StepCompleted, hangs)
    bus.subscribe(StepCompleted, record)
    bus.subscribe(HandlerFailed, on_failed)

    async def publish() -> None:
        await bus.publish(step_event(7))

    with anyio.fail_after(5):
        await run_bus(bus, publish)
    assert delivered == [7]
    assert len(failed) == 1 and failed[0].timed_out and failed[0].error_type == "TimeoutError"


async def test_close_drains_every_pending_event(tmp_path: Any) -> None:
    log = EventLog(tmp_path / "events.jsonl")
    bus = EventBus(log=log)
    handled: list[int | None] = []

    async def slow(event: StepCompleted, ctx: Any) -> None:
        await anyio.sleep(0.001)
        handled.append(event.step)

    bus.subscribe(StepCompleted, slow)
    for n in range(200):  # queued before the dispatcher even starts
        bus.publish_nowait(step_event(n))
    async with anyio.create_task_group() as tg:
        tg.start_soon(bus.run)
        await bus.close()
    log.close()
    assert handled == list(range(200))
    assert [e.step for e in read_events(tmp_path / "events.jsonl")] == list(range(200))
    with pytest.raises(BusClosed):
        await bus.publish(step_event(999))


async def test_a_full_queue_makes_publish_wait_and_loses_nothing() -> None:
    bus = EventBus(max_pending=4)
    handled: list[int | None] = []

    async def record(event: StepCompleted, ctx: Any) -> None:
        handled.append(event.step)

    bus.subscribe(StepCompleted, record)
    for n in range(4):
        bus.publish_nowait(step_event(n))
    with pytest.raises(anyio.WouldBlock):
        bus.publish_nowait(step_event(4))

    async def publish() -> None:
        for n in range(4, 50):
            await bus.publish(step_event(n))  # waits for the dispatcher to make room

    await run_bus(bus, publish)
    assert handled == list(range(50))


async def test_a_failing_handler_failed_handler_does_not_loop() -> None:
    bus = EventBus()
    calls = 0

    async def broken(event: Event, ctx: Any) -> None:
        nonlocal calls
        calls += 1
        raise RuntimeError("always")

    bus.subscribe(Event, broken)

    async def publish() -> None:
        await bus.publish(step_event(1))

    with anyio.fail_after(5):
        await run_bus(bus, publish)
    assert calls == 2  # once for the step, once for its HandlerFailed, and no more


async def test_handlers_receive_the_bus_context() -> None:
    marker = object()
    bus = EventBus(marker)
    got: list[object] = []

    @bus.on(StepCompleted)
    async def record(event: StepCompleted, ctx: Any) -> None:
        got.append(ctx)

    async def publish() -> None:
        await bus.publish(step_event(1))

    await run_bus(bus, publish)
    assert got == [marker]
