"""The controller's heartbeat port under bad input from a peer that knows the secret: malformed lines and
unknown worker ids are logged and recorded as (rate-limited) events, and the controller keeps serving. Real
sockets; the workers are stand-ins that never connect, so no JAX process starts. Peers without the secret:
test_auth.py."""

from __future__ import annotations

import logging
import socket
import sys
from pathlib import Path

import anyio
import pytest

from elastic_runtime.cluster.config import LaunchConfig
from elastic_runtime.cluster.protocol import (
    MAX_LINE,
    DurableCommitted,
    EventReport,
    Heartbeat,
    Hello,
    MalformedMessage,
    Restored,
    RestoreStep,
    Stop,
    decode_from_controller,
    decode_from_worker,
    encode,
)
from elastic_runtime.cluster.tiers import Tier
from elastic_runtime.cluster.worker import ControllerLink
from elastic_runtime.core.eventlog import encode_event, read_events
from elastic_runtime.core.events import (
    CheckpointBehind,
    CheckpointCorrupt,
    ConnectionRefused,
    MalformedHeartbeat,
    SilentCorruption,
    StepFailed,
)
from elastic_runtime.defaults import default_controller


def test_messages_round_trip_and_garbage_is_named() -> None:
    hb = Heartbeat(worker=3, generation=2, step=17, step_time_s=0.02, sent_at=1.5)
    assert decode_from_worker(encode(hb)) == hb
    with pytest.raises(MalformedMessage, match="malformed"):
        decode_from_worker(b"not json\n")
    with pytest.raises(MalformedMessage):
        decode_from_worker(b'{"type": "Heartbeat", "worker": "three"}\n')
    with pytest.raises(MalformedMessage):
        decode_from_worker(b'{"type": "Form", "generation": 1}\n')  # wrong direction


def _exchange(port: int, secret: str, worker_0_pid: int) -> None:
    def send(lines: list[bytes]) -> None:
        link = ControllerLink(f"127.0.0.1:{port}", secret)
        for line in lines:
            link.sock.sendall(line)
        link.sock.shutdown(socket.SHUT_WR)  # the controller reads every line, then closes its side too
        assert isinstance(link.inbox.get(timeout=10), Stop)
        link.close()

    oversized = b"x" * (MAX_LINE + 10) + b"\n"
    send([b"garbage\n", b'{"type": "Heartbeat"}\n', oversized])  # malformed before any Hello
    send([encode(Hello(worker=4242, pid=1, target_steps=5))])  # an id the controller never started
    hello = encode(Hello(worker=0, pid=worker_0_pid, target_steps=5))
    beat = encode(Heartbeat(worker=7, generation=0, step=1, sent_at=0.0))  # claims another worker's id
    send([hello, beat, b"\xff\xfe\n", oversized])


def test_a_tier_is_one_of_its_names_or_the_message_is_malformed() -> None:
    restored = Restored(worker=1, generation=2, step=3, tier=Tier.NEIGHBOUR, nbytes=4)
    assert b'"tier":"neighbour"' in encode(restored) and decode_from_worker(encode(restored)) == restored
    line = encode(restored).replace(b'"neighbour"', b'"file-ish"')
    with pytest.raises(MalformedMessage, match="tier"):
        decode_from_worker(line)


def test_a_workers_event_crosses_the_wire_as_the_event_log_encodes_it() -> None:
    failed = StepFailed(step=7, source="worker", error_type="ValueError", message="bad batch")
    report = EventReport(worker=1, generation=2, event=failed, traceback="Traceback ...", unsupported=True)
    line = encode(report)
    assert encode_event(failed) in line  # the event itself, as the event log writes it
    decoded = decode_from_worker(line)
    assert decoded == report and type(decoded) is EventReport and type(decoded.event) is StepFailed
    corrupt = CheckpointCorrupt(step=10, source="worker", tier=Tier.DURABLE, path="p/0.bin", reason="crc32c")
    report = EventReport(worker=3, generation=4, event=corrupt, recovered_from=Tier.SHM)
    decoded = decode_from_worker(encode(report))
    assert decoded == report and type(decoded.event) is CheckpointCorrupt
    assert decoded.event.tier == "durable" and decoded.recovered_from is Tier.SHM
    for message in (RestoreStep(generation=2, step=5, source=0, target_steps=9), DurableCommitted(step=5)):
        assert decode_from_controller(encode(message)) == message


def test_a_malformed_event_in_a_report_is_named() -> None:
    corrupt = CheckpointCorrupt(step=10, source="worker", tier=Tier.SHM, path="p", reason="crc32c")
    line = encode(EventReport(worker=3, generation=4, event=corrupt, recovered_from=Tier.DURABLE))
    with pytest.raises(MalformedMessage, match=r"event\.tier: 'file-ish' is not a tier"):
        decode_from_worker(line.replace(b'"shm"', b'"file-ish"'))
    with pytest.raises(MalformedMessage, match=r"missing required field `path` - at `\$\.event`"):
        decode_from_worker(line.replace(b'"path":"p",', b""))
    with pytest.raises(MalformedMessage, match=r"Invalid value 'StepCompleted' - at `\$\.event\.type`"):
        decode_from_worker(line.replace(b'"CheckpointCorrupt"', b'"StepCompleted"'))  # not one a worker reports
    with pytest.raises(MalformedMessage, match=r"event\.step"):
        decode_from_worker(line.replace(b'"step":10', b'"step":null'))
    with pytest.raises(MalformedMessage, match="belong to a StepFailed"):
        decode_from_worker(line.replace(b'"unsupported":false', b'"unsupported":true'))
    with pytest.raises(MalformedMessage, match=r"Expected `object`, got `str` - at `\$\.event`"):
        decode_from_worker(b'{"type":"EventReport","worker":1,"generation":2,"event":"StepFailed"}\n')
    failed = EventReport(worker=1, generation=2, event=StepFailed(step=3, error_type="E", message="m"))
    with pytest.raises(MalformedMessage, match="belongs to a CheckpointCorrupt"):
        decode_from_worker(encode(failed).replace(b'"recovered_from":null', b'"recovered_from":"ram"'))
    with pytest.raises(MalformedMessage, match=r"Invalid enum value 'file-ish' - at `\$\.recovered_from`"):
        decode_from_worker(encode(failed).replace(b'"recovered_from":null', b'"recovered_from":"file-ish"'))
    behind = EventReport(
        worker=1, generation=2, event=CheckpointBehind(step=9, tier="durable", writing=5, behind_steps=9)
    )
    assert decode_from_worker(encode(behind)) == behind
    with pytest.raises(MalformedMessage, match="not 'shm'"):  # a worker's writes behind are the durable tier's
        decode_from_worker(encode(behind).replace(b'"durable"', b'"shm"'))
    found = SilentCorruption(step=13, suspects=(0, 2048), digests={"0": "0a"}, replicas=2, attributed=False)
    corrupt = EventReport(worker=1, generation=2, event=found, processes=(0, 1))
    assert decode_from_worker(encode(corrupt)) == corrupt
    with pytest.raises(MalformedMessage, match="names the processes of its suspects"):
        decode_from_worker(encode(corrupt).replace(b'"processes":[0,1]', b'"processes":[]'))
    with pytest.raises(MalformedMessage, match="names the processes of its suspects"):
        decode_from_worker(encode(behind).replace(b'"processes":[]', b'"processes":[1]'))


def test_malformed_heartbeats_and_unknown_ids_do_not_crash_the_controller(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="elastic_runtime.cluster.controller")
    # Stand-in workers that never connect, so the controller waits for them while the test talks to it.
    command = [sys.executable, "-c", "import time; time.sleep(60)"]
    config = LaunchConfig(command=command, nprocs=2, spares=0, run_dir=str(tmp_path), spawn_timeout_s=30)
    controller = default_controller(config)
    controller.server.limiter.interval_s = 3600.0  # one summary per host, at the end: the counts are exact

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(controller.run_async)
            with anyio.fail_after(10):
                while not controller.port:
                    await anyio.sleep(0.01)
            await anyio.to_thread.run_sync(_exchange, controller.port, controller.secret, controller.pool[0].popen.pid)
            assert controller.bus.dispatched > 0  # still dispatching: alive
            for proc in controller.pool:
                proc.popen.kill()
            tg.cancel_scope.cancel()

    anyio.run(main)
    text = caplog.text
    assert "controller: ignored a message from 127.0.0.1" in text
    assert "controller: refused a connection from 127.0.0.1" in text
    events = read_events(tmp_path / "events.jsonl")
    malformed = [e for e in events if isinstance(e, MalformedHeartbeat)]
    # Rate-limited: the first line at once, then one summary of the other five, naming the last.
    assert [e.count for e in malformed] == [1, 5], malformed
    assert "xxxxxxxx" in malformed[-1].reason or "longer than" in malformed[-1].reason  # however it was cut
    [refused] = [e for e in events if isinstance(e, ConnectionRefused)]
    assert "worker id 4242 was not started" in refused.reason
