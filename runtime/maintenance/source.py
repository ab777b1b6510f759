"""What a notice source needs from its host, and how it learns that an event it published was handled.

A source (the Pub/Sub listener, the metadata watcher) runs as a runtime component: ``run(ctx)`` in the
runtime's task group, with the runtime's :class:`~elastic_runtime.core.context.RuntimeContext` as ``ctx``. It only needs
the small part of it named by :class:`SourceContext`, which :class:`BusContext` also provides over a bare
:class:`~elastic_runtime.core.bus.EventBus` (for ``elastic-runtime listen``, which trains nothing).

A Pub/Sub message may be acknowledged only once its event was handled. The bus dispatches one event at a
time, to its handlers in priority order, so a handler subscribed at the lowest priority runs after every
other handler of that event: :class:`DispatchTracker` is that handler.

Whether a source works is recorded too (:class:`SourceStatus`): ``NoticeSourceReady`` when it first reads its
subscription or server, ``NoticeSourceFailed`` at once when it cannot (its error converted to
:class:`NoticeSourceUnavailable` at the adapter), so that the event log says whether the run was protected. With
``require_maintenance_notices``, :func:`require_working` turns a source that does not work at start into a
``ConfigError`` instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, TypeVar

import anyio

from elastic_runtime.core.bus import EventBus, Handler, Subscription
from elastic_runtime.core.errors import ConfigError, ElasticRuntimeError
from elastic_runtime.core.events import (
    Event,
    MalformedNotice,
    Notice,
    NoticeIgnored,
    NoticeSourceFailed,
    NoticeSourceReady,
)

__all__ = [
    "LAST",
    "BusContext",
    "DispatchTracker",
    "NoticeSource",
    "NoticeSourceUnavailable",
    "SourceContext",
    "SourceStatus",
    "require_working",
]

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


class NoticeSourceUnavailable(ElasticRuntimeError):
    """A notice source cannot read its subscription or server: no credentials, a subscription that does not exist,
    permission denied, or nothing answering. ``permanent``: the error does not go away by itself."""

    def __init__(self, message: str, *, address: str, reason: str, permanent: bool, error_type: str = "") -> None:
        super().__init__(message)
        self.address = address
        self.reason = reason
        self.permanent = permanent
        self.error_type = error_type


class NoticeSource(Protocol):
    """A notice source: a runtime component that can also say at once whether it works."""

    async def run(self, ctx: Any) -> None: ...

    async def check(self) -> None:
        """Raises NoticeSourceUnavailable unless the source can read its subscription or server now."""
        ...


class SourceStatus:
    """Publishes whether a source works: ``NoticeSourceReady`` when it first works and again after a failure,
    ``NoticeSourceFailed`` once a failure (again when its kind changes), not at every retry.

    Args:
        source: the sources' name in the events (``pubsub``, ``metadata``).
        address: what it reads (the subscription, the metadata server).
        retry_s: at most how long apart it tries again after a failure.
    """

    def __init__(self, source: str, address: str, *, retry_s: float) -> None:
        self.source = source
        self.address = address
        self.retry_s = retry_s
        self.ready: bool | None = None  # None: not known yet
        self._failure = ""  # the kind of the failure reported last

    async def works(self, ctx: SourceContext) -> None:
        """The source read its subscription or server."""
        if self.ready is not True:
            self.ready, self._failure = True, ""
            await ctx.publish(NoticeSourceReady(source=self.source, address=self.address))

    async def fails(self, ctx: SourceContext, error: NoticeSourceUnavailable) -> None:
        """The source cannot read it (``error`` says why)."""
        kind = error.error_type or error.reason
        if self.ready is False and kind == self._failure:
            return
        self.ready, self._failure = False, kind
        again = f"; trying again, at most {self.retry_s:g} s apart"
        await ctx.publish(
            NoticeSourceFailed(
                source=self.source,
                address=self.address,
                reason=error.reason,
                permanent=error.permanent,
                retry_s=self.retry_s,
                error_type=error.error_type,
                message=f"{error}{again}: no maintenance notices from {self.source} until then",
            )
        )


async def require_working(sources: Iterable[NoticeSource]) -> None:
    """Check that every source works now (``require_maintenance_notices``).

    Raises:
        ConfigError: a source does not work; the message names it and why.
    """
    for source in sources:
        try:
            await source.check()
        except NoticeSourceUnavailable as exc:
            raise ConfigError(f"maintenance notices are required (require_maintenance_notices), but {exc}") from exc
