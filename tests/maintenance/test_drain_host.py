"""The controller-side drain handlers (handlers/drain_host.py) with a recording ``ctx``: no processes, no clock
but the test's. Also the intake's project filter, and a worker's instance name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest
from notices import upcoming

from elastic_runtime.cluster.config import LaunchConfig
from elastic_runtime.cluster.worker.instance import instance_name
from elastic_runtime.cluster.worker.settings import WorkerSettings
from elastic_runtime.core.errors import UnsupportedInMode
from elastic_runtime.core.events import (
    Event,
    MaintenanceCompleted,
    MaintenanceScheduled,
    MaintenanceStarted,
    NoticeIgnored,
    SaveCheckpoint,
)
from elastic_runtime.handlers.drain_host import HostDrains, save_when_asked
from elastic_runtime.maintenance.formats import parse_message
from elastic_runtime.maintenance.intake import NoticeIntake

NOW = 1_000_000.0


@dataclass
class Ctx:
    """What a ``ControllerContext`` offers the handlers, recorded."""

    instances: dict[int, str]
    members: tuple[int, ...]
    config: LaunchConfig = field(default_factory=lambda: LaunchConfig(command=[], nprocs=4, drain_lead_s=5.0))
    step: int = 10
    cordoned: set[str] = field(default_factory=set)
    drains: list[str] = field(default_factory=list)
    regroups: list[tuple[set[int], str]] = field(default_factory=list)
    readmitted: list[str] = field(default_factory=list)
    published: list[Event] = field(default_factory=list)

    def drain(self, instance: str, reason: str) -> None:
        self.drains.append(instance)
        self.cordoned.add(instance)

    def readmit(self, instance: str) -> None:
        self.readmitted.append(instance)
        self.cordoned.discard(instance)

    def regroup(self, lost: set[int], reason: str) -> None:
        self.regroups.append((set(lost), reason))

    async def publish(self, event: Event) -> None:
        self.published.append(event)


def four_hosts() -> Ctx:
    return Ctx(instances={k: f"host{k}" for k in range(4)}, members=(0, 1, 2, 3))


def scheduled(instance: str, start: float) -> MaintenanceScheduled:
    return MaintenanceScheduled(instance=instance, window_start=start, window_end=start + 60)


def run(coro: Any) -> None:
    anyio.run(lambda: coro)


def test_a_notice_ahead_drains_the_host_drain_lead_s_before_its_window_and_readmits_it_after() -> None:
    now = [NOW]
    drains, ctx = HostDrains(clock=lambda: now[0]), four_hosts()
    run(drains.plan(scheduled("host2", NOW + 10), ctx))  # type: ignore[arg-type]
    assert ctx.drains == [] and drains.pending["host2"][0] == NOW + 5  # the lead: 5 s before the window

    async def until_drained() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(drains.run, ctx)
            await anyio.sleep(0)
            assert ctx.drains == []
            now[0] = NOW + 5
            drains._wake.set()
            while not ctx.drains:
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()

    anyio.run(until_drained)
    assert ctx.drains == ["host2"] and ctx.regroups == [] and ctx.published == []  # planned: nothing counted
    run(drains.readmit(MaintenanceCompleted(instance="host2"), ctx))  # type: ignore[arg-type]
    assert ctx.readmitted == ["host2"]

    soon, ctx = HostDrains(clock=lambda: NOW), four_hosts()
    run(soon.plan(scheduled("host1", NOW + 3), ctx))  # type: ignore[arg-type]
    assert ctx.drains == ["host1"] and ctx.regroups == []  # inside the lead, window not open: drained now


def test_a_notice_whose_window_is_open_is_a_loss_and_says_it_came_late() -> None:
    drains, ctx = HostDrains(clock=lambda: NOW), four_hosts()
    run(drains.plan(scheduled("host2", NOW - 1), ctx))  # type: ignore[arg-type]
    assert [lost for lost, _ in ctx.regroups] == [{2}] and "too late" in ctx.regroups[0][1]
    assert ctx.cordoned == {"host2"}  # and no worker of it joins before its maintenance is over

    started, ctx = HostDrains(clock=lambda: NOW), four_hosts()
    run(started.lose(MaintenanceStarted(instance="host3"), ctx))  # type: ignore[arg-type]
    assert [lost for lost, _ in ctx.regroups] == [{3}]


def test_a_backlog_of_a_window_that_has_ended_drains_nothing_and_counts_no_loss() -> None:
    """Found after a restart: a window that opened ten minutes ago and ended a minute ago is old news."""
    drains, ctx = HostDrains(clock=lambda: NOW), four_hosts()
    ended = MaintenanceScheduled(instance="host2", window_start=NOW - 600, window_end=NOW - 60)
    run(drains.plan(ended, ctx))  # type: ignore[arg-type]
    assert ctx.regroups == [] and ctx.drains == [] and ctx.cordoned == set() and drains.pending == {}


def test_a_scheduled_started_completed_backlog_ends_with_the_host_readmitted() -> None:
    drains, ctx = HostDrains(clock=lambda: NOW), four_hosts()
    run(drains.plan(scheduled("host2", NOW + 30), ctx))  # type: ignore[arg-type]
    run(drains.lose(MaintenanceStarted(instance="host2"), ctx))  # type: ignore[arg-type]
    run(drains.readmit(MaintenanceCompleted(instance="host2"), ctx))  # type: ignore[arg-type]
    assert ctx.cordoned == set() and ctx.readmitted == ["host2"] and drains.pending == {} and drains.windows == {}


def test_a_host_whose_window_ends_without_a_completion_is_readmitted_then() -> None:
    now = [NOW]
    drains, ctx = HostDrains(clock=lambda: now[0]), four_hosts()
    run(drains.lose(scheduled("host1", NOW - 1), ctx))  # type: ignore[arg-type]
    run(drains.lose(MaintenanceStarted(instance="host1"), ctx))  # type: ignore[arg-type]
    assert ctx.cordoned == {"host1"}

    async def until_readmitted() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(drains.run, ctx)
            await anyio.sleep(0)
            assert ctx.readmitted == []
            now[0] = NOW + 60  # the end of the window the Scheduled announced
            drains._wake.set()
            while not ctx.readmitted:
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()

    anyio.run(until_readmitted)
    assert ctx.readmitted == ["host1"] and ctx.cordoned == set() and drains.windows == {}


def test_a_notice_for_a_host_no_worker_runs_on_changes_nothing_and_is_counted() -> None:
    drains, ctx = HostDrains(clock=lambda: NOW), four_hosts()
    run(drains.plan(scheduled("elsewhere", NOW + 100), ctx))  # type: ignore[arg-type]
    run(drains.lose(MaintenanceStarted(instance="elsewhere"), ctx))  # type: ignore[arg-type]
    assert ctx.drains == [] and ctx.regroups == [] and drains.pending == {}
    assert [type(e) for e in ctx.published] == [NoticeIgnored, NoticeIgnored]
    assert all(isinstance(e, NoticeIgnored) and e.instance == "elsewhere" for e in ctx.published)


def test_the_intake_reports_another_projects_instance_as_ignored() -> None:
    intake = NoticeIntake(project="elastic-test", report_ignored=True)
    ours = parse_message(upcoming(name="host2", start=NOW + 10, end=NOW + 70), {})
    foreign = upcoming(name="host2", start=NOW + 10, end=NOW + 70).replace(b"elastic-test", b"someone-else")
    theirs = parse_message(foreign, {})
    assert [type(e) for e in intake.admit("1", ours)] == [MaintenanceScheduled]
    ignored = intake.admit("2", theirs)
    assert [type(e) for e in ignored] == [NoticeIgnored]
    assert "of project someone-else, not elastic-test" in ignored[0].reason  # type: ignore[union-attr]
    assert NoticeIntake(project="elastic-test").admit("3", theirs) == []  # single-controller default: dropped


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"ELASTIC_INSTANCE": "vm-7", "SLURMD_NODENAME": "node3"}, "vm-7"),
        ({"SLURMD_NODENAME": "node3", "NODE_NAME": "gke-node"}, "node3"),
        ({"NODE_NAME": "gke-node"}, "gke-node"),
    ],
)
def test_a_worker_names_its_instance(environ: dict[str, str], expected: str) -> None:
    base = {"ELASTIC_CONTROLLER": "127.0.0.1:1", "ELASTIC_WORKER_ID": "0"}
    settings = WorkerSettings.from_env(base | environ)
    assert instance_name(settings, environ) == expected


def test_a_worker_asks_the_metadata_server_for_its_instance_name_when_one_is_configured() -> None:
    base = {"ELASTIC_CONTROLLER": "127.0.0.1:1", "ELASTIC_WORKER_ID": "0", "ELASTIC_METADATA_HOST": "md:80"}
    settings = WorkerSettings.from_env(base)
    assert instance_name(settings, {"NODE_NAME": "n"}, ask_metadata=lambda host: f"t1v-n-abc-w-{len(host)}") == (
        "t1v-n-abc-w-5"
    )
    assert instance_name(settings, {"NODE_NAME": "n"}, ask_metadata=lambda host: "") == "n"  # not answering


def test_with_a_durable_tier_the_workers_are_asked_for_a_checkpoint_before_the_drain() -> None:
    drains, ctx = HostDrains(clock=lambda: NOW), four_hosts()
    ctx.config = LaunchConfig(command=[], nprocs=4, durable_dir="/durable")
    run(drains.plan(scheduled("host2", NOW + 10), ctx))  # type: ignore[arg-type]
    [save] = ctx.published
    assert isinstance(save, SaveCheckpoint) and save.tiers == ("durable",) and ctx.drains == ["host2"]
    without, ctx = HostDrains(clock=lambda: NOW), four_hosts()
    ctx.config = LaunchConfig(command=[], nprocs=4)  # no durable tier; the lead of 60 s is past: drained now
    run(without.plan(scheduled("host2", NOW + 10), ctx))  # type: ignore[arg-type]
    assert ctx.published == [] and ctx.drains == ["host2"]

    class WorkerCtx:
        def __init__(self, durable: bool) -> None:
            self.durable, self.asked = durable, [] if durable else None

        async def request_checkpoint(self, tiers: tuple[str, ...] = (), reason: str = "") -> None:
            if self.asked is None:
                raise UnsupportedInMode("needs a durable tier")
            self.asked.append(tiers)

    worker = WorkerCtx(durable=True)
    run(save_when_asked(save, worker))
    assert worker.asked == [("durable",)]
    run(save_when_asked(save, WorkerCtx(durable=False)))  # nothing to write to: not an error
