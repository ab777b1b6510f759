"""One connection on the controller's port: an asyncio protocol that proves its peer and frames what it sends.

The event loop calls it when bytes arrive; nothing here is awaited and no task waits per connection. Each call
reads whatever whole lines arrived: until the peer has proved the run's secret (:mod:`elastic_runtime.cluster.auth`) the
only line read is its answer to the challenge; after that each line is decoded as a worker's message and handed
to the connection's :class:`Owner` (the server), which runs the handlers. A malformed line is counted; an
oversized one, or too many malformed ones, close the connection (only this one) with a report saying why.
"""

from __future__ import annotations

import asyncio
from typing import Literal, Protocol

from elastic_runtime.cluster import auth
from elastic_runtime.cluster.lines import LineBuffer, LineTooLong
from elastic_runtime.cluster.protocol import MAX_LINE, MalformedMessage, Message, decode_from_worker
from elastic_runtime.core.errors import AuthenticationFailed

__all__ = ["MAX_BACKLOG", "MAX_MALFORMED", "Connection", "Kind", "Owner"]

MAX_MALFORMED = 100  # malformed lines one connection may send before it is closed
MAX_BACKLOG = 4 * MAX_LINE  # bytes the controller holds for a peer that does not read before it closes it

Kind = Literal["refused", "malformed"]


class Owner(Protocol):
    """What a connection tells its server, each call made by the event loop (none awaited)."""

    secret: str
    auth_timeout_s: float

    def waiting(self, conn: Connection) -> None:
        """``conn`` is open and must now prove the secret."""

    def proved(self, conn: Connection) -> None:
        """``conn`` proved the secret: what it sends from now on are messages."""

    def received(self, conn: Connection, message: Message) -> None:
        """A message from ``conn``, in the order sent."""

    def note(self, kind: Kind, peer: str, reason: str) -> None:
        """A refused connection, or a malformed line, from host ``peer``."""

    def lost(self, conn: Connection) -> None:
        """``conn`` is closed (by either side); nothing more comes from it."""


class Connection(asyncio.Protocol):
    """One peer's connection: its handshake, its lines, and the worker it turned out to be (``proc``).

    Args:
        owner: the server it reports to.
    """

    def __init__(self, owner: Owner) -> None:
        self.owner = owner
        self.host = "unknown"
        self.is_proved = False
        self.turned_away = False  # its Hello was refused: nothing it sent after that is handed on
        self.ended = False  # closed by either side
        self.lost_noted = False  # the server told its worker's handlers that it closed
        self._transport: asyncio.Transport | None = None
        self._lines = LineBuffer(auth.MAX_LINE)
        self._challenge = auth.challenge()
        self._deadline: asyncio.TimerHandle | None = None
        self._malformed = 0

    # --- called by the event loop --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        peer = transport.get_extra_info("peername")
        if peer:
            self.host = str(peer[0])
        self.owner.waiting(self)
        if self.ended:  # closed at once: the run is over
            return
        timeout = self.owner.auth_timeout_s
        self._deadline = asyncio.get_running_loop().call_later(timeout, self._expire)
        transport.write(auth.encode(self._challenge))

    def data_received(self, data: bytes) -> None:
        if self.ended:
            return
        self._lines.feed(data)
        try:
            while not self.ended and (line := self._lines.next_line()) is not None:
                if self.is_proved:
                    self._take(line)
                else:
                    self._prove(line)
        except LineTooLong as exc:
            if self.is_proved:
                self.close("malformed", f"{exc}; connection closed")
            else:
                self.close("refused", f"a handshake line longer than {auth.MAX_LINE} bytes")

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ended:
            self.ended = True
            if not self.is_proved:
                self.owner.note("refused", self.host, "closed before proving the secret")
        if self._deadline is not None:
            self._deadline.cancel()
        self.owner.lost(self)

    # --- called by the server ------------------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        """Queue ``data`` for the peer; it is written as the peer reads (never awaited).

        Raises:
            ConnectionError: the connection is closed, or the peer left more than :data:`MAX_BACKLOG` bytes
                unread (the connection is then closed).
        """
        if self.ended or self._transport is None or self._transport.is_closing():
            raise ConnectionError("connection closed")
        self._transport.write(data)
        waiting = self._transport.get_write_buffer_size()
        if waiting > MAX_BACKLOG:
            self.close()
            raise ConnectionError(f"the peer left {waiting} bytes unread; connection closed")

    def close(self, kind: Kind | None = None, reason: str = "") -> None:
        """Close from our side; with a ``kind``, note ``reason`` as one refusal (or malformed line)."""
        if self.ended:
            return
        self.ended = True
        if self._deadline is not None:
            self._deadline.cancel()
        if kind is not None:
            self.owner.note(kind, self.host, reason)
        if self._transport is not None:
            self._transport.close()

    def pause(self) -> None:
        """Read nothing more until :meth:`resume` (the server's queue is full)."""
        if self._transport is not None:
            self._transport.pause_reading()

    def resume(self) -> None:
        """Read again."""
        if self._transport is not None:
            self._transport.resume_reading()

    # --- the two kinds of line -----------------------------------------------------------------------------

    def _prove(self, line: bytes) -> None:
        assert self._transport is not None
        try:
            welcome = auth.welcome(self.owner.secret, self._challenge, line)
        except AuthenticationFailed as exc:
            self.close("refused", str(exc))
            return
        self._transport.write(auth.encode(welcome))
        self.is_proved = True
        self._lines.max_line = MAX_LINE
        if self._deadline is not None:
            self._deadline.cancel()
        self.owner.proved(self)

    def _take(self, line: bytes) -> None:
        try:
            message = decode_from_worker(line)
        except MalformedMessage as exc:
            self._malformed += 1
            self.owner.note("malformed", self.host, str(exc))
            if self._malformed >= MAX_MALFORMED:
                self.close("malformed", f"{MAX_MALFORMED} malformed lines; connection closed")
            return
        self.owner.received(self, message)

    def _expire(self) -> None:
        self.close("refused", f"did not prove the secret within {self.owner.auth_timeout_s} s")
