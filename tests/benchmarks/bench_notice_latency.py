"""Notice-to-event latency on the real Pub/Sub emulator: from publish to the event reaching a handler.

Starts its own emulator on a free port, a topic and a subscription, and a PubSubListener on a bare bus. Each
message is a Cloud Logging sink entry (``compute.instances.hostError`` for a distinct instance, so none is
deduplicated away). Two runs. Steady: one message every ``1/rate`` s, as notices really arrive (rarely, one
at a time). Burst: every message at once, to show queueing under flow control.

Two clocks per message: from the server's ``publish_time`` (set by the emulator when it accepted the
message) and from just before the publisher's call, to when the handler runs. Same machine, same clock.

    .venv/bin/python tests/benchmarks/bench_notice_latency.py [--messages 300] [--rate 20] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "maintenance"))

from notices import log_entry
from pubsub_emulator import PubSubEmulator

from elastic_runtime.core.bus import EventBus
from elastic_runtime.core.events import Notice
from elastic_runtime.maintenance import BusContext, PubSubListener


def percentiles(values: list[float]) -> dict[str, float]:
    ms = np.array(values) * 1000
    return {
        "n": len(values),
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "max_ms": float(ms.max()),
    }


async def measure(publisher: Any, topic: str, subscription: str, messages: int, rate: float | None) -> dict[str, Any]:
    bus = EventBus()
    published: dict[str, float] = {}
    sent: dict[str, float] = {}
    handled: dict[str, float] = {}

    def on_message(message_id: str, publish_time: float, received: float) -> None:
        published[message_id] = publish_time

    async def handler(event: Notice, ctx: Any) -> None:
        handled[event.instance] = time.time()

    bus.subscribe(Notice, handler)
    listener = PubSubListener(subscription, max_messages=1000, on_message=on_message)
    ids: dict[str, str] = {}
    tag = f"{int(time.time() * 1000)}"
    async with anyio.create_task_group() as tg:
        tg.start_soon(bus.run)
        tg.start_soon(listener.run, BusContext(bus))
        # Warm the stream up (the first message also pays for connecting): not counted.
        publisher.publish(topic, log_entry("hostError", name=f"warmup-{tag}")).result()
        with anyio.fail_after(30):
            while f"warmup-{tag}" not in handled:
                await anyio.sleep(0.01)

        def publish_all() -> None:
            futures = []
            for i in range(messages):
                name = f"vm-{tag}-{i}"
                data = log_entry("hostError", name=name, instance_id=str(i))
                sent[name] = time.time()
                future = publisher.publish(topic, data)
                futures.append((name, future))
                if rate is not None:
                    ids[name] = future.result()
                    time.sleep(max(0.0, sent[name] + 1 / rate - time.time()))
            for name, future in futures:
                ids[name] = future.result()

        await anyio.to_thread.run_sync(publish_all)
        with anyio.fail_after(120):
            while len(handled) < messages + 1:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    await bus.close()
    from_publish_time = [handled[n] - published[ids[n]] for n in sent]
    from_send = [handled[n] - sent[n] for n in sent]
    return {
        "mode": "steady" if rate else "burst",
        "rate_per_s": rate,
        "from_publish_time": percentiles(from_publish_time),
        "from_publisher_call": percentiles(from_send),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--rate", type=float, default=20.0, help="messages per second in the steady run")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    emulator = PubSubEmulator()
    emulator.start()
    os.environ["PUBSUB_EMULATOR_HOST"] = emulator.host
    try:
        from google.cloud import pubsub_v1

        publisher, subscriber = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
        results = []
        for mode, rate in (("steady", args.rate), ("burst", None)):
            topic = publisher.topic_path("elastic-bench", f"latency-{mode}")
            subscription = subscriber.subscription_path("elastic-bench", f"latency-{mode}-sub")
            publisher.create_topic(name=topic)
            subscriber.create_subscription(name=subscription, topic=topic)
            results.append(anyio.run(measure, publisher, topic, subscription, args.messages, rate))
        subscriber.close()
    finally:
        emulator.stop()
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    if args.json:
        # One line, flat keys: what tests/benchmarks/run_all.py reads and tabulates.
        flat: dict[str, Any] = {"messages": args.messages, "steady_rate_per_s": args.rate}
        for r in results:
            for clock in ("from_publish_time", "from_publisher_call"):
                for figure in ("p50_ms", "p99_ms", "max_ms"):
                    flat[f"{r['mode']}_{figure}_{clock}"] = round(r[clock][figure], 1)
        print(json.dumps(flat))
        return
    print(f"machine: {machine}")
    for r in results:
        label = f"{r['mode']} ({r['rate_per_s']:g}/s)" if r["rate_per_s"] else f"{r['mode']} (all at once)"
        for clock in ("from_publish_time", "from_publisher_call"):
            p = r[clock]
            print(
                f"{label:20s} {clock:20s} n={p['n']} p50={p['p50_ms']:.1f} ms p99={p['p99_ms']:.1f} ms "
                f"max={p['max_ms']:.1f} ms"
            )


if __name__ == "__main__":
    main()
