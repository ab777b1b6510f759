"""What a notice source needs from its host, and how it learns that an event it published was handled.

A source (the Pub/Sub listener, the metadata watcher) runs as a runtime component: ``run(ctx)`` in the
runtime's task group, with the runtime's :class:`~elastic_runtime.core.context.RuntimeContext` as ``ctx``. It only needs
the small part of it named by :class:`SourceContext`, which :class:`BusContext` also provides over a bare
:class:`~elastic_runtime.core.bus.EventBus` (for ``elastic-runtime listen``, which trains nothing).

A Pub/Sub message may be acknowledged only once its event was handled. The bus dispatches one event at a
time, to its handlers in priority order, so a handler subscribed at the lowest priority runs after every
other handler of that event: :class:`DispatchTracker` is that handler.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

import anyio

from elastic_runtime.core.bus import EventBus, Handler, Subscription
from elastic_runtime.core.events import Event, MalformedNotice, Notice, NoticeIgnored

__all__ = ["LAST", "BusContext", "DispatchTracker", "SourceContext"]

E = TypeVar("E", bound=Event)

# Below any priority a user would pick: the tracker must see an event after all its real handlers.
LAST = -(2**62)


class SourceContext(Protocol):
    """The part of the runtime context a notice source uses."""

    async def publish(self, event: Event) -> None: ...

    def subscribe(
        self, event_type: type[E], handler: Handler[E], *, priority: int = 0, timeout: float | str | None = "default"
    ) -> Subscription[E]: ...

    def unsubscribe(self, subscription: Subscription[Any]) -> None: ...


class BusContext:
    """A :class:`SourceContext` over a bare event bus (no training run around it)."""

    def __init__(self, bus: EventBus) -> None:
        self.bus = bus

    async def publish(self, event: Event) -> None:
        await self.bus.publish(event)

    def subscribe(
        self, event_type: type[E], handler: Handler[E], *, priority: int = 0, timeout: float | str | None = "default"
    ) -> Subscription[E]:
        return self.bus.subscribe(event_type, handler, priority=priority, timeout=timeout)

    def unsubscribe(self, subscription: Subscription[Any]) -> None:
        self.bus.unsubscribe(subscription)


class DispatchTracker:
    """Tells a source when the events it published have been through all their handlers."""

    def __init__(self) -> None:
        self._waiting: dict[int, tuple[Event, anyio.Event]] = {}
        self._subscriptions: list[Subscription[Any]] = []

    def attach(self, ctx: SourceContext) -> None:
        for event_type in (Notice, MalformedNotice, NoticeIgnored):
            self._subscriptions.append(ctx.subscribe(event_type, self._handled, priority=LAST, timeout=None))

    def detach(self, ctx: SourceContext) -> None:
        for subscription in self._subscriptions:
            ctx.unsubscribe(subscription)
        self._subscriptions.clear()

    async def publish_and_wait(self, ctx: SourceContext, event: Event) -> None:
        """Publish ``event`` and return once every handler subscribed to it has run (or failed)."""
        done = anyio.Event()
        # Keyed by identity: the bus hands handlers the very object published. The event is kept in the
        # entry so its id cannot be reused by another object while we wait.
        self._waiting[id(event)] = (event, done)
        try:
            await ctx.publish(event)
            await done.wait()
        finally:
            self._waiting.pop(id(event), None)

    async def _handled(self, event: Event, ctx: object) -> None:
        entry = self._waiting.get(id(event))
        if entry is not None and entry[0] is event:
            entry[1].set()
