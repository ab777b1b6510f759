"""An instance's maintenance, reconciled: the state its newest notice and the current time imply.

Notices are not replayed one by one. A job that restarts within its subscription's retention finds a whole
window's notices (Scheduled, Started, Completed) queued, delivered together and in any order; and what a
handler asks for in answer to one notice (a ``Drain``) is dispatched only after the notices already queued.
Acted on in turn, a backlog drains an instance after its maintenance completed, for good. So the drain
handlers keep, per instance, one :class:`Window` that every notice the intake admits is folded into
(:func:`fold`: the newest wins; the intake has dropped the older ones by their own issue time and status,
:func:`status_rank`), and decide from it and the current time (:func:`verdict`), when a notice arrives and
again when a planned drain comes due:

- completed or cancelled, or an announced end that has passed: the window is over; nothing stays drained;
- started, or the instance preempted: drain now; over at the announced end, when one is known;
- scheduled: drain ``lead_s`` before the announced start (now, when that is past).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from elastic_runtime.core.events import (
    MaintenanceCompleted,
    MaintenanceScheduled,
    MaintenanceStarted,
    Notice,
    Preempted,
)

__all__ = ["Phase", "Verdict", "Window", "fold", "status_rank", "verdict"]

_RANKED = (MaintenanceScheduled, MaintenanceStarted, MaintenanceCompleted)


class Phase(enum.Enum):
    """Where an instance's maintenance is, by its newest notice."""

    SCHEDULED = "scheduled"
    STARTED = "started"
    PREEMPTED = "preempted"
    OVER = "over"


@dataclass(frozen=True)
class Window:
    """An instance's maintenance window as its notices so far tell it (start and end in epoch s, when known)."""

    phase: Phase
    start: float | None = None
    end: float | None = None
    cause: str = ""  # the newest notice's type, for the reasons


@dataclass(frozen=True)
class Verdict:
    """What a window implies now.

    Attributes:
        drain_at: when the instance must be drained (at or before now: at once); None: it must not be drained.
        opened: the window is open (too late to plan a drain ahead of it).
        ends_at: when the window ends, if known: the instance is re-admitted then.
        reason: why, in words.
    """

    drain_at: float | None
    opened: bool
    ends_at: float | None
    reason: str


def fold(window: Window | None, notice: Notice, now: float) -> Window:
    """The window after ``notice``, the newest notice of its instance, at ``now``. A ``Started`` keeps the
    announced window of the ``Scheduled`` before it (the notices that open a window rarely repeat it), while that
    window has not ended: one after the end opens a window of its own, whose end is unknown. (A ``Started`` issued
    within a window that has ended by now never gets here: the intake drops it as old news.)"""
    cause = type(notice).__name__
    if isinstance(notice, MaintenanceScheduled):
        return Window(Phase.SCHEDULED, notice.window_start, notice.window_end, cause)
    if isinstance(notice, MaintenanceCompleted):
        return Window(Phase.OVER, cause=cause)
    current = window is not None and window.phase is not Phase.OVER and (window.end is None or window.end > now)
    known = window if window is not None and current else Window(Phase.STARTED)
    if isinstance(notice, Preempted):
        return Window(Phase.PREEMPTED, cause=cause)  # the VM is going away: no window ends it
    if isinstance(notice, MaintenanceStarted):
        return Window(Phase.STARTED, known.start, known.end, cause)
    raise ValueError(f"{cause} is not a maintenance notice a window is made of")


def status_rank(notice: Notice) -> int:
    """How far along its maintenance ``notice`` says the instance is (scheduled 0, started 1, completed 2): of two
    notices issued at the same time, the further one is the newer."""
    return next(rank for rank, kind in enumerate(_RANKED) if isinstance(notice, kind))


def verdict(window: Window, now: float, lead_s: float) -> Verdict:
    """What ``window`` implies at ``now``, with drains ``lead_s`` ahead of a window's start."""
    if window.phase is Phase.OVER:
        return Verdict(None, False, None, f"{window.cause}: the maintenance is over")
    if window.end is not None and window.end <= now:
        return Verdict(None, False, window.end, f"{window.cause}: the window ended at {when(window.end)}")
    if window.phase is Phase.PREEMPTED:
        return Verdict(now, True, None, "the instance is being preempted")
    if window.phase is Phase.STARTED:
        return Verdict(now, True, window.end, "the maintenance started")
    if window.start is None:
        return Verdict(now, False, window.end, "maintenance scheduled at an unknown time")
    opened = window.start <= now
    reason = f"the window {'opened' if opened else 'opens'} at {when(window.start)}"
    return Verdict(window.start - lead_s, opened, window.end, reason)


def when(epoch: float | None) -> str:
    """``epoch`` as an RFC 3339 UTC time, for messages."""
    return "an unknown time" if epoch is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))
