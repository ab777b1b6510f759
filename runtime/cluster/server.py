"""The controller's side of the wire: one connection per worker process, one JSON message a line.

A connection's first message must be the ``Hello`` of a worker the controller started; every later one is
checked against that worker's id. Malformed lines are reported (and the connection closed after too many);
nothing a peer sends can raise out of here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable

import anyio
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from runtime.cluster.processes import WorkerProcess
from runtime.cluster.protocol import MAX_LINE, MalformedMessage, Message, decode_from_worker, encode

__all__ = ["MAX_MALFORMED", "WorkerServer"]

MAX_MALFORMED = 100  # malformed lines one connection may send before it is closed


class WorkerServer:
    """Reads each worker's connection and hands its messages on.

    Args:
        on_hello: called with a connection's first message; returns the worker it belongs to, or None to close.
        on_message: called with each later message of a worker.
        on_malformed: called with the peer and the reason for every refused line or connection.
        on_closed: called when a worker's connection ends (it is then treated as gone).
    """

    def __init__(
        self,
        *,
        on_hello: Callable[[Message, SocketStream, str], Awaitable[WorkerProcess | None]],
        on_message: Callable[[WorkerProcess, Message], Awaitable[None]],
        on_malformed: Callable[[str, str], Awaitable[None]],
        on_closed: Callable[[WorkerProcess, str], None],
    ) -> None:
        self.on_hello = on_hello
        self.on_message = on_message
        self.on_malformed = on_malformed
        self.on_closed = on_closed

    async def serve(self, stream: SocketStream) -> None:
        """Serve one connection until it closes."""
        peer = "unknown"
        with contextlib.suppress(Exception):
            peer = "%s:%s" % stream.extra(anyio.abc.SocketAttribute.remote_address)  # noqa: UP031
        reader = BufferedByteReceiveStream(stream)
        proc: WorkerProcess | None = None
        bad = 0
        try:
            while True:
                try:
                    line = await reader.receive_until(b"\n", MAX_LINE)
                except anyio.DelimiterNotFound:
                    await self.on_malformed(peer, f"a line longer than {MAX_LINE} bytes; connection closed")
                    return
                try:
                    message = decode_from_worker(line)
                except MalformedMessage as exc:
                    bad += 1
                    await self.on_malformed(peer, str(exc))
                    if bad >= MAX_MALFORMED:
                        await self.on_malformed(peer, f"{MAX_MALFORMED} malformed lines; connection closed")
                        return
                    continue
                if proc is None:
                    proc = await self.on_hello(message, stream, peer)
                    if proc is None:
                        return
                    continue
                if getattr(message, "worker", proc.worker) != proc.worker:
                    await self.on_malformed(peer, f"worker {proc.worker}'s connection sent {message!r}; ignored")
                    continue
                await self.on_message(proc, message)
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, OSError):
            pass
        finally:
            if proc is not None:
                self.on_closed(proc, "connection closed")
            await stream.aclose()

    async def send(self, proc: WorkerProcess, message: Message) -> None:
        """Send ``message`` to ``proc``; a failed send counts as the connection closing."""
        if proc.stream is None:
            return
        try:
            await proc.stream.send(encode(message))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            self.on_closed(proc, f"send failed: {exc}")
