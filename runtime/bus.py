"""The event bus: one bounded queue, one dispatcher, handlers called by event type in priority order.

Events are dispatched one at a time in publish order; each goes to every matching handler (a handler for a
base type sees its subclasses), highest priority first, ties in subscription order. A handler that raises
or runs past its timeout becomes a :class:`HandlerFailed` event; the bus keeps running. ``close()`` stops
new publishes and returns once every pending event has been dispatched, so shutdown loses none.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import anyio
import anyio.lowlevel
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from runtime.errors import BusClosed
from runtime.eventlog import EventLog
from runtime.events import Event, HandlerFailed

log = logging.getLogger(__name__)

E = TypeVar("E", bound=Event)
Handler = Callable[[E, Any], Awaitable[None]]

# Yield to other tasks at least this often while a burst of events is dispatched.
_DISPATCH_BATCH = 256


@dataclass(frozen=True)
class Subscription(Generic[E]):
    """One handler's interest in one event type."""

    event_type: type[E]
    handler: Handler[E]
    priority: int
    timeout: float | None
    name: str
    order: int = field(compare=False)


class EventBus:
    """Delivers events to subscribed handlers.

    Args:
        context: passed to every handler as its second argument (the runtime's ``RuntimeContext``).
        max_pending: queue bound; ``publish`` waits when it is full.
        handler_timeout: default limit in seconds for one handler call; ``None`` for no limit.
        log: where every dispatched event is appended, before its handlers run.
    """

    def __init__(
        self,
        context: Any = None,
        *,
        max_pending: int = 65536,
        handler_timeout: float | None = 30.0,
        log: EventLog | None = None,
    ) -> None:
        self.context = context
        self.handler_timeout = handler_timeout
        self.event_log = log
        self._subs: list[Subscription[Any]] = []
        self._by_type: dict[type[Event], list[Subscription[Any]]] = {}
        self._order = itertools.count()
        self._send: MemoryObjectSendStream[Event]
        self._receive: MemoryObjectReceiveStream[Event]
        self._send, self._receive = anyio.create_memory_object_stream[Event](max_pending)
        self._followups: deque[Event] = deque()
        self._closed = False
        self.dispatched = 0

    # --- subscriptions ---------------------------------------------------------------------------------

    def subscribe(
        self,
        event_type: type[E],
        handler: Handler[E],
        *,
        priority: int = 0,
        timeout: float | str | None = "default",
    ) -> Subscription[E]:
        """Call ``handler(event, context)`` for every event of ``event_type`` or a subclass of it.

        Higher ``priority`` runs first. ``timeout`` overrides the bus's ``handler_timeout``.
        """
        limit = self.handler_timeout if timeout == "default" else timeout
        if limit is not None and not isinstance(limit, int | float):
            raise TypeError(f"timeout must be a number of seconds or None, not {limit!r}")
        name = getattr(handler, "__qualname__", repr(handler))
        sub = Subscription(event_type, handler, priority, limit, name, next(self._order))
        self._subs.append(sub)
        self._by_type.clear()
        return sub

    def unsubscribe(self, sub: Subscription[Any]) -> None:
        self._subs.remove(sub)
        self._by_type.clear()

    def on(
        self, event_type: type[E], *, priority: int = 0, timeout: float | str | None = "default"
    ) -> Callable[[Handler[E]], Handler[E]]:
        """Decorator form of :meth:`subscribe`."""

        def register(handler: Handler[E]) -> Handler[E]:
            self.subscribe(event_type, handler, priority=priority, timeout=timeout)
            return handler

        return register

    def _handlers_for(self, event_type: type[Event]) -> list[Subscription[Any]]:
        subs = self._by_type.get(event_type)
        if subs is None:
            subs = sorted(
                (s for s in self._subs if issubclass(event_type, s.event_type)),
                key=lambda s: (-s.priority, s.order),
            )
            self._by_type[event_type] = subs
        return subs

    # --- publishing ------------------------------------------------------------------------------------

    async def publish(self, event: Event) -> None:
        """Queue ``event``; waits while the queue is full. Raises :class:`BusClosed` after ``close()``."""
        if self._closed:
            raise BusClosed(f"bus closed: cannot publish {type(event).__name__}")
        await self._send.send(event)

    def publish_nowait(self, event: Event) -> None:
        """Queue ``event`` without waiting. Raises ``anyio.WouldBlock`` when full, BusClosed when closed."""
        if self._closed:
            raise BusClosed(f"bus closed: cannot publish {type(event).__name__}")
        self._send.send_nowait(event)

    @property
    def pending(self) -> int:
        return self._send.statistics().current_buffer_used

    # --- dispatching -----------------------------------------------------------------------------------

    async def run(self) -> None:
        """Dispatch events until the bus is closed and its queue is empty."""
        with self._receive as receive:
            await self._dispatch_all(receive)

    async def _dispatch_all(self, receive: MemoryObjectReceiveStream[Event]) -> None:
        while True:
            try:
                event = receive.receive_nowait()
            except anyio.WouldBlock:
                try:
                    event = await receive.receive()
                except anyio.EndOfStream:
                    return
            except anyio.EndOfStream:
                return
            await self._dispatch(event)
            self.dispatched += 1
            if self.dispatched % _DISPATCH_BATCH == 0:
                await anyio.lowlevel.checkpoint()

    async def close(self) -> None:
        """Refuse new events; :meth:`run` returns once the pending ones are dispatched."""
        self._closed = True
        await self._send.aclose()

    async def _dispatch(self, event: Event) -> None:
        if self.event_log is not None:
            self.event_log.append(event)
        for sub in self._handlers_for(type(event)):
            await self._call(sub, event)
        while self._followups:
            await self._dispatch(self._followups.popleft())

    async def _call(self, sub: Subscription[Any], event: Event) -> None:
        timed_out = False
        try:
            if sub.timeout is None:
                await sub.handler(event, self.context)
                return
            with anyio.move_on_after(sub.timeout) as scope:
                await sub.handler(event, self.context)
            if not scope.cancelled_caught:
                return
            timed_out = True
            error_type, message = "TimeoutError", f"handler ran past its {sub.timeout} s timeout"
        except Exception as exc:  # a handler's failure becomes an event, never the bus's
            error_type, message = type(exc).__name__, str(exc)
        log.error("handler %s failed on %s: %s: %s", sub.name, type(event).__name__, error_type, message)
        if isinstance(event, HandlerFailed):
            return  # a failing HandlerFailed handler would otherwise loop forever
        failed = HandlerFailed(
            step=event.step,
            source="bus",
            handler=sub.name,
            event_type=type(event).__name__,
            timed_out=timed_out,
            error_type=error_type,
            message=message,
        )
        # Dispatched right after the event that caused it, bypassing the queue: the dispatcher must never
        # wait on its own queue, and a HandlerFailed raised during close() must not be lost.
        self._followups.append(failed)
