"""The event bus: one bounded queue, one dispatcher, handlers called by event type in priority order.

Events are dispatched one at a time in publish order; each goes to every matching handler (a handler for a
base type sees its subclasses), highest priority first, ties in subscription order. A handler that raises
or runs past its timeout becomes a :class:`HandlerFailed` event; the bus keeps running. ``close()`` stops
new publishes and returns once every pending event has been dispatched, so shutdown loses none.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import anyio
import anyio.lowlevel
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from elastic_runtime.core.errors import BusClosed
from elastic_runtime.core.eventlog import EventLog
from elastic_runtime.core.events import Event, HandlerFailed

log = logging.getLogger(__name__)

E = TypeVar("E", bound=Event)
Handler = Callable[[E, Any], Awaitable[None]]

# Yield to other tasks at least this often while a burst of events is dispatched.
_DISPATCH_BATCH = 256
# How often the watchdog looks for a handler past its timeout: timeouts are enforced to within this.
_WATCHDOG_TICK_S = 0.02


@dataclass(frozen=True)
class Subscription(Generic[E]):
    """One handler's interest in one event type."""

    event_type: type[E]
    handler: Handler[E]
    priority: int
    timeout: float | None
    name: str
    order: int = field(compare=False)
    # Run in the lead process only (``ctx.lead``): once per event however many processes a group has. In one
    # process every handler runs once anyway.
    once: bool = False


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
        self._work: deque[tuple[Subscription[Any], Event]] = deque()  # handler calls of the current event
        self._running: tuple[Subscription[Any], Event, float] | None = None  # with its deadline
        self._timed_out: tuple[Subscription[Any], Event] | None = None
        self._scope: anyio.CancelScope | None = None
        self._closed = False
        self._idle: anyio.Event | None = None  # set when the dispatcher runs out of work (``join`` waits on it)
        self.dispatched = 0

    # --- subscriptions ---------------------------------------------------------------------------------

    def subscribe(
        self,
        event_type: type[E],
        handler: Handler[E],
        *,
        priority: int = 0,
        timeout: float | str | None = "default",
        once: bool = False,
    ) -> Subscription[E]:
        """Call ``handler(event, context)`` for every event of ``event_type`` or a subclass of it.

        Higher ``priority`` runs first. ``timeout`` overrides the bus's ``handler_timeout``. ``once``: in a
        multi-process group, run in the lead process only (once per event) rather than in every process.
        """
        limit = self.handler_timeout if timeout == "default" else timeout
        if limit is not None and not isinstance(limit, int | float):
            raise TypeError(f"timeout must be a number of seconds or None, not {limit!r}")
        name = getattr(handler, "__qualname__", repr(handler))
        sub = Subscription(event_type, handler, priority, limit, name, next(self._order), once)
        self._subs.append(sub)
        self._by_type.clear()
        return sub

    @property
    def subscriptions(self) -> tuple[Subscription[Any], ...]:
        """Every subscription, in subscription order."""
        return tuple(self._subs)

    def unsubscribe(self, sub: Subscription[Any]) -> None:
        self._subs.remove(sub)
        self._by_type.clear()

    def on(
        self, event_type: type[E], *, priority: int = 0, timeout: float | str | None = "default", once: bool = False
    ) -> Callable[[Handler[E]], Handler[E]]:
        """Decorator form of :meth:`subscribe`."""

        def register(handler: Handler[E]) -> Handler[E]:
            self.subscribe(event_type, handler, priority=priority, timeout=timeout, once=once)
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
        """Queue ``event``; waits only while the queue is full. Raises :class:`BusClosed` after ``close()``."""
        if self._closed:
            raise BusClosed(f"bus closed: cannot publish {type(event).__name__}")
        try:
            self._send.send_nowait(event)  # the common case costs no trip through the event loop
        except anyio.WouldBlock:
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
    #
    # Handler timeouts: a cancel scope per handler call costs more than the rest of a dispatch together, so
    # the dispatcher runs under one scope and a watchdog cancels that scope when the running handler is past
    # its deadline; the dispatcher then records the timeout and carries on under a fresh scope. The watchdog
    # is the bus's own task because it must live and die with the dispatcher.

    async def run(self) -> None:
        """Dispatch events until the bus is closed and its queue is empty."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watchdog)
            with self._receive as receive:
                while True:
                    with anyio.CancelScope() as scope:
                        self._scope = scope
                        if await self._dispatch_all(receive):
                            break
                    if self._timed_out is not None:
                        sub, event = self._timed_out
                        self._timed_out = None
                        message = f"handler ran past its {sub.timeout} s timeout"
                        self._failed(sub, event, "TimeoutError", message, timed_out=True)
            tg.cancel_scope.cancel()

    async def _watchdog(self) -> None:
        while True:
            await anyio.sleep(_WATCHDOG_TICK_S)
            running = self._running
            if running is not None and running[2] < anyio.current_time() and self._scope is not None:
                self._timed_out = (running[0], running[1])
                self._scope.cancel()

    async def _dispatch_all(self, receive: MemoryObjectReceiveStream[Event]) -> bool:
        """Dispatch until the stream ends (returns True) or the watchdog cancels a handler."""
        work = self._work
        while True:
            if work:
                sub, event = work.popleft()
                await self._call(sub, event)
                continue
            try:
                event = receive.receive_nowait()
            except anyio.WouldBlock:
                if self.event_log is not None:
                    self.event_log.flush()  # idle: what was dispatched reaches the file now
                if self._idle is not None:
                    self._idle.set()
                try:
                    event = await receive.receive()
                except anyio.EndOfStream:
                    return True
            except anyio.EndOfStream:
                return True
            self._take(event)
            self.dispatched += 1
            if self.dispatched % _DISPATCH_BATCH == 0:
                await anyio.lowlevel.checkpoint()

    async def join(self) -> None:
        """Wait until every event published so far, and any it led to, has been dispatched."""
        while self.pending or self._work or self._running is not None:
            self._idle = anyio.Event()
            await self._idle.wait()

    async def close(self) -> None:
        """Refuse new events; :meth:`run` returns once the pending ones are dispatched."""
        self._closed = True
        await self._send.aclose()

    def _take(self, event: Event) -> None:
        """Log ``event`` and line up its handlers, in priority order."""
        if self.event_log is not None:
            self.event_log.append(event)
        self._work.extend((sub, event) for sub in self._handlers_for(type(event)))

    async def _call(self, sub: Subscription[Any], event: Event) -> None:
        deadline = math.inf if sub.timeout is None else anyio.current_time() + sub.timeout
        self._running = (sub, event, deadline)
        try:
            await sub.handler(event, self.context)
        except Exception as exc:  # a handler's failure becomes an event, never the bus's
            self._failed(sub, event, type(exc).__name__, str(exc))
        finally:
            self._running = None

    def _failed(
        self, sub: Subscription[Any], event: Event, error_type: str, message: str, *, timed_out: bool = False
    ) -> None:
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
        self._take(failed)
