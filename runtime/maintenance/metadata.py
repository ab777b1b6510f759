"""The metadata-server watcher: the second notice source, on Compute Engine and TPU VMs.

The metadata server tells a VM about its own maintenance and preemption. Each key is long-polled
(``?wait_for_change=true&last_etag=E&timeout_sec=T``): the server answers when the value changes or the
timeout passes, with the value's ``ETag``. Keys:

- ``instance/maintenance-event``: ``NONE``, or ``MIGRATE_ON_HOST_MAINTENANCE`` /
  ``TERMINATE_ON_HOST_MAINTENANCE`` (older: ``SHUTDOWN_ON_HOST_MAINTENANCE``) about 60 s before the host
  event. A change away from NONE is ``MaintenanceStarted``, back to NONE ``MaintenanceCompleted``.
- ``instance/upcoming-maintenance``: a JSON window (snake_case or camelCase fields) is
  ``MaintenanceScheduled`` (or ``MaintenanceStarted`` once ONGOING); a window that disappears again is
  ``MaintenanceCompleted``. No window is announced by an empty object, a 404 or 503, or an error body saying
  there are no notifications yet.
- ``instance/preempted``: ``TRUE`` is ``Preempted``.

What the VM sees is what it reports: only transitions are published, so a value that stays put is not
announced twice; the first value read counts as a transition from "nothing". A server that cannot be reached
is a ``NoticeSourceFailed`` event (once, while it lasts; polls go on with backoff), the first answer a
``NoticeSourceReady``.
The HTTP calls are blocking ``urllib`` calls, each in a daemon thread of its own that is left behind on
cancellation (it ends by its own timeout), because a long poll must neither hold the event loop nor delay
its shutdown.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential, wait_random

from elastic_runtime.core.errors import ElasticRuntimeError, NoticeMalformed
from elastic_runtime.core.events import (
    Event,
    MaintenanceCompleted,
    MaintenanceStarted,
    MalformedNotice,
    Notice,
    Preempted,
)
from elastic_runtime.maintenance.formats import ParsedNotice, parse_upcoming_maintenance
from elastic_runtime.maintenance.intake import NoticeIntake
from elastic_runtime.maintenance.source import DispatchTracker, NoticeSourceUnavailable, SourceContext, SourceStatus

__all__ = [
    "DEFAULT_KEYS",
    "HttpResponse",
    "MetadataUnavailable",
    "MetadataWatcher",
    "NoticeTracker",
    "http_get",
]

log = logging.getLogger(__name__)

DEFAULT_KEYS = ("instance/maintenance-event", "instance/upcoming-maintenance", "instance/preempted")
_PATH = "/computeMetadata/v1/"

HttpResponse = tuple[int, dict[str, str], bytes]
Fetch = Callable[[str, float], HttpResponse]


class MetadataUnavailable(ElasticRuntimeError):
    """The metadata server could not be reached or answered an unexpected status."""


def http_get(url: str, timeout: float) -> HttpResponse:
    """GET ``url`` with the ``Metadata-Flavor`` header; (status, headers, body). Blocking.

    Raises:
        MetadataUnavailable: the server cannot be reached or did not answer within ``timeout``.
    """
    request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers.items()), response.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, dict(exc.headers.items()), exc.read()
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise MetadataUnavailable(f"metadata server at {url}: {exc}") from exc


def _no_notifications(status: int, body: bytes) -> bool:
    """Whether an upcoming-maintenance answer means "no window announced"."""
    text = body.strip().lower()
    return status == 404 or text in (b"", b"{}") or b"no notification" in text


class PollLater(ElasticRuntimeError):
    """A poll that cannot go on as a long poll: the server failed, or answered without an ETag to wait on."""


async def run_in_daemon_thread(fetch: Fetch, url: str, timeout: float) -> HttpResponse:
    """Run the blocking ``fetch`` in a daemon thread of its own and wait for it, cancellably.

    Not anyio's worker threads: an abandoned long poll would keep one of them busy for up to
    ``timeout_sec``, and the event loop waits for its worker threads when it closes, so a run (or
    ``elastic-runtime listen``) would hang at exit for up to a minute. A daemon thread is simply left behind.
    """
    token = anyio.lowlevel.current_token()
    done = anyio.Event()
    outcome: list[HttpResponse | BaseException] = []

    def work() -> None:
        try:
            outcome.append(fetch(url, timeout))
        except BaseException as exc:  # handed to the waiting task, which re-raises it
            outcome.append(exc)
        # RuntimeError: the loop has closed; nobody is waiting any more.
        with contextlib.suppress(RuntimeError):
            anyio.from_thread.run_sync(done.set, token=token)

    threading.Thread(target=work, name="metadata-poll", daemon=True).start()
    await done.wait()
    result = outcome[0]
    if isinstance(result, BaseException):
        raise result
    return result


class NoticeTracker:
    """The sync core: turns successive values of the watched keys into notices (transitions only)."""

    def __init__(self, instance: str) -> None:
        self.instance = instance
        self._last: dict[str, Any] = {}

    def update(self, key: str, status: int, body: bytes, etag: str = "") -> list[ParsedNotice]:
        """Notices caused by ``key`` now reading (``status``, ``body``).

        Raises:
            NoticeMalformed: the value cannot be parsed (the previous value is kept).
        """
        message_id = f"metadata:{key}:{etag}" if etag else f"metadata:{key}"
        common: dict[str, Any] = {"instance": self.instance, "message_id": message_id, "source": "metadata"}
        previous = self._last.get(key)
        notices: list[Notice] = []
        upcoming = key.endswith("upcoming-maintenance")
        if status != 200 and not (upcoming and _no_notifications(status, body)):
            return []  # a 503 during maintenance says nothing about the value: keep the last one
        if key.endswith("maintenance-event"):
            value = body.decode(errors="replace").strip().upper()
            if value != (previous or "NONE"):
                if value == "NONE":
                    notices.append(MaintenanceCompleted(kind=previous or "", **common))
                else:
                    notices.append(MaintenanceStarted(kind=value, **common))
            current: Any = value
        elif upcoming:
            if _no_notifications(status, body):
                parsed: list[ParsedNotice] = []
            else:
                parsed = parse_upcoming_maintenance(body, instance=self.instance, message_id=message_id)
            current = parsed[0].event if parsed else None
            if current is None and previous is not None:
                notices.append(MaintenanceCompleted(kind=previous.kind, **common))
            elif current is not None and not _same_notice(current, previous):
                notices.append(current)
        elif key.endswith("preempted"):
            current = body.strip().upper() == b"TRUE"
            if current and not previous:
                notices.append(Preempted(kind="PREEMPTED", **common))
        else:
            raise NoticeMalformed(f"metadata key {key!r} is not one the watcher understands")
        self._last[key] = current
        return [ParsedNotice(event=n, identities=(self.instance,)) for n in notices]


def _same_notice(a: Event, b: Event | None) -> bool:
    if b is None or type(a) is not type(b):
        return False
    skip = {"wall_time", "mono_time", "message_id"}
    return all(getattr(a, f) == getattr(b, f) for f in a.__struct_fields__ if f not in skip)


class MetadataWatcher:
    """Long-polls the metadata server's maintenance keys and publishes what changes as events.

    Args:
        host: ``metadata.google.internal`` on GCE; ``127.0.0.1:PORT`` in tests (``http://`` optional).
        intake: shared with the Pub/Sub listener, so a window seen by both is published once.
        instance: this VM's name; read from ``instance/name`` when not given.
        keys: the keys to watch (default: :data:`DEFAULT_KEYS`).
        poll_timeout_s: ``timeout_sec`` of each long poll.
        retry_max_s: longest wait after an error or a 503 before polling again.
        check_timeout_s: deadline of :meth:`check`.
        fetch: the blocking HTTP GET (injectable for tests).
        sleep: the async sleep used between retries (injectable for tests).
    """

    def __init__(
        self,
        host: str = "metadata.google.internal",
        intake: NoticeIntake | None = None,
        *,
        instance: str | None = None,
        keys: Sequence[str] = DEFAULT_KEYS,
        poll_timeout_s: float = 60.0,
        retry_max_s: float = 10.0,
        check_timeout_s: float = 10.0,
        fetch: Fetch = http_get,
        sleep: Callable[[float], Any] = anyio.sleep,
    ) -> None:
        base = host if "://" in host else f"http://{host}"
        self.base = base.rstrip("/") + _PATH
        self.intake = intake or NoticeIntake()
        self.instance = instance
        self.keys = tuple(keys)
        self.poll_timeout_s = poll_timeout_s
        self.retry_max_s = retry_max_s
        self.check_timeout_s = check_timeout_s
        self.status = SourceStatus("metadata", self.base, retry_s=retry_max_s)
        self.fetch = fetch
        self.sleep = sleep
        self.polls = 0
        self._tracker = DispatchTracker()

    async def run(self, ctx: SourceContext) -> None:
        """Watch until cancelled. Each key has its own long poll, so one task per key."""
        self._tracker.attach(ctx)
        try:
            instance = self.instance or await self._read_instance_name(ctx)
            tracker = NoticeTracker(instance)
            # One long poll per key must be in flight at once; a small task group of our own is the
            # least concurrency that allows it.
            async with anyio.create_task_group() as tg:
                for key in self.keys:
                    tg.start_soon(self._watch, key, tracker, ctx)
        finally:
            self._tracker.detach(ctx)

    def _retrying(self, what: str, first: float) -> AsyncRetrying:
        """Retry on PollLater (and an unreachable server), exponential backoff with jitter, forever."""

        def before_sleep(state: RetryCallState) -> None:
            error = state.outcome.exception() if state.outcome is not None else None
            wait = state.next_action.sleep if state.next_action is not None else 0.0
            log.warning("metadata %s: %s; retrying in %.1f s", what, error, wait)

        return AsyncRetrying(
            retry=retry_if_exception_type((PollLater, MetadataUnavailable)),
            wait=wait_exponential(multiplier=first, max=self.retry_max_s) + wait_random(0, 0.1),
            sleep=self.sleep,
            before_sleep=before_sleep,
        )

    async def check(self) -> None:
        """Check that the server answers (``instance/name``), within ``check_timeout_s``.

        Raises:
            NoticeSourceUnavailable: it cannot be reached, or does not answer as a metadata server does.
        """
        try:
            status, _, body = await self._get("instance/name", {}, timeout=self.check_timeout_s)
        except MetadataUnavailable as exc:
            raise self._unavailable(exc) from exc
        if status != 200 or not body.strip():
            raise self._unavailable(MetadataUnavailable(f"instance/name answered status {status}"))

    def _unavailable(self, exc: MetadataUnavailable) -> NoticeSourceUnavailable:
        return NoticeSourceUnavailable(
            f"metadata server {self.base} cannot be read: {exc}",
            address=self.base,
            reason=str(exc),
            permanent=False,
            error_type=type(exc).__name__,
        )

    async def _read_instance_name(self, ctx: SourceContext) -> str:
        async for attempt in self._retrying("instance/name", first=0.5):
            with attempt:
                status, _, body = await self._get_reporting(ctx, "instance/name", {}, timeout=10.0)
                if status != 200 or not body.strip():
                    raise PollLater(f"cannot read instance/name: status {status}")
                return body.decode().strip()
        raise AssertionError("unreachable: the retries never stop")

    async def _get(self, key: str, query: dict[str, str], *, timeout: float) -> HttpResponse:
        url = self.base + key + ("?" + urllib.parse.urlencode(query) if query else "")
        self.polls += 1
        return await run_in_daemon_thread(self.fetch, url, timeout)

    async def _get_reporting(
        self, ctx: SourceContext, key: str, query: dict[str, str], *, timeout: float
    ) -> HttpResponse:
        """:meth:`_get`, and whether the server answered as an event (once, while that does not change)."""
        try:
            answer = await self._get(key, query, timeout=timeout)
        except MetadataUnavailable as exc:
            await self.status.fails(ctx, self._unavailable(exc))
            raise
        await self.status.works(ctx)
        return answer

    async def _watch(self, key: str, tracker: NoticeTracker, ctx: SourceContext) -> None:
        """Long-poll ``key`` forever; each successful poll starts the backoff from the beginning again."""
        etag = ""
        while True:
            async for attempt in self._retrying(key, first=0.2):
                with attempt:
                    try:
                        etag = await self._poll(key, etag, tracker, ctx)
                    except PollLater:
                        etag = ""
                        raise

    async def _poll(self, key: str, etag: str, tracker: NoticeTracker, ctx: SourceContext) -> str:
        """One poll (a long poll when ``etag`` is known); publishes what changed and returns the new ETag.

        Raises:
            PollLater: the server failed, or no long poll is possible (503 during maintenance, 404, no ETag);
                what the answer said has been published first.
            MetadataUnavailable: the server could not be reached.
        """
        query = {"alt": "json"} if key.endswith("upcoming-maintenance") else {}
        if etag:
            query |= {"wait_for_change": "true", "last_etag": etag, "timeout_sec": f"{self.poll_timeout_s:g}"}
        status, headers, body = await self._get_reporting(ctx, key, query, timeout=self.poll_timeout_s + 10)
        if status not in (200, 404, 503):
            raise PollLater(f"unexpected status {status}")
        new_etag = next((v for k, v in headers.items() if k.lower() == "etag"), "")
        if etag and new_etag == etag and status == 200:
            return etag  # the long poll timed out: nothing changed
        try:
            parsed = tracker.update(key, status, body, new_etag)
        except NoticeMalformed as exc:
            log.warning("metadata %s: %s", key, exc)
            await self._publish(
                ctx, f"metadata:{key}:{new_etag}", [], MalformedNotice(source="metadata", reason=str(exc))
            )
        else:
            await self._publish(ctx, f"metadata:{key}:{new_etag}", parsed)
        if status != 200 or not new_etag:
            raise PollLater(f"status {status}{'' if new_etag else ', no ETag'}: polling again later")
        return new_etag

    async def _publish(
        self, ctx: SourceContext, message_id: str, parsed: list[ParsedNotice], malformed: MalformedNotice | None = None
    ) -> None:
        events: list[Event] = list(self.intake.admit(message_id, parsed, trusted=True))
        if malformed is not None:
            events.append(malformed)
        handled = False
        try:
            for event in events:
                await self._tracker.publish_and_wait(ctx, event)
            handled = True
        finally:
            self.intake.settle(message_id, handled=handled)
