"""What every notice source does with a parsed notice before publishing it: keep ours, drop repeats.

The sync core shared by the Pub/Sub listener and the metadata watcher (one instance shared by both, so a
window announced by both is published once):

- **ours only**: a notice counts when one of its identities matches a configured instance name, numeric id
  or glob pattern (TPU VM workers are named ``t1v-n-<hash>-w-<N>``, so ``t1v-n-1a2b3c4d-w-*`` names a whole
  slice). The event is rewritten to carry the configured name, so handlers can look up devices by it.
- **once**: a message id already handled is dropped (Pub/Sub redelivers until acked), and so is a notice
  with the same instance, event type and window as one already published (the same window announced again
  under a new message id, or by a second source).
- **this project's only** (when one is named): a notice whose source names another project is not ours, even
  when an instance there has the same name as one of ours.
- **in order**: a maintenance notice issued before the newest one already seen for its instance is stale
  (``Started`` delivered after ``Completed``) and dropped; of two issued at the same time, the one further
  along (scheduled, started, completed) is the newer. Preemption and host errors are never stale. So the
  handlers see each instance's notices oldest first, and the last one they see is the newest
  (:mod:`.reconcile`).
- **current**: a ``Started`` issued within the window its instance's ``Scheduled`` announced, when that window
  has ended by now, is old news (a backlog found after a restart) and dropped; the handlers, which see no issue
  times, would take it for a new maintenance.

A message is marked handled only by :meth:`NoticeIntake.settle`, after its events were dispatched: a
message whose handling was interrupted is taken again on redelivery.
"""

from __future__ import annotations

import fnmatch
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

import msgspec

from elastic_runtime.core.events import (
    MaintenanceCompleted,
    MaintenanceScheduled,
    MaintenanceStarted,
    Notice,
    NoticeIgnored,
)
from elastic_runtime.maintenance.formats import ParsedNotice
from elastic_runtime.maintenance.reconcile import status_rank

__all__ = ["InstanceMatcher", "NoticeIntake"]

log = logging.getLogger(__name__)

_LIFECYCLE = (MaintenanceScheduled, MaintenanceStarted, MaintenanceCompleted)


class InstanceMatcher:
    """Which instances belong to this job: exact names or ids, or glob patterns (``*``, ``?``, ``[...]``).

    With no patterns at all every instance matches (for ``elastic-runtime listen``, which shows everything).
    """

    def __init__(self, patterns: Iterable[str] = ()) -> None:
        self.patterns = tuple(dict.fromkeys(patterns))
        self._exact = {p for p in self.patterns if not any(c in p for c in "*?[")}
        self._globs = [p for p in self.patterns if p not in self._exact]

    @property
    def matches_all(self) -> bool:
        return not self.patterns

    def canonical(self, identities: Iterable[str]) -> str | None:
        """The configured name for the first identity that matches, or ``None`` if none does.

        An exact configured name or id is returned as configured; a glob returns the identity it matched,
        since the pattern names many instances.
        """
        identities = tuple(identities)
        if self.matches_all:
            return identities[0] if identities else None
        for identity in identities:
            if identity in self._exact:
                return identity
        for identity in identities:
            if any(fnmatch.fnmatchcase(identity, g) for g in self._globs):
                return identity
        return None


class RecentKeys(OrderedDict[object, None]):
    """The newest ``limit`` keys (oldest dropped first), so that a long run's memory stays flat."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def add(self, key: object) -> None:
        self[key] = None
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


class NoticeIntake:
    """Filters, deduplicates and orders parsed notices. Not thread-safe: call it from the event loop only.

    Args:
        instances: this job's instances (names, ids, globs); empty: every instance.
        repeat_window_s: how long a preemption or host error of one instance counts as the same notice
            (they carry no window to compare).
        memory: how many message ids and notice keys are remembered.
        clock: wall clock, injectable for tests.
        project: this job's Google Cloud project; "": any. Notices from sources that name another are not ours.
        report_ignored: a notice that is not ours is admitted as a ``NoticeIgnored`` event (to be counted),
            rather than dropped silently.
    """

    def __init__(
        self,
        instances: Iterable[str] = (),
        *,
        repeat_window_s: float = 600.0,
        memory: int = 10_000,
        clock: Callable[[], float] = time.time,
        project: str = "",
        report_ignored: bool = False,
    ) -> None:
        self.matcher = InstanceMatcher(instances)
        self.project = project
        self.report_ignored = report_ignored
        self.repeat_window_s = repeat_window_s
        self.clock = clock
        self._handled_ids = RecentKeys(memory)
        self._in_flight: dict[str, tuple[object, ...]] = {}
        self._published = RecentKeys(memory)
        self._newest: dict[str, tuple[float, int]] = {}  # instance -> (issue time, status rank) of its newest
        self._ends: dict[str, float] = {}  # instance -> the end of the window its newest Scheduled announced

    def is_handled(self, message_id: str) -> bool:
        """Whether the message was already handled (a redelivery, to be acked and otherwise ignored)."""
        return bool(message_id) and message_id in self._handled_ids

    def admit(
        self, message_id: str, parsed: Iterable[ParsedNotice], *, trusted: bool = False
    ) -> list[Notice | NoticeIgnored]:
        """The events of one message to publish now; empty if none is ours, new and current.

        ``trusted``: the notice is about this very machine (the metadata server), so it is ours whatever
        its name. Every admitted message must be followed by :meth:`settle`.
        """
        now = self.clock()
        admitted: list[Notice | NoticeIgnored] = []
        keys: list[object] = []
        for notice in parsed:
            name = notice.event.instance if trusted else self.matcher.canonical(notice.identities)
            foreign = bool(self.project and notice.project and notice.project != self.project and not trusted)
            if name is None or foreign:
                why = f"of project {notice.project}, not {self.project}" if foreign else "not one of this job's"
                log.info("notice %s: instance %s is %s; ignored", message_id, notice.event.instance, why)
                if self.report_ignored:
                    admitted.append(_ignored(notice.event, message_id, f"instance {why}"))
                continue
            event = notice.event
            if name != event.instance:
                event = _with_instance(event, name)
            key = self._key(event, notice.issued_at, now)
            if key in self._published or key in keys:
                log.info("notice %s: %s for %s already published", message_id, type(event).__name__, name)
                continue
            if self._stale(event, notice.issued_at):
                log.info("notice %s: %s for %s is older than one already seen", message_id, type(event).__name__, name)
                continue
            if self._ended(event, notice.issued_at, now):
                log.info("notice %s: %s for %s is of a window that has ended", message_id, type(event).__name__, name)
                continue
            admitted.append(event)
            keys.append(key)
        self._in_flight[message_id] = tuple(keys)
        for key in keys:
            self._published.add(key)  # claimed now, so a concurrent duplicate is not admitted too
        return admitted

    def settle(self, message_id: str, *, handled: bool) -> None:
        """Record the outcome of an admitted message: handled (acked) or not (to be redelivered)."""
        keys = self._in_flight.pop(message_id, ())
        if handled:
            if message_id:
                self._handled_ids.add(message_id)
            return
        for key in keys:
            self._published.pop(key, None)  # the redelivery must be able to publish it again

    def _key(self, event: Notice, issued_at: float | None, now: float) -> object:
        if isinstance(event, MaintenanceScheduled):
            return (type(event).__name__, event.instance, event.window_start, event.window_end)
        if isinstance(event, _LIFECYCLE):
            # The issue time tells two cycles of one instance apart; a source without it (the metadata
            # server) reports transitions only, so it never repeats itself.
            return (type(event).__name__, event.instance, event.kind, issued_at)
        # Preemption and host errors have no window: the same one within repeat_window_s is a repeat.
        return (type(event).__name__, event.instance, int(now // self.repeat_window_s))

    def _stale(self, event: Notice, issued_at: float | None) -> bool:
        if issued_at is None or not isinstance(event, _LIFECYCLE):
            return False
        order = (issued_at, status_rank(event))
        newest = self._newest.get(event.instance)
        if newest is not None and order < newest:
            return True
        self._newest[event.instance] = order
        return False

    def _ended(self, event: Notice, issued_at: float | None, now: float) -> bool:
        if isinstance(event, MaintenanceScheduled):
            if event.window_end is None:
                self._ends.pop(event.instance, None)
            else:
                self._ends[event.instance] = event.window_end
            return False
        if isinstance(event, MaintenanceCompleted):
            self._ends.pop(event.instance, None)
            return False
        end = self._ends.get(event.instance)
        if not isinstance(event, MaintenanceStarted) or issued_at is None or end is None:
            return False
        return issued_at <= end <= now


def _ignored(event: Notice, message_id: str, reason: str) -> NoticeIgnored:
    return NoticeIgnored(
        source=event.source, instance=event.instance, message_id=message_id, reason=f"{type(event).__name__}: {reason}"
    )


def _with_instance(event: Notice, instance: str) -> Notice:
    return msgspec.structs.replace(event, instance=instance)
