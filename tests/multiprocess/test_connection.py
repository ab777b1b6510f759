"""The controller's reader (issue 32): lines framed from whatever pieces arrive, each connection proving the
secret before anything it sends is handed on, and a bad frame closing only its own connection.

``LineBuffer`` alone, then a real ``WorkerServer`` on a real loopback socket with stand-in handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import pytest
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from elastic_runtime.cluster import auth
from elastic_runtime.cluster.controller.connection import MAX_MALFORMED, Connection
from elastic_runtime.cluster.controller.processes import WorkerProcess
from elastic_runtime.cluster.controller.server import Report, WorkerServer
from elastic_runtime.cluster.lines import LineBuffer, LineTooLong
from elastic_runtime.cluster.protocol import MAX_LINE, Heartbeat, Hello, Message, Stop, decode_from_controller, encode

SECRET = "s3cret"

# --- the framing alone ------------------------------------------------------------------------------------


def test_lines_come_whole_from_split_and_merged_reads() -> None:
    lines = [encode(Heartbeat(worker=1, generation=0, step=i, sent_at=0.0)) for i in range(3)]
    stream = b"".join(lines)
    for cut in range(1, len(stream)):  # every split of the stream into two reads
        buffer = LineBuffer(MAX_LINE)
        got: list[bytes] = []
        for piece in (stream[:cut], stream[cut:]):
            buffer.feed(piece)
            while (line := buffer.next_line()) is not None:
                got.append(line)
        assert got == [line[:-1] for line in lines]
        assert len(buffer) == 0
    buffer = LineBuffer(MAX_LINE)
    for byte in stream:  # one byte a read
        buffer.feed(bytes([byte]))
    assert [buffer.next_line() for _ in lines] == [line[:-1] for line in lines]
    assert buffer.next_line() is None


def test_a_line_longer_than_the_limit_is_refused_before_it_ends() -> None:
    buffer = LineBuffer(10)
    buffer.feed(b"0123456789\n")
    assert buffer.next_line() == b"0123456789"  # exactly the limit
    buffer.feed(b"x" * 11)
    with pytest.raises(LineTooLong, match="longer than 10 bytes"):
        buffer.next_line()  # no newline yet: refused without waiting for the rest
    buffer = LineBuffer(10)
    buffer.feed(b"x" * 11 + b"\nok\n")
    with pytest.raises(LineTooLong):
        buffer.next_line()


# --- a real server with stand-in handlers -----------------------------------------------------------------


@dataclass
class Seen:
    """What the stand-in handlers were given."""

    messages: list[tuple[int, Message]] = field(default_factory=list)
    reports: list[Report] = field(default_factory=list)
    closed: list[tuple[int, str]] = field(default_factory=list)
    procs: dict[int, WorkerProcess] = field(default_factory=dict)
    hellos: int = 0


def stand_in_server(seen: Seen, *, auth_timeout_s: float = 5.0, max_pending: int = 32) -> WorkerServer:
    async def on_hello(message: Message, conn: Connection, peer: str) -> WorkerProcess | str:
        seen.hellos += 1
        if not isinstance(message, Hello) or message.worker >= 100:
            return f"no worker {getattr(message, 'worker', '?')} here"
        proc = WorkerProcess(worker=message.worker, popen=None)
        proc.stream = conn
        seen.procs[message.worker] = proc
        return proc

    async def on_message(proc: WorkerProcess, message: Message) -> None:
        seen.messages.append((proc.worker, message))

    async def on_report(report: Report) -> None:
        seen.reports.append(report)

    def on_closed(proc: WorkerProcess, reason: str) -> None:
        seen.closed.append((proc.worker, reason))

    server = WorkerServer(
        secret=SECRET,
        on_hello=on_hello,
        on_message=on_message,
        on_report=on_report,
        on_closed=on_closed,
        auth_timeout_s=auth_timeout_s,
        max_pending=max_pending,
    )
    server.limiter.interval_s = 3600.0  # one summary per host, at the end: the counts are exact
    return server


class Peers:
    """Connections to the server on ``port``, every one closed when the test's ``serving`` block ends."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.streams: list[SocketStream] = []

    async def raw(self) -> tuple[SocketStream, BufferedByteReceiveStream]:
        """A connection that has read the challenge and proved nothing."""
        stream = await anyio.connect_tcp("127.0.0.1", self.port)
        self.streams.append(stream)
        reader = BufferedByteReceiveStream(stream)
        await reader.receive_until(b"\n", auth.MAX_LINE)
        return stream, reader

    async def connect(self, secret: str = SECRET) -> tuple[SocketStream, BufferedByteReceiveStream]:
        """A connection that has proved ``secret`` (and checked the controller's proof)."""
        stream = await anyio.connect_tcp("127.0.0.1", self.port)
        self.streams.append(stream)
        reader = BufferedByteReceiveStream(stream)
        answer, expected = auth.answer(secret, await reader.receive_until(b"\n", auth.MAX_LINE))
        await stream.send(auth.encode(answer))
        auth.check_welcome(expected, await reader.receive_until(b"\n", auth.MAX_LINE))
        return stream, reader


@asynccontextmanager
async def serving(server: WorkerServer) -> AsyncIterator[Peers]:
    await server.listen("127.0.0.1", 0)
    peers = Peers(server.port)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve)
            yield peers
            tg.cancel_scope.cancel()
        await server.aclose()
        await server.flush()
    finally:
        for stream in peers.streams:
            await stream.aclose()
        await anyio.sleep(0.05)  # the server's side of each closes in the next loop iterations


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    with anyio.fail_after(timeout_s):
        while not condition():
            await anyio.sleep(0.01)


async def closed_by_peer(reader: BufferedByteReceiveStream) -> bool:
    with anyio.fail_after(10):
        try:
            await reader.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            return True
    return False


def beat(worker: int, step: int) -> bytes:
    return encode(Heartbeat(worker=worker, generation=0, step=step, sent_at=0.0))


def run(test: Callable[[], Awaitable[None]]) -> None:
    anyio.run(test)


def test_messages_split_byte_by_byte_or_merged_arrive_whole_and_in_order() -> None:
    seen = Seen()

    async def main() -> None:
        async with serving(stand_in_server(seen)) as peers:
            stream, _ = await peers.connect()
            await stream.send(encode(Hello(worker=1, pid=1, target_steps=5)))
            for byte in beat(1, 1):  # a heartbeat one byte at a time
                await stream.send(bytes([byte]))
                await anyio.sleep(0)
            await stream.send(b"".join(beat(1, step) for step in range(2, 202)))  # 200 in one write
            await until(lambda: len(seen.messages) == 201)
            await stream.aclose()
            await until(lambda: seen.closed == [(1, "connection closed")])

    run(main)
    assert [m.step for _, m in seen.messages if isinstance(m, Heartbeat)] == list(range(1, 202))
    assert seen.reports == []


def test_an_oversized_or_malformed_frame_closes_only_its_own_connection() -> None:
    seen = Seen()

    async def main() -> None:
        async with serving(stand_in_server(seen)) as peers:
            bad, bad_reader = await peers.connect()
            good, _ = await peers.connect()
            for worker, stream in ((1, bad), (2, good)):
                await stream.send(encode(Hello(worker=worker, pid=1, target_steps=5)))
            await bad.send(b"garbage\n" + beat(1, 1))  # counted, and the connection reads on
            await until(lambda: (1, 1) in [(w, getattr(m, "step", 0)) for w, m in seen.messages])
            with contextlib.suppress(anyio.BrokenResourceError):  # closed (reset) while it still sends
                await bad.send(b"x" * (MAX_LINE + 1))  # no newline: refused before the line ends
            assert await closed_by_peer(bad_reader)
            await until(lambda: (1, "connection closed") in seen.closed)
            await good.send(beat(2, 7))
            await until(lambda: (2, 7) in [(w, getattr(m, "step", 0)) for w, m in seen.messages])
            assert [w for w, _ in seen.closed] == [1]

    run(main)
    # Per host, the first at once and one summary of the rest, naming the last.
    [first, summary] = [r for r in seen.reports if r.kind == "malformed"]
    assert "garbage" in first.reason
    assert (summary.count, summary.reason) == (1, f"a line longer than {MAX_LINE} bytes; connection closed")


def test_too_many_malformed_lines_close_the_connection() -> None:
    seen = Seen()

    async def main() -> None:
        async with serving(stand_in_server(seen)) as peers:
            good, _ = await peers.connect()
            await good.send(encode(Hello(worker=2, pid=1, target_steps=5)))
            flood, flood_reader = await peers.connect()
            await flood.send(encode(Hello(worker=3, pid=1, target_steps=5)) + beat(3, 1))
            await flood.send(encode(Stop(reason="the wrong direction")) * (MAX_MALFORMED + 20))
            assert await closed_by_peer(flood_reader)
            await good.send(beat(2, 8))
            await until(lambda: (2, 8) in [(w, getattr(m, "step", 0)) for w, m in seen.messages])

    run(main)
    malformed = [r for r in seen.reports if r.kind == "malformed"]
    assert sum(r.count for r in malformed) == MAX_MALFORMED + 1  # then "connection closed"; the rest unread
    assert malformed[-1].reason == f"{MAX_MALFORMED} malformed lines; connection closed"
    assert [m.step for w, m in seen.messages if w == 3 and isinstance(m, Heartbeat)] == [1]
    assert seen.closed[0] == (3, "connection closed")  # then the good one's, as the server stops


def test_a_peer_without_the_secret_is_refused_and_nothing_it_sends_is_read() -> None:
    seen = Seen()
    server = stand_in_server(seen, auth_timeout_s=0.3)

    async def main() -> None:
        async with serving(server) as peers:
            # The wrong secret: the controller closes at the answer, before its own proof.
            with pytest.raises((anyio.IncompleteRead, anyio.EndOfStream, anyio.BrokenResourceError)):
                await peers.connect(secret="not it")
            # No handshake at all: a Hello where the answer belongs.
            stream, reader = await peers.raw()
            await stream.send(encode(Hello(worker=1, pid=1, target_steps=5)) + beat(1, 1))
            assert await closed_by_peer(reader)
            # Silent: closed at the handshake's deadline.
            _, idle_reader = await peers.raw()
            assert await closed_by_peer(idle_reader)
            # A handshake line longer than a handshake's.
            long, long_reader = await peers.raw()
            with contextlib.suppress(anyio.BrokenResourceError):
                await long.send(b"y" * (auth.MAX_LINE + 1))
            assert await closed_by_peer(long_reader)
            # Proved, but its Hello names a worker that is not ours: refused, and what follows is not read.
            stranger, stranger_reader = await peers.connect()
            await stranger.send(encode(Hello(worker=4242, pid=1, target_steps=5)) + beat(4242, 1))
            assert await closed_by_peer(stranger_reader)

    run(main)
    assert seen.messages == [] and seen.closed == []
    assert seen.hellos == 1  # only the proved connection's Hello reached the handler
    assert server.refused == 5
    refused = [r for r in seen.reports if r.kind == "refused"]
    assert sum(r.count for r in refused) == 5
    assert "wrong proof" in refused[0].reason
    assert "no worker 4242 here" in refused[-1].reason


def test_the_oldest_waiting_handshake_makes_room_and_a_worker_still_gets_in() -> None:
    seen = Seen()
    server = stand_in_server(seen, max_pending=4)

    async def main() -> None:
        async with serving(server) as peers:
            idle = [await anyio.connect_tcp("127.0.0.1", peers.port) for _ in range(6)]
            peers.streams += idle
            await until(lambda: server.refused == 2)  # the two oldest of six, a moment later
            stream, _ = await peers.connect()
            await stream.send(encode(Hello(worker=5, pid=1, target_steps=5)) + beat(5, 3))
            await until(lambda: len(seen.messages) == 1)
            for conn in idle:
                await conn.aclose()  # closed twice (again by ``serving``): anyio allows it

    run(main)
    reasons = [r.reason for r in seen.reports if r.kind == "refused"]
    assert reasons[0] == "over 4 connections waiting"
    # Two closed for room (the worker's answer came before its own handshake had to make room), four closed
    # before proving it.
    assert server.refused == 6


def test_a_send_reaches_the_worker_and_a_closed_connection_counts_as_gone() -> None:
    seen = Seen()
    server = stand_in_server(seen)

    async def main() -> None:
        async with serving(server) as peers:
            stream, reader = await peers.connect()
            await stream.send(encode(Hello(worker=1, pid=1, target_steps=5)) + beat(1, 1))
            await until(lambda: len(seen.messages) == 1)
            proc = seen.procs[1]
            await server.send(proc, Stop(reason="done"))
            assert decode_from_controller(await reader.receive_until(b"\n", MAX_LINE)) == Stop(reason="done")
            await stream.aclose()
            await until(lambda: len(seen.closed) == 1)
            await server.send(proc, Stop(reason="again"))  # the connection is gone: counted once, not raised

    run(main)
    assert [w for w, _ in seen.closed] == [1]


def test_no_task_per_connection() -> None:
    """Many connections, and the server's one task: the event loop reads them, nothing waits per connection."""
    seen = Seen()
    server = stand_in_server(seen)

    async def main() -> None:
        async with serving(server) as peers:
            streams = [(await peers.connect())[0] for _ in range(50)]
            for worker, stream in enumerate(streams):
                await stream.send(encode(Hello(worker=worker, pid=1, target_steps=5)) + beat(worker, 1))
            await until(lambda: len(seen.messages) == 50)
            tasks = asyncio.all_tasks()
            assert len(tasks) < 10, [t.get_coro() for t in tasks]
            for stream in streams:
                await stream.aclose()

    run(main)
