"""Whether a notice source works is recorded: a subscription that does not exist (the real emulator answers 404),
no credentials, or a metadata server that does not answer is a ``NoticeSourceFailed`` event at once, and the first
success a ``NoticeSourceReady``; with ``require_maintenance_notices`` a source that does not work is an error at
start, in one process and under the controller."""

from __future__ import annotations

import inspect
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
from google.api_core import exceptions as api_exceptions
from metadata_server import FakeMetadataServer
from pubsub_emulator import PubSubEmulator, free_port
from pubsub_support import PROJECT, Topic, make_topic

from elastic_runtime import ElasticRuntime, Event, MeshPolicy, RunFinished, RuntimeConfig, StepCompleted, read_events
from elastic_runtime.cluster.config import LaunchConfig
from elastic_runtime.core.bus import EventBus
from elastic_runtime.core.errors import ConfigError
from elastic_runtime.core.events import NoticeSourceFailed, NoticeSourceReady
from elastic_runtime.defaults import default_controller
from elastic_runtime.maintenance import BusContext, MetadataWatcher, PubSubListener
from elastic_runtime.maintenance.pubsub import CONSUME
from elastic_runtime.maintenance.source import NoticeSourceUnavailable
from elastic_runtime.testing.demo_model import demo_job

pytestmark = pytest.mark.anyio

SOURCE_EVENTS = (NoticeSourceFailed, NoticeSourceReady)


def missing_subscription() -> str:
    return f"projects/{PROJECT}/subscriptions/never-made-{uuid.uuid4().hex[:8]}"


@asynccontextmanager
async def running(source: PubSubListener | MetadataWatcher) -> AsyncIterator[list[Event]]:
    """``source`` on a bus of its own; yields what it published about itself."""
    bus, seen = EventBus(), []

    async def record(event: Event, _: object) -> None:
        seen.append(event)

    for kind in SOURCE_EVENTS:
        bus.subscribe(kind, record)
    async with anyio.create_task_group() as tg:
        tg.start_soon(bus.run)
        tg.start_soon(source.run, BusContext(bus))
        try:
            yield seen
        finally:
            tg.cancel_scope.cancel()
    await bus.close()


async def until(seen: list[Event], kind: type[Event], n: int = 1) -> None:
    with anyio.fail_after(60):  # a guard against a hang, not a measurement
        while sum(isinstance(e, kind) for e in seen) < n:
            await anyio.sleep(0.02)


async def test_a_subscription_that_does_not_exist_is_an_event_at_once_and_once(
    pubsub_clients: tuple[Any, Any],
) -> None:
    name = f"late{uuid.uuid4().hex[:8]}"
    subscription = f"projects/{PROJECT}/subscriptions/{name}-sub"
    listener = PubSubListener(subscription, reconnect_max_s=0.2)
    async with running(listener) as seen:
        await until(seen, NoticeSourceFailed)
        await anyio.sleep(1.0)  # several more tries, with backoff: each fails the same way
        [failed] = seen
        assert isinstance(failed, NoticeSourceFailed)
        assert failed.source == "pubsub" and failed.address == subscription and failed.permanent
        assert failed.error_type == "NotFound" and failed.reason == "the subscription does not exist"
        assert "404 Subscription does not exist" in failed.message and failed.retry_s == 0.2
        # The operator creates it: the listener, still trying, finds it.
        await anyio.to_thread.run_sync(make_topic, *pubsub_clients, name)
        await until(seen, NoticeSourceReady)
    assert [type(e) for e in seen] == [NoticeSourceFailed, NoticeSourceReady]
    assert seen[1].address == subscription  # type: ignore[attr-defined]


async def test_no_credentials_is_an_event_at_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Not the emulator: Google Cloud itself, with no credentials on this machine (nor a metadata server)."""
    monkeypatch.delenv("PUBSUB_EMULATOR_HOST", raising=False)
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path))  # no gcloud application-default credentials
    monkeypatch.setenv("NO_GCE_CHECK", "True")  # and not a Compute Engine VM's
    subscription = missing_subscription()
    listener = PubSubListener(subscription, reconnect_max_s=0.2)
    with pytest.raises(NoticeSourceUnavailable, match="no credentials") as raised:
        await listener.check()
    assert raised.value.permanent and raised.value.error_type == "DefaultCredentialsError"
    async with running(listener) as seen:
        await until(seen, NoticeSourceFailed)
    failed = seen[0]
    assert isinstance(failed, NoticeSourceFailed) and failed.reason == "no credentials" and failed.permanent


class DeniedClient:
    """A client of an account with roles/pubsub.subscriber only: it may pull, not read the subscription."""

    def __init__(self, granted: list[str]) -> None:
        self.granted = granted

    def get_subscription(self, **kwargs: Any) -> None:
        raise api_exceptions.PermissionDenied("User not authorized to perform this action.")

    def test_iam_permissions(self, request: dict[str, Any], **kwargs: Any) -> Any:
        assert request["permissions"] == [CONSUME]
        return type("Response", (), {"permissions": [p for p in request["permissions"] if p in self.granted]})()

    def close(self) -> None:
        pass


async def test_an_account_that_may_pull_but_not_read_the_subscription_works() -> None:
    subscription = missing_subscription()
    may_pull = PubSubListener(subscription, client_factory=lambda: DeniedClient([CONSUME]))  # type: ignore[arg-type,return-value]
    await may_pull.check()
    may_not = PubSubListener(subscription, client_factory=lambda: DeniedClient([]))  # type: ignore[arg-type,return-value]
    with pytest.raises(NoticeSourceUnavailable, match="permission denied") as raised:
        await may_not.check()
    assert raised.value.permanent and subscription in str(raised.value)


def small_runtime(tmp_path: Path, **settings: Any) -> ElasticRuntime:
    config = RuntimeConfig(run_dir=str(tmp_path), precompile=False, progress=False, **settings)
    policy = MeshPolicy({"data": 4, "model": 2}, global_batch=24, slice_size=2)
    return ElasticRuntime(demo_job(global_batch=24, features=16, hidden=64), config=config, mesh_policy=policy)


async def test_a_run_without_its_subscription_records_it_and_goes_on(
    pubsub_emulator: PubSubEmulator, tmp_path: Path
) -> None:
    subscription = missing_subscription()
    rt = small_runtime(tmp_path, maintenance_subscription=subscription)
    failed = anyio.Event()

    @rt.on(NoticeSourceFailed)
    async def note(event: Event, ctx: object) -> None:
        failed.set()

    async def hold(step: int) -> None:
        if step == 2:
            with anyio.fail_after(60):  # a guard against a hang, not a measurement
                await failed.wait()

    rt.at_step_boundary(hold)
    await rt.run_async(20)
    events = read_events(tmp_path / "events.jsonl")
    [event] = [e for e in events if isinstance(e, NoticeSourceFailed)]
    assert event.address == subscription and event.reason == "the subscription does not exist"
    assert not [e for e in events if isinstance(e, NoticeSourceReady)]
    [finished] = [e for e in events if isinstance(e, RunFinished)]
    assert finished.ok and finished.step == 20


async def test_a_required_subscription_that_does_not_exist_fails_the_run_at_start(
    pubsub_emulator: PubSubEmulator, tmp_path: Path
) -> None:
    subscription = missing_subscription()
    rt = small_runtime(tmp_path, maintenance_subscription=subscription, require_maintenance_notices=True)
    with pytest.raises(ConfigError, match="require_maintenance_notices") as raised:
        await rt.run_async(20)
    assert subscription in str(raised.value) and "the subscription does not exist" in str(raised.value)
    events = read_events(tmp_path / "events.jsonl")
    assert not [e for e in events if isinstance(e, StepCompleted)], "no step may run without the notices"
    [finished] = [e for e in events if isinstance(e, RunFinished)]
    assert not finished.ok and subscription in finished.reason


async def test_a_required_subscription_that_works_lets_the_run_go_on_batched(topic: Topic, tmp_path: Path) -> None:
    rt = small_runtime(tmp_path, maintenance_subscription=topic.subscription, require_maintenance_notices=True)
    result = await rt.run_async(5)
    assert result.step == 5
    # The check's async hook gave its place to a sync one: the steps run batched again.
    assert rt.executor.hooks and not any(inspect.iscoroutinefunction(hook) for hook in rt.executor.hooks)


def test_the_controller_refuses_to_start_without_a_required_subscription(
    pubsub_emulator: PubSubEmulator, tmp_path: Path
) -> None:
    subscription = missing_subscription()
    config = LaunchConfig(
        command=[],
        nprocs=2,
        secret="s" * 64,
        run_dir=str(tmp_path),
        maintenance_subscription=subscription,
        require_maintenance_notices=True,
    )
    controller = default_controller(config)
    with pytest.raises(ConfigError, match="the subscription does not exist") as raised:
        controller.run()
    assert subscription in str(raised.value)


def test_requiring_notices_needs_a_source() -> None:
    with pytest.raises(ConfigError, match="require_maintenance_notices needs a notice source"):
        RuntimeConfig(require_maintenance_notices=True)
    with pytest.raises(ConfigError, match="require_maintenance_notices needs a maintenance_subscription"):
        LaunchConfig(command=["python"], nprocs=2, require_maintenance_notices=True)
    from elastic_runtime.cli.launch import config_from_args
    from elastic_runtime.cli.main import build_parser

    argv = ["launch", "--nprocs", "2", "--maintenance-subscription", "projects/p/subscriptions/s"]
    args = build_parser().parse_args([*argv, "--require-maintenance-notices", "--", "python", "train.py"])
    assert config_from_args(args).require_maintenance_notices
    assert not config_from_args(build_parser().parse_args([*argv, "--", "python"])).require_maintenance_notices


async def test_a_metadata_server_that_does_not_answer_is_an_event_and_one_that_does_another() -> None:
    nowhere = MetadataWatcher(f"127.0.0.1:{free_port()}", retry_max_s=0.2)
    with pytest.raises(NoticeSourceUnavailable, match="metadata server"):
        await nowhere.check()
    async with running(nowhere) as seen:
        await until(seen, NoticeSourceFailed)
    assert isinstance(seen[0], NoticeSourceFailed) and seen[0].source == "metadata"
    with FakeMetadataServer() as server:
        watcher = MetadataWatcher(server.host)
        await watcher.check()
        async with running(watcher) as seen:
            await until(seen, NoticeSourceReady)
    assert [type(e) for e in seen] == [NoticeSourceReady] and seen[0].address == watcher.base  # type: ignore[attr-defined]
