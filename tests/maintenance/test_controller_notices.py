"""The controller's notice source on the real Pub/Sub emulator, without workers: malformed notices, another
project's instance and a host no worker runs on change nothing, and each is counted as an event."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from notices import upcoming
from pubsub_support import Topic

from elastic_runtime.cluster.config import LaunchConfig, LaunchError
from elastic_runtime.cluster.controller.messages import take_notice
from elastic_runtime.cluster.protocol import Hello, Noticed
from elastic_runtime.core.eventlog import encode_event
from elastic_runtime.core.events import Event, MaintenanceScheduled, MalformedNotice, NoticeIgnored
from elastic_runtime.defaults import default_controller

pytestmark = pytest.mark.timeout(120)


def test_malformed_foreign_and_unknown_host_notices_change_nothing_and_are_counted(
    tmp_path: Path, topic: Topic
) -> None:
    config = LaunchConfig(
        command=[], nprocs=2, secret="s" * 64, run_dir=str(tmp_path), maintenance_subscription=topic.subscription
    )
    controller = default_controller(config)
    seen: list[Event] = []
    ended: list[str] = []

    async def record(event: Event, ctx: Any) -> None:
        seen.append(event)

    controller.bus.subscribe(MalformedNotice, record)
    controller.bus.subscribe(NoticeIgnored, record)
    topic.publish(b"{not json")
    foreign = upcoming(name="host2", start=2e9, end=2e9 + 60).replace(b"elastic-test", b"someone-else")
    topic.publish(foreign)
    topic.publish(upcoming(name="nowhere", start=2e9, end=2e9 + 60))

    async def main() -> None:
        async with anyio.create_task_group() as tg:

            async def run() -> None:
                try:
                    await controller.run_async()
                except* LaunchError as group:  # ended by the test, below
                    ended.extend(str(e) for e in group.exceptions)

            tg.start_soon(run)
            with anyio.fail_after(90):
                while len(seen) < 3:
                    await anyio.sleep(0.05)
            controller.end(LaunchError("test over"))

    anyio.run(main)
    assert ended == ["test over"]
    assert sorted(type(e).__name__ for e in seen) == ["MalformedNotice", "NoticeIgnored", "NoticeIgnored"]
    reasons = sorted(e.reason for e in seen if isinstance(e, NoticeIgnored))
    assert "of project someone-else, not elastic-test" in reasons[0]
    assert "no worker of this run runs on nowhere" in reasons[1]
    assert controller.supervisor.cordoned == set() and controller.recovery.failures == 0


def test_a_worker_forwards_notices_about_its_own_host_only(tmp_path: Path) -> None:
    controller = default_controller(LaunchConfig(command=[], nprocs=2, secret="s" * 64, run_dir=str(tmp_path)))
    proc = controller.pool.admit(0)
    proc.hello = Hello(worker=0, pid=1, target_steps=10, instance="host2")
    seen: list[Event] = []

    async def record(event: Event, ctx: Any) -> None:
        seen.append(event)

    controller.bus.subscribe(MaintenanceScheduled, record)
    controller.bus.subscribe(NoticeIgnored, record)

    def noticed(instance: str) -> Noticed:
        event = MaintenanceScheduled(source="metadata", instance=instance, window_start=2e9, window_end=2e9 + 60)
        return Noticed(worker=0, event=msgspec.Raw(encode_event(event)))

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(controller.bus.run)
            await take_notice(controller, proc, noticed("host2"))
            await take_notice(controller, proc, noticed("host3"))  # another host's: not this worker's to say
            await controller.bus.close()

    try:
        anyio.run(main)
    finally:  # a controller that never ran: what run_async would close
        controller.inputs_in.close()
        controller.inputs.close()
        controller.event_log.close()
    assert [(type(e).__name__, e.source) for e in seen] == [
        ("MaintenanceScheduled", "metadata@worker-0"),
        ("NoticeIgnored", "worker-0"),
    ]
    assert "about 'host3' from worker 0, which runs on 'host2'" in seen[1].reason  # type: ignore[attr-defined]
