"""The Pub/Sub listener: streaming pull from a subscription, each message turned into events on the bus.

google-cloud-pubsub has no asyncio subscriber: ``SubscriberClient.subscribe`` calls its callback on a
thread pool. Each callback hands its message to the event loop with :func:`anyio.from_thread.run` (with the
loop's token, since the pool's threads are not anyio's) and blocks until the message's events have been
through their handlers; only then is the message acked. So:

- the loop never blocks on Pub/Sub, and Pub/Sub never waits on more than ``max_messages`` messages at once
  (flow control), which bounds the threads parked in callbacks and the events queued from them;
- a message whose handling was cut short (the run ended) is nacked and comes back, to this or another
  subscriber; a handled one is acked, even if a handler failed (that failure is a ``HandlerFailed`` event;
  redelivering the notice would only fail again);
- a malformed or unknown message is logged, published as ``MalformedNotice`` and acked, never redelivered
  forever.

Before each stream it opens, the listener checks the subscription (:meth:`PubSubListener.check`:
``get_subscription``, within ``check_timeout_s``): a client without credentials, a subscription that does not
exist or that this account may not read is a ``NoticeSourceFailed`` event at once (and a console line), the
first check that passes a ``NoticeSourceReady``, so the event log says whether the run had maintenance
protection. The client library reconnects a broken stream by itself on transient errors. When the stream ends
for good, or the check fails, the listener tries again after an exponential, jittered backoff (tenacity), up to
``reconnect_max_s`` apart, forever, permanent errors too: each of them is fixed by an operator while the job
runs (the subscription created, an IAM binding propagated, the GKE metadata server up), and a listener that
gave up would leave the run unprotected for good after the fix. The event says so once, not at every retry;
``require_maintenance_notices`` makes a source that does not work at start an error instead.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import google.auth.exceptions
from google.api_core import exceptions as api_exceptions
from google.cloud import pubsub_v1
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential, wait_random

from elastic_runtime.core.config import check_subscription
from elastic_runtime.core.errors import ElasticRuntimeError, NoticeMalformed
from elastic_runtime.core.events import Event, MalformedNotice
from elastic_runtime.maintenance.formats import parse_message
from elastic_runtime.maintenance.intake import NoticeIntake
from elastic_runtime.maintenance.source import DispatchTracker, NoticeSourceUnavailable, SourceContext, SourceStatus

__all__ = ["PubSubListener", "StreamBroken"]

log = logging.getLogger(__name__)


class StreamBroken(ElasticRuntimeError):
    """The streaming pull ended with an error the client library does not retry by itself."""


# What roles/pubsub.subscriber grants: enough to pull, not to read the subscription's settings (get_subscription).
CONSUME = "pubsub.subscriptions.consume"

# Errors an operator must fix; the others (a deadline, an unreachable endpoint) may pass by themselves.
_PERMANENT: tuple[tuple[type[Exception], str], ...] = (
    (google.auth.exceptions.DefaultCredentialsError, "no credentials"),
    (api_exceptions.Unauthenticated, "the credentials were refused"),
    (api_exceptions.NotFound, "the subscription does not exist"),
    (api_exceptions.PermissionDenied, f"permission denied (the account needs {CONSUME}: roles/pubsub.subscriber)"),
)


def unavailable(subscription: str, exc: Exception) -> NoticeSourceUnavailable:
    """``exc``, raised by the Pub/Sub client for ``subscription``, as a NoticeSourceUnavailable."""
    reason, permanent = next(((why, True) for kind, why in _PERMANENT if isinstance(exc, kind)), ("", False))
    reason = reason or f"{type(exc).__name__}: {exc}"
    return NoticeSourceUnavailable(
        f"Pub/Sub subscription {subscription} cannot be read: {reason} ({exc})",
        address=subscription,
        reason=reason,
        permanent=permanent,
        error_type=type(exc).__name__,
    )


class PubSubListener:
    """Listens on ``subscription`` and publishes the notices for this job's instances as events.

    Args:
        subscription: ``projects/P/subscriptions/S``.
        intake: filters and deduplicates; share one between sources. Default: every instance counts.
        max_messages: flow control: messages outstanding (received, not yet acked) at most.
        max_bytes: flow control: bytes outstanding at most.
        reconnect_max_s: longest wait between two attempts to open the stream.
        check_timeout_s: deadline of the subscription check before each stream.
        healthy_stream_s: a stream that lived this long before it broke is reopened at once, with the
            backoff reset.
        client_factory: builds the ``SubscriberClient`` (in a worker thread); the default honours
            ``PUBSUB_EMULATOR_HOST``.
        on_message: called in the loop with (message id, publish time, receive time) of every message received,
            for benchmarks and monitoring.
    """

    def __init__(
        self,
        subscription: str,
        intake: NoticeIntake | None = None,
        *,
        max_messages: int = 100,
        max_bytes: int = 10 * 1024 * 1024,
        reconnect_max_s: float = 30.0,
        check_timeout_s: float = 10.0,
        healthy_stream_s: float = 60.0,
        client_factory: Callable[[], pubsub_v1.SubscriberClient] = pubsub_v1.SubscriberClient,
        on_message: Callable[[str, float, float], None] | None = None,
    ) -> None:
        check_subscription(subscription)
        if max_messages < 1 or max_bytes < 1:
            raise ValueError(f"flow control bounds must be >= 1, got {max_messages} messages, {max_bytes} bytes")
        self.subscription = subscription
        self.intake = intake or NoticeIntake()
        self.flow_control = pubsub_v1.types.FlowControl(max_messages=max_messages, max_bytes=max_bytes)
        self.reconnect_max_s = reconnect_max_s
        self.check_timeout_s = check_timeout_s
        self.healthy_stream_s = healthy_stream_s
        self.status = SourceStatus("pubsub", subscription, retry_s=reconnect_max_s)
        self._last_stream_s = 0.0
        self.client_factory = client_factory
        self.on_message = on_message
        self.streams_opened = 0
        self.messages_handled = 0  # acked after their events went through their handlers
        self._tracker = DispatchTracker()
        self._flights: dict[str, anyio.Event] = {}

    async def run(self, ctx: SourceContext) -> None:
        """Listen until cancelled, reopening the stream whenever it breaks."""
        self._tracker.attach(ctx)
        try:
            while True:
                # A fresh policy after each stream that lived long: its break is news, not the next failure
                # of a series, so it is reopened at once and the backoff starts from the beginning.
                retrying = AsyncRetrying(
                    retry=retry_if_exception_type((StreamBroken, NoticeSourceUnavailable)),
                    stop=self._lived_long,
                    wait=wait_exponential(multiplier=0.2, max=self.reconnect_max_s) + wait_random(0, 0.2),
                    before_sleep=self._log_retry,
                    reraise=True,
                )
                try:
                    async for attempt in retrying:
                        with attempt:
                            await self._connect(ctx)
                except StreamBroken as exc:
                    log.warning("Pub/Sub %s after %.0f s; reopening now", exc, self._last_stream_s)
        finally:
            self._tracker.detach(ctx)

    async def check(self) -> None:
        """Check that the subscription exists and this account may pull from it, within ``check_timeout_s``.

        Raises:
            NoticeSourceUnavailable: no credentials, no such subscription, no permission, or no answer in time.
        """
        client = await self._client()
        try:
            await anyio.to_thread.run_sync(self._check, client, abandon_on_cancel=True)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(_close, None, client)

    async def _client(self) -> pubsub_v1.SubscriberClient:
        """A new client (in a worker thread: it may look for credentials)."""
        try:
            return await anyio.to_thread.run_sync(self.client_factory)
        except Exception as exc:  # no credentials, a bad endpoint
            raise unavailable(self.subscription, exc) from exc

    def _check(self, client: pubsub_v1.SubscriberClient) -> None:
        """:meth:`check`'s blocking calls (in a worker thread)."""
        try:
            client.get_subscription(subscription=self.subscription, timeout=self.check_timeout_s, retry=None)
        except api_exceptions.PermissionDenied as exc:
            # The subscriber role may pull but not read the subscription: ask whether it may pull. (A subscription
            # that does not exist grants nothing either.)
            try:
                granted = client.test_iam_permissions(
                    request={"resource": self.subscription, "permissions": [CONSUME]},
                    timeout=self.check_timeout_s,
                    retry=None,
                )
            except Exception as second:
                raise unavailable(self.subscription, exc) from second
            if CONSUME not in granted.permissions:
                raise unavailable(self.subscription, exc) from exc
        except Exception as exc:
            raise unavailable(self.subscription, exc) from exc

    async def _connect(self, ctx: SourceContext) -> None:
        """Check the subscription (an event says how that went), then stream from it until the stream breaks."""
        self._last_stream_s = 0.0  # a failed check is the next failure of a series, whatever came before
        try:
            client = await self._client()
        except NoticeSourceUnavailable as exc:
            await self.status.fails(ctx, exc)
            raise
        try:
            try:
                await anyio.to_thread.run_sync(self._check, client, abandon_on_cancel=True)
            except NoticeSourceUnavailable as exc:
                await self.status.fails(ctx, exc)
                raise
            await self.status.works(ctx)
            await self._stream(ctx, client)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(_close, None, client)

    def _lived_long(self, state: RetryCallState) -> bool:
        return self._last_stream_s >= self.healthy_stream_s

    def _log_retry(self, state: RetryCallState) -> None:
        outcome = state.outcome
        error = outcome.exception() if outcome is not None else None
        wait = state.next_action.sleep if state.next_action is not None else 0.0
        log.warning("Pub/Sub on %s: %s; trying again in %.1f s", self.subscription, error, wait)

    async def _stream(self, ctx: SourceContext, client: pubsub_v1.SubscriberClient) -> None:
        """Stream from the subscription with ``client`` until the stream breaks."""
        token = anyio.lowlevel.current_token()
        ended = anyio.Event()

        def on_done(_: Any) -> None:
            # RuntimeError: the loop is gone, so nobody is waiting any more.
            with contextlib.suppress(RuntimeError):
                anyio.from_thread.run_sync(ended.set, token=token)

        def callback(message: Any) -> None:
            self._on_message(message, ctx, token)

        future: Any = None
        self._last_stream_s = 0.0
        opened = time.monotonic()
        try:
            try:
                future = await anyio.to_thread.run_sync(
                    lambda: client.subscribe(self.subscription, callback, flow_control=self.flow_control)
                )
            except Exception as exc:
                raise StreamBroken(f"cannot open a streaming pull on {self.subscription}: {exc}") from exc
            future.add_done_callback(on_done)
            if future.done():
                ended.set()  # it ended before the callback was added (or the callback ran here, on the loop)
            self.streams_opened += 1
            log.info("listening on %s", self.subscription)
            await ended.wait()
            error = future.exception()
            raise StreamBroken(f"streaming pull on {self.subscription} ended: {error}") from error
        finally:
            if future is not None:
                self._last_stream_s = time.monotonic() - opened
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(_close, future, None)

    def _on_message(self, message: Any, ctx: SourceContext, token: anyio.lowlevel.EventLoopToken) -> None:
        """Runs on the client's thread pool: hand the message to the loop, ack once it was handled."""
        received = time.time()
        try:
            handled = anyio.from_thread.run(self._handle, message, received, ctx, token=token)
        except BaseException as exc:  # the run ended or the loop is gone: let Pub/Sub deliver it again
            log.info("notice %s not handled (%s: %s); nacked", message.message_id, type(exc).__name__, exc)
            handled = False
        if handled:
            message.ack()
        else:
            message.nack()

    async def _handle(self, message: Any, received: float, ctx: SourceContext) -> bool:
        """Publish the message's events and wait until they were handled; True: ack it."""
        message_id: str = message.message_id
        published = message.publish_time.timestamp()
        if self.on_message is not None:
            self.on_message(message_id, published, received)
        # A redelivery repeats the id and the publish time. The id alone is not enough: a topic deleted and
        # made again (as after an emulator restart) numbers its messages from 1 again.
        key = f"{message_id}@{published:.6f}"
        if self.intake.is_handled(key):
            log.info("notice %s: already handled (redelivery)", message_id)
            return True
        flight = self._flights.get(key)
        if flight is not None:
            # Delivered again while the first delivery is still being handled: share its outcome.
            await flight.wait()
            return self.intake.is_handled(key)
        self._flights[key] = flight = anyio.Event()
        handled = False
        try:
            try:
                parsed = parse_message(message.data, dict(message.attributes), message_id=message_id)
            except Exception as exc:
                # NoticeMalformed is the expected case; anything else is a parser bug, and redelivering the
                # message would only hit it again, forever: it is dropped the same way, with its traceback.
                log.warning("notice %s dropped: %s", message_id, exc, exc_info=not isinstance(exc, NoticeMalformed))
                self.intake.admit(key, ())
                reason = str(exc) if isinstance(exc, NoticeMalformed) else f"{type(exc).__name__}: {exc}"
                events: list[Event] = [MalformedNotice(source="pubsub", message_id=message_id, reason=reason)]
            else:
                events = list(self.intake.admit(key, parsed))
            for event in events:
                await self._tracker.publish_and_wait(ctx, event)
            handled = True
            self.messages_handled += 1
        finally:
            self.intake.settle(key, handled=handled)
            del self._flights[key]
            flight.set()
        return True


def _close(future: Any, client: pubsub_v1.SubscriberClient | None) -> None:
    """Stop the stream and release the client, those given (blocking; runs in a worker thread)."""
    if future is not None:
        future.cancel()
        # The stream's own error, if any, was reported by the caller already.
        with contextlib.suppress(Exception):
            future.result(timeout=10)
    if client is not None:
        client.close()
