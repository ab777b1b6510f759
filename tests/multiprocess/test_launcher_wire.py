"""The controller's heartbeat port under bad input: malformed lines and unknown worker ids are logged and
recorded as events, and the controller keeps serving. Real sockets; the workers are stand-ins that never
connect, so no JAX process starts."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import anyio
import pytest

from runtime.cluster.config import LaunchConfig
from runtime.cluster.protocol import MAX_LINE, Heartbeat, Hello, MalformedMessage, decode_from_worker, encode
from runtime.core.eventlog import read_events
from runtime.core.events import MalformedHeartbeat
from runtime.defaults import default_controller


def test_messages_round_trip_and_garbage_is_named() -> None:
    hb = Heartbeat(worker=3, generation=2, step=17, step_time_s=0.02, sent_at=1.5)
    assert decode_from_worker(encode(hb)) == hb
    with pytest.raises(MalformedMessage, match="malformed"):
        decode_from_worker(b"not json\n")
    with pytest.raises(MalformedMessage):
        decode_from_worker(b'{"type": "Heartbeat", "worker": "three"}\n')
    with pytest.raises(MalformedMessage):
        decode_from_worker(b'{"type": "Form", "generation": 1}\n')  # wrong direction


async def _exchange(port: int) -> None:
    async def send(lines: list[bytes]) -> None:
        stream = await anyio.connect_tcp("127.0.0.1", port)
        async with stream:
            for line in lines:
                await stream.send(line)
            await anyio.sleep(0.1)

    await send([b"garbage\n", b'{"type": "Heartbeat"}\n'])  # malformed before any Hello
    await send([encode(Hello(worker=4242, pid=1, target_steps=5))])  # an id the controller never started
    await send([b"x" * (MAX_LINE + 10) + b"\n"])  # an oversized line
    hello = encode(Hello(worker=0, pid=1, target_steps=5))
    beat = encode(Heartbeat(worker=7, generation=0, step=1, sent_at=0.0))  # claims another worker's id
    await send([hello, beat, b"\xff\xfe\n"])


def test_malformed_heartbeats_and_unknown_ids_do_not_crash_the_controller(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="runtime.cluster.controller")
    # Stand-in workers that never connect, so the controller waits for them while the test talks to it.
    command = [sys.executable, "-c", "import time; time.sleep(60)"]
    config = LaunchConfig(command=command, nprocs=2, spares=0, run_dir=str(tmp_path), spawn_timeout_s=30)
    controller = default_controller(config)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(controller.run_async)
            with anyio.fail_after(10):
                while not controller.port:
                    await anyio.sleep(0.01)
            await _exchange(controller.port)
            await anyio.sleep(0.2)
            assert controller.bus.dispatched > 0  # still dispatching: alive
            tg.cancel_scope.cancel()

    anyio.run(main)
    text = caplog.text
    assert "controller: ignored message from 127.0.0.1" in text
    assert "unknown worker id 4242" in text
    assert "xxxxxxxx" in text or "longer than" in text  # the oversized line was refused, however it was cut
    assert "worker 0's connection sent" in text
    events = [e for e in read_events(tmp_path / "events.jsonl") if isinstance(e, MalformedHeartbeat)]
    reasons = " | ".join(e.reason for e in events)
    assert len(events) >= 6, reasons
    assert "unknown worker id 4242" in reasons
