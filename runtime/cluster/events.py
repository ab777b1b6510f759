"""Events of multi-process runs, beyond the core catalogue: workers starting and exiting, groups forming.

They derive from :class:`runtime.core.events.Event`, so the event log encodes and decodes them once this module
is imported (the controller imports it; so should a reader of a multi-process run's log).
"""

from __future__ import annotations

from runtime.core.events import Event, Failure

__all__ = ["GroupFormed", "MalformedHeartbeat", "WorkerExited", "WorkerKilled", "WorkerStarted"]


class WorkerStarted(Event, frozen=True, kw_only=True):
    """The controller started worker process ``worker`` (``pid``); ``spare``: kept warm, not yet a member."""

    worker: int
    pid: int
    spare: bool


class WorkerExited(Event, frozen=True, kw_only=True):
    """Worker ``worker``'s process ended with ``returncode`` (negative: killed by that signal)."""

    worker: int
    returncode: int


class WorkerKilled(Event, frozen=True, kw_only=True):
    """The controller sent ``signal`` to worker ``worker`` (to remove a hung worker, or by fault injection)."""

    worker: int
    signal: str
    reason: str


class GroupFormed(Event, frozen=True, kw_only=True):
    """Generation ``generation`` of the group formed: ``members`` (worker ids, by process id) joined it."""

    generation: int
    members: tuple[int, ...]
    coordinator: str
    strategy: str
    seconds: float
    restore_step: int
    restore_source: int


class MalformedHeartbeat(Failure, frozen=True, kw_only=True):
    """A line on the heartbeat port did not decode, or named a worker the controller does not know."""

    peer: str
    reason: str
