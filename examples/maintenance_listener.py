"""Subscribe to Google Cloud maintenance notices during training, with a handler of your own.

A training run listens on a Pub/Sub subscription fed by a Cloud Logging sink (docs/gcp-setup.md). The
built-in handlers checkpoint to the durable tiers when a window is announced, drain the instance's devices
``drain_lead_s`` before it opens and re-admit them afterwards; the handler below only tells you, and could
page someone, pause a data pipeline, or veto the drain by unsubscribing the built-in one.

Against your project (the instances and devices are yours to fill in):

    .venv/bin/python examples/maintenance_listener.py --subscription projects/P/subscriptions/S \\
        --instance my-vm-0=0,1,2,3 --instance my-vm-1=4,5,6,7

Without a project, on the Pub/Sub emulator (started here, on a free port; it must be installed, see
tests/maintenance/pubsub_emulator.py): the example announces maintenance of "worker-1" itself.

    .venv/bin/python examples/maintenance_listener.py --emulator
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import jax

jax.config.update("jax_num_cpu_devices", 8)

from elastic_runtime import (  # noqa: E402
    CheckpointCommitted,
    Drain,
    ElasticRuntime,
    MaintenanceCompleted,
    MeshChanged,
    MeshPolicy,
    Notice,
    RuntimeConfig,
    RuntimeContext,
    read_events,
)
from elastic_runtime.testing.demo_model import demo_job  # noqa: E402

HERE = Path(__file__).resolve().parent


async def tell_me(event: Notice, ctx: RuntimeContext) -> None:
    """Your handler: every notice for one of this job's instances, as it arrives."""
    window = ""
    start = getattr(event, "window_start", None)
    if start is not None:
        window = f", window opens in {start - time.time():.1f} s"
    print(f"  notice: {type(event).__name__} for {event.instance} ({event.kind or '-'}){window} at step {ctx.step}")


def parse_instances(values: list[str]) -> dict[str, tuple[int, ...]]:
    """``name=0,1,2`` pairs into the ``instance_devices`` setting."""
    devices: dict[str, tuple[int, ...]] = {}
    for value in values:
        name, _, ids = value.partition("=")
        devices[name] = tuple(int(i) for i in ids.split(",") if i)
    return devices


def announce_on_emulator(subscription_ready: dict[str, Any]) -> None:
    """Emulator mode: create a topic and subscription, and publish a notice the way a Logging sink would."""
    sys.path.insert(0, str(HERE.parent / "tests" / "maintenance"))
    from google.cloud import pubsub_v1
    from notices import upcoming

    publisher, subscriber = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
    topic = publisher.topic_path("elastic-example", "maintenance")
    subscription = subscriber.subscription_path("elastic-example", "maintenance-job")
    publisher.create_topic(name=topic)
    subscriber.create_subscription(name=subscription, topic=topic)
    subscriber.close()
    subscription_ready.update(publisher=publisher, topic=topic, subscription=subscription, upcoming=upcoming)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subscription", help="projects/P/subscriptions/S")
    parser.add_argument("--instance", action="append", default=[], help="NAME=DEVICE,DEVICE,... (repeatable)")
    parser.add_argument("--emulator", action="store_true", help="run against a local Pub/Sub emulator")
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    if not args.subscription and not args.emulator:
        parser.error("name --subscription, or use --emulator")

    emulator: Any = None
    announce: dict[str, Any] = {}
    if args.emulator:
        sys.path.insert(0, str(HERE.parent / "tests" / "maintenance"))
        from pubsub_emulator import PubSubEmulator

        emulator = PubSubEmulator()
        emulator.start()
        os.environ["PUBSUB_EMULATOR_HOST"] = emulator.host
        announce_on_emulator(announce)
        args.subscription = announce["subscription"]
        args.instance = args.instance or ["worker-0=0,1,2,3,4,5", "worker-1=6,7"]

    run_dir = tempfile.mkdtemp(prefix="maintenance-example-")
    config = RuntimeConfig(
        run_dir=run_dir,
        maintenance_subscription=args.subscription,
        instance_devices=parse_instances(args.instance),
        drain_lead_s=2.0,
        scale_up_poll_s=0.5,
        disk_every=10_000,  # here only the notice's request writes to disk, so its checkpoint stands out
    )
    policy = MeshPolicy({"data": 4, "model": 2}, global_batch=24, slice_size=2)
    rt = ElasticRuntime(demo_job(global_batch=24, features=16, hidden=64), config=config, mesh_policy=policy)
    rt.subscribe(Notice, tell_me)

    @rt.on(MeshChanged)
    async def show_mesh(event: MeshChanged, ctx: RuntimeContext) -> None:
        print(f"  mesh -> {event.new_shape} on devices {list(event.devices)}: {event.reason}")

    @rt.on(CheckpointCommitted)
    async def show_checkpoint(event: CheckpointCommitted, ctx: RuntimeContext) -> None:
        print(f"  checkpoint of step {event.step} committed to {event.tier}")

    @rt.on(Drain)
    async def show_drain(event: Drain, ctx: RuntimeContext) -> None:
        due = "now" if event.deadline is None else f"in {event.deadline - time.time():.1f} s"
        print(f"  drain of {event.instance} planned, due {due}")

    async def pace(step: int) -> None:
        await anyio.sleep(0.02)  # the demo model is tiny: slow it to a human pace
        if announce and step == 50:
            now = time.time()
            data = announce["upcoming"](name="worker-1", instance_id="1", start=now + 4, end=now + 8, issued=now)
            await anyio.to_thread.run_sync(lambda: announce["publisher"].publish(announce["topic"], data).result())
            print("  (published a maintenance notice for worker-1, window in 4 s)")
        if announce and step == 300:
            now = time.time()
            done = announce["upcoming"](
                name="worker-1",
                instance_id="1",
                start=now - 4,
                end=now,
                issued=now,
                status_message="Maintenance window has completed",
            )
            await anyio.to_thread.run_sync(lambda: announce["publisher"].publish(announce["topic"], done).result())

    rt.at_step_boundary(pace)
    print(f"training {args.steps} steps, listening on {args.subscription}")
    try:
        result = rt.run(args.steps)
    finally:
        if emulator is not None:
            emulator.stop()
    completed = [e for e in read_events(result.events_path or "") if isinstance(e, MaintenanceCompleted)]
    print(f"done at step {result.step}, loss {result.loss:.4f}; {len(completed)} maintenance completed")
    print(f"event log: {result.events_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
