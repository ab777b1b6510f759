"""The controller's side of the wire: one connection per worker process, one JSON message a line.

Every connection first proves the run's secret (:mod:`elastic_runtime.cluster.auth`) within ``auth_timeout_s``;
until it has, nothing it sends is read as a message. At most ``max_pending`` connections may be proving it
at once: a new one beyond that closes the oldest waiting one, so idle connections cannot keep a real worker
(whose proof takes milliseconds) out. An authenticated connection's first message must be the ``Hello`` of
a worker the controller started; every later one is checked against that worker's id.

The connections are asyncio protocols (:mod:`elastic_runtime.cluster.controller.connection`): the event loop hands
them what arrived, and they decode it where it lands. Their messages wait in one queue, in the order they
came, for the one task that runs the handlers (:meth:`WorkerServer.serve`): a heartbeat costs no task of its
own, no wake-up and no pause or resume of its connection's reading. The handlers therefore must not wait
long (a durable commit runs apart, see the shell): while one waits, every worker's messages wait.

Refused connections and malformed lines are reported through :class:`ReportLimiter`: per host, the first
at once and then one summary per interval, so no peer can grow the event log faster than that. Nothing a
peer sends can raise out of here.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
import anyio.lowlevel

from elastic_runtime.cluster.controller.connection import MAX_MALFORMED, Connection, Kind
from elastic_runtime.cluster.controller.processes import WorkerProcess
from elastic_runtime.cluster.protocol import Message, encode

__all__ = ["MAX_MALFORMED", "Report", "ReportLimiter", "WorkerServer"]

# Over ``max_pending`` waiting, the oldest are closed this much later: the event loop accepts a burst of
# connections in one go, and a worker among the first of a burst has not had its turn to answer yet when the
# rest arrive (its proof takes milliseconds once it has).
_ROOM_AFTER_S = 0.2

# Sends between two turns of the event loop: a send never waits, so a Form or a lease for each of thousands of
# workers would otherwise hold the loop (and the reading of every heartbeat) for the whole round.
_SENDS_A_TURN = 256

# Messages waiting for the handlers beyond which the connections that send more stop being read until the
# handlers caught up (some 16 heartbeat intervals of 1,024 workers; never reached at a steady state).
_QUEUE_HIGH = 16_384


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
        on_hello: Callable[[Message, Connection, str], Awaitable[WorkerProcess | str]],
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
        self.port = 0
        self._listener: asyncio.Server | None = None
        self._open: set[Connection] = set()
        self._pending: dict[Connection, None] = {}  # handshakes in progress, oldest first
        self._room: asyncio.TimerHandle | None = None  # closes the oldest of them, when there are too many
        # What the handlers have still to see, in the order it came: a message, or None for a connection's end.
        self._queue: deque[tuple[Connection, Message | None]] = deque()
        self._reports: deque[Report] = deque()
        self._paused: list[Connection] = []
        self._wake: anyio.Event | None = None  # set when the queue gets something; None while serve() is busy
        self._over = False  # serve() ended: the run is over
        self._worker_of: dict[Connection, WorkerProcess] = {}  # the worker each connection's Hello was taken for
        self._sends = 0

    async def listen(self, host: str, port: int) -> WorkerServer:
        """Accept connections on ``host:port`` (port 0: any free one, then in ``port``); returns itself, the
        listener that :meth:`aclose` closes."""
        loop = asyncio.get_running_loop()
        # Everyone may connect at once: the kernel keeps as many waiting as it allows (as anyio's listener did).
        self._listener = await loop.create_server(lambda: Connection(self), host or None, port, backlog=65536)
        self.port = int(self._listener.sockets[0].getsockname()[1])
        return self

    async def aclose(self) -> None:
        """Accept no more connections (those open stay so)."""
        if self._listener is not None:
            self._listener.close()

    # --- what the connections tell it (called by the event loop) -------------------------------------------

    def waiting(self, conn: Connection) -> None:
        """A new connection: it proves the secret next, unless the run is over."""
        self._open.add(conn)
        if self._over:
            self._end_handshake(conn, "the run ended before it proved the secret")
            return
        self._pending[conn] = None
        if len(self._pending) > self.max_pending and self._room is None:
            self._room = asyncio.get_running_loop().call_later(_ROOM_AFTER_S, self._make_room)

    def proved(self, conn: Connection) -> None:
        """``conn`` proved the secret."""
        self._pending.pop(conn, None)

    def received(self, conn: Connection, message: Message) -> None:
        """A message for the handlers, queued behind those that came before it."""
        self._queue.append((conn, message))
        if len(self._queue) > _QUEUE_HIGH and conn not in self._paused:
            conn.pause()
            self._paused.append(conn)
        self._wake_up()

    def lost(self, conn: Connection) -> None:
        """``conn`` closed; its worker's handlers hear of it after its last message (which may be its Hello)."""
        self._open.discard(conn)
        self._pending.pop(conn, None)
        if conn.is_proved:
            self._queue.append((conn, None))
            self._wake_up()

    def note(self, kind: Kind, peer: str, reason: str) -> None:
        """Count a refused connection or a malformed line; report it if it is the first in its interval."""
        self.refused += kind == "refused"
        report = self.limiter.note(kind, peer, reason)
        if report is not None:
            self._reports.append(report)
            self._wake_up()

    # --- the handlers' task --------------------------------------------------------------------------------

    async def serve(self) -> None:
        """Run the handlers on what the connections received, in order, until cancelled (run it in the
        controller's task group); then close every connection."""
        try:
            while True:
                if self._reports:
                    await self.on_report(self._reports.popleft())
                elif self._queue:
                    conn, message = self._queue.popleft()
                    await self._dispatch(conn, message)
                else:
                    for conn in self._paused:
                        conn.resume()
                    self._paused.clear()
                    self._wake = anyio.Event()
                    await self._wake.wait()
                    self._wake = None
        finally:
            self._over = True
            self._wake = None
            if self._room is not None:
                self._room.cancel()
            await self.aclose()
            for conn in list(self._open):
                if conn.is_proved:
                    conn.close()
                    self._closed(conn, "connection closed")
                else:
                    self._end_handshake(conn, "the run ended before it proved the secret")

    async def _dispatch(self, conn: Connection, message: Message | None) -> None:
        if message is None:
            self._closed(conn, "connection closed")
            return
        if conn.turned_away:
            return  # what it sent after the Hello that was refused
        proc = self._worker_of.get(conn)
        if proc is None:
            outcome = await self.on_hello(message, conn, conn.host)
            if isinstance(outcome, str):
                conn.turned_away = True
                conn.close("refused", outcome)
            else:
                self._worker_of[conn] = outcome
            return
        if getattr(message, "worker", proc.worker) != proc.worker:
            self.note("malformed", conn.host, f"worker {proc.worker}'s connection sent {message!r}; ignored")
            return
        await self.on_message(proc, message)

    def _wake_up(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _make_room(self) -> None:
        """Close the oldest waiting connections, not the newest: a worker's proof takes milliseconds, so only
        idle connections are ever the oldest, and they cannot keep a real worker out."""
        self._room = None
        while len(self._pending) > self.max_pending:
            self._end_handshake(next(iter(self._pending)), f"over {self.max_pending} connections waiting")

    def _end_handshake(self, conn: Connection, reason: str) -> None:
        self._pending.pop(conn, None)
        conn.close("refused", reason)

    def _closed(self, conn: Connection, reason: str) -> None:
        """Tell the handlers once that ``conn``'s worker is gone."""
        proc = self._worker_of.get(conn)
        if proc is not None and not conn.lost_noted:
            conn.lost_noted = True
            self.on_closed(proc, reason)

    async def report_due(self, interval_s: float = 1.0) -> None:
        """Report the summaries whose interval ended, forever (run it in the controller's task group)."""
        while True:
            await anyio.sleep(interval_s)
            await self.flush(final=False)

    async def flush(self, final: bool = True) -> None:
        """Report every summary still counting (at the end of the run, after :meth:`serve` was cancelled: the
        connections it left half-way through the handshake count as refused)."""
        if final:
            for conn in list(self._pending):
                self._end_handshake(conn, "the run ended before it proved the secret")
        while self._reports:
            await self.on_report(self._reports.popleft())
        for report in self.limiter.due(final):
            await self.on_report(report)

    async def send(self, proc: WorkerProcess, message: Message) -> None:
        """Send ``message`` to ``proc``; a failed send counts as the connection closing. Never waits for the
        peer: what it has not read yet waits in its connection, up to a bound."""
        conn = proc.stream
        if conn is None:
            return
        try:
            conn.send(encode(message))
        except ConnectionError as exc:
            self._closed(conn, f"send failed: {exc}")
        self._sends += 1
        if self._sends % _SENDS_A_TURN == 0:
            await anyio.lowlevel.checkpoint()
