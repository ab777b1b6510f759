"""The controller's side of the wire: one connection per worker process, one JSON message a line.

Every connection first proves the run's secret (:mod:`runtime.cluster.auth`) within ``auth_timeout_s``;
until it has, nothing it sends is read as a message. At most ``max_pending`` connections may be proving it
at once: a new one beyond that closes the oldest waiting one, so idle connections cannot keep a real worker
(whose proof takes milliseconds) out. An authenticated connection's first message must be the ``Hello`` of
a worker the controller started; every later one is checked against that worker's id.

Refused connections and malformed lines are reported through :class:`ReportLimiter`: per host, the first
at once and then one summary per interval, so no peer can grow the event log faster than that. Nothing a
peer sends can raise out of here.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

import anyio
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from runtime.cluster import auth
from runtime.cluster.controller.processes import WorkerProcess
from runtime.cluster.protocol import MAX_LINE, MalformedMessage, Message, decode_from_worker, encode
from runtime.core.errors import AuthenticationFailed

__all__ = ["MAX_MALFORMED", "Report", "ReportLimiter", "WorkerServer"]

MAX_MALFORMED = 100  # malformed lines one connection may send before it is closed

Kind = Literal["refused", "malformed"]


@dataclass(frozen=True)
class Report:
    """``count`` refusals (or malformed lines) of one ``kind`` from host ``peer``; ``reason``: the last one's."""

    kind: Kind
    peer: str
    reason: str
    count: int


@dataclass
class _Tally:
    since: float
    count: int = 0
    reason: str = ""


class ReportLimiter:
    """At most two reports per kind, host and interval: the first occurrence at once, then one that counts the rest.

    Args:
        interval_s: the span one summary covers.
        max_sources: distinct hosts tallied at once; any more share one tally (a peer on loopback can send
            from any of 2**24 addresses).
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(
        self, interval_s: float = 10.0, max_sources: int = 64, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval_s = interval_s
        self.max_sources = max_sources
        self.clock = clock
        self._open: dict[tuple[Kind, str], _Tally] = {}

    def note(self, kind: Kind, peer: str, reason: str) -> Report | None:
        """One occurrence; the report to make now, or None when it is counted for the next summary."""
        key = (kind, peer)
        if key not in self._open and len(self._open) >= self.max_sources:
            key = (kind, "other hosts")
        tally = self._open.get(key)
        if tally is None:
            self._open[key] = _Tally(since=self.clock())
            return Report(kind, key[1], reason, 1)
        tally.count += 1
        tally.reason = reason
        return None

    def due(self, final: bool = False) -> list[Report]:
        """Summaries of the intervals that ended (every one when ``final``); their hosts start afresh."""
        now = self.clock()
        reports = []
        for key, tally in list(self._open.items()):
            if final or now - tally.since >= self.interval_s:
                del self._open[key]
                if tally.count:
                    reports.append(Report(key[0], key[1], tally.reason, tally.count))
        return reports


class WorkerServer:
    """Authenticates each connection, reads it and hands its messages on.

    Args:
        secret: what every connection must prove (HMAC) before its first message.
        on_hello: called with an authenticated connection's first message; returns the worker it belongs to,
            or why it is refused (the connection is then closed).
        on_message: called with each later message of a worker.
        on_report: called with each (rate-limited) report of refused connections or malformed lines.
        on_closed: called when a worker's connection ends (it is then treated as gone).
        auth_timeout_s: how long a connection may take to prove the secret.
        max_pending: connections proving it at once.
    """

    def __init__(
        self,
        *,
        secret: str,
        on_hello: Callable[[Message, SocketStream, str], Awaitable[WorkerProcess | str]],
        on_message: Callable[[WorkerProcess, Message], Awaitable[None]],
        on_report: Callable[[Report], Awaitable[None]],
        on_closed: Callable[[WorkerProcess, str], None],
        auth_timeout_s: float = 5.0,
        max_pending: int = 32,
    ) -> None:
        self.secret = secret
        self.on_hello = on_hello
        self.on_message = on_message
        self.on_report = on_report
        self.on_closed = on_closed
        self.auth_timeout_s = auth_timeout_s
        self.max_pending = max_pending
        self.limiter = ReportLimiter()
        self.refused = 0  # connections refused, all told
        self._pending: dict[anyio.CancelScope, str] = {}  # handshakes in progress, oldest first -> peer
        # One send at a time on each connection: the lease renewal and the group forming both send, and an
        # anyio stream refuses a second send while one waits for room (BusyResourceError).
        self._send_locks: dict[int, anyio.Lock] = {}

    async def note(self, kind: Kind, peer: str, reason: str) -> None:
        """Count a refused connection or a malformed line; report it if it is the first in its interval."""
        self.refused += kind == "refused"
        report = self.limiter.note(kind, peer, reason)
        if report is not None:
            await self.on_report(report)

    async def report_due(self, interval_s: float = 1.0) -> None:
        """Report the summaries whose interval ended, forever (run it in the controller's task group)."""
        while True:
            await anyio.sleep(interval_s)
            await self.flush(final=False)

    async def flush(self, final: bool = True) -> None:
        """Report every summary still counting (at the end of the run, after :meth:`serve` was cancelled: the
        connections it left half-way through the handshake count as refused)."""
        if final:
            for host in self._pending.values():
                await self.note("refused", host, "the run ended before it proved the secret")
            self._pending.clear()
        for report in self.limiter.due(final):
            await self.on_report(report)

    async def serve(self, stream: SocketStream) -> None:
        """Serve one connection until it closes."""
        host = "unknown"
        with contextlib.suppress(Exception):
            host = str(stream.extra(anyio.abc.SocketAttribute.remote_address)[0])
        reader = BufferedByteReceiveStream(stream)
        proc: WorkerProcess | None = None
        try:
            if not await self._authenticate(stream, reader, host):
                return
            bad = 0
            while True:
                try:
                    line = await reader.receive_until(b"\n", MAX_LINE)
                except anyio.DelimiterNotFound:
                    await self.note("malformed", host, f"a line longer than {MAX_LINE} bytes; connection closed")
                    return
                try:
                    message = decode_from_worker(line)
                except MalformedMessage as exc:
                    bad += 1
                    await self.note("malformed", host, str(exc))
                    if bad >= MAX_MALFORMED:
                        await self.note("malformed", host, f"{MAX_MALFORMED} malformed lines; connection closed")
                        return
                    continue
                if proc is None:
                    outcome = await self.on_hello(message, stream, host)
                    if isinstance(outcome, str):
                        await self.note("refused", host, outcome)
                        return
                    proc = outcome
                    continue
                if getattr(message, "worker", proc.worker) != proc.worker:
                    await self.note("malformed", host, f"worker {proc.worker}'s connection sent {message!r}; ignored")
                    continue
                await self.on_message(proc, message)
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, OSError):
            pass
        finally:
            if proc is not None:
                self.on_closed(proc, "connection closed")
            with anyio.CancelScope(shield=True):
                await stream.aclose()

    async def _authenticate(self, stream: SocketStream, reader: BufferedByteReceiveStream, host: str) -> bool:
        """Run the handshake under its deadline; False (the refusal noted) if the peer did not prove the secret."""
        if len(self._pending) >= self.max_pending:
            # Close the oldest waiting connection, not this one: a worker's proof takes milliseconds, so only
            # idle connections are ever the oldest, and they cannot keep a real worker out.
            oldest = next(iter(self._pending))
            oldest.cancel()
            await self.note("refused", self._pending.pop(oldest), f"over {self.max_pending} connections waiting")
        handshake = anyio.CancelScope(deadline=anyio.current_time() + self.auth_timeout_s)
        self._pending[handshake] = host
        reason = ""
        try:
            with handshake:
                sent = auth.challenge()
                await stream.send(auth.encode(sent))
                line = await reader.receive_until(b"\n", auth.MAX_LINE)
                await stream.send(auth.encode(auth.welcome(self.secret, sent, line)))
        except AuthenticationFailed as exc:
            reason = str(exc)
        except anyio.DelimiterNotFound:
            reason = f"a handshake line longer than {auth.MAX_LINE} bytes"
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, OSError):
            reason = "closed before proving the secret"
        waiting = self._pending.pop(handshake, None) is not None
        if handshake.cancelled_caught:
            if not waiting:
                return False  # closed to make room; counted then
            reason = f"did not prove the secret within {self.auth_timeout_s} s"
        if reason:
            await self.note("refused", host, reason)
            return False
        return True

    async def send(self, proc: WorkerProcess, message: Message) -> None:
        """Send ``message`` to ``proc``; a failed send counts as the connection closing."""
        if proc.stream is None:
            return
        lock = self._send_locks.setdefault(id(proc.stream), anyio.Lock())
        try:
            async with lock:
                if proc.stream is None:
                    return
                await proc.stream.send(encode(message))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            self.on_closed(proc, f"send failed: {exc}")
