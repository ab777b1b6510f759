"""Bus throughput and publish-to-handler latency.

Throughput: N events published as fast as possible to one handler, events per second from the first
publish to the last handler call (the event log off and on). Latency: events published one at a time at a
steady pace, the time from ``publish`` to the handler's first line, p50/p99/max.

    .venv/bin/python tests/benchmarks/bench_bus.py [--events 200000] [--json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from elastic_runtime.core.bus import EventBus
from elastic_runtime.core.eventlog import EventLog
from elastic_runtime.core.events import StepCompleted


async def throughput(events: int, log: EventLog | None) -> float:
    bus = EventBus(log=log, max_pending=65536)
    handled = 0

    async def handler(event: StepCompleted, ctx: Any) -> None:
        nonlocal handled
        handled += 1

    bus.subscribe(StepCompleted, handler)
    event = StepCompleted(step=1, duration_s=0.0, mesh_shape={"data": 8}, data_position=1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(bus.run)
        started = time.perf_counter()
        for _ in range(events):
            await bus.publish(event)
        await bus.close()
    elapsed = time.perf_counter() - started
    assert handled == events
    return events / elapsed


async def latency(events: int) -> np.ndarray:
    bus = EventBus()
    delays: list[float] = []
    sent: dict[int, float] = {}

    async def handler(event: StepCompleted, ctx: Any) -> None:
        delays.append(time.perf_counter() - sent[event.data_position])

    bus.subscribe(StepCompleted, handler)
    async with anyio.create_task_group() as tg:
        tg.start_soon(bus.run)
        for n in range(events):
            event = StepCompleted(step=n, duration_s=0.0, mesh_shape={"data": 8}, data_position=n)
            sent[n] = time.perf_counter()
            await bus.publish(event)
            if n % 10 == 0:
                await anyio.sleep(0.0005)  # a steady pace, not a burst
        await bus.close()
    return np.array(delays)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rates = [anyio.run(throughput, args.events, None) for _ in range(args.repeats)]
    with tempfile.TemporaryDirectory() as tmp:
        logged = []
        for i in range(args.repeats):
            log = EventLog(Path(tmp) / f"events-{i}.jsonl")
            logged.append(anyio.run(throughput, args.events, log))
            log.close()
    delays = anyio.run(latency, 20_000) * 1000
    result = {
        "events": args.events,
        "throughput_median_per_s": round(float(np.median(rates))),
        "throughput_with_log_median_per_s": round(float(np.median(logged))),
        "latency_ms_p50": round(float(np.percentile(delays, 50)), 4),
        "latency_ms_p99": round(float(np.percentile(delays, 99)), 4),
        "latency_ms_max": round(float(delays.max()), 4),
    }
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
