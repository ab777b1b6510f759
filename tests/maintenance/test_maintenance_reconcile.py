"""An instance's maintenance, reconciled (runtime/maintenance/reconcile.py): windows folded from notices, what
they imply at a given time, and the intake's order of two notices issued at the same time."""

from __future__ import annotations

import pytest
from notices import upcoming

from elastic_runtime.core.events import (
    MaintenanceCompleted,
    MaintenanceScheduled,
    MaintenanceStarted,
    Preempted,
)
from elastic_runtime.maintenance.formats import parse_message
from elastic_runtime.maintenance.intake import NoticeIntake
from elastic_runtime.maintenance.reconcile import Phase, Verdict, Window, fold, verdict

NOW = 1_000_000.0
LEAD = 60.0


def scheduled(start: float | None, end: float | None) -> MaintenanceScheduled:
    return MaintenanceScheduled(instance="w", window_start=start, window_end=end)


def test_the_newest_notice_wins_and_a_start_keeps_the_announced_window_while_it_lasts() -> None:
    window = fold(None, scheduled(NOW + 30, NOW + 600), NOW)
    started = fold(window, MaintenanceStarted(instance="w"), NOW)
    assert started == Window(Phase.STARTED, NOW + 30, NOW + 600, "MaintenanceStarted")
    assert fold(started, MaintenanceCompleted(instance="w"), NOW).phase is Phase.OVER
    # A maintenance that starts after the last one completed, or after its window ended, has a window of its own.
    again = fold(fold(started, MaintenanceCompleted(instance="w"), NOW), MaintenanceStarted(instance="w"), NOW)
    assert again == Window(Phase.STARTED, None, None, "MaintenanceStarted")
    later = fold(window, MaintenanceStarted(instance="w"), NOW + 700)
    assert later == Window(Phase.STARTED, None, None, "MaintenanceStarted")
    assert fold(window, Preempted(instance="w"), NOW).phase is Phase.PREEMPTED


@pytest.mark.parametrize(
    ("window", "expected"),
    [
        # Ahead of the lead: drain at start - lead; open once the start has passed.
        (Window(Phase.SCHEDULED, NOW + 600, NOW + 900), Verdict(NOW + 540, False, NOW + 900, "")),
        (Window(Phase.SCHEDULED, NOW + 30, NOW + 900), Verdict(NOW - 30, False, NOW + 900, "")),
        (Window(Phase.SCHEDULED, NOW - 1, NOW + 900), Verdict(NOW - 61, True, NOW + 900, "")),
        (Window(Phase.SCHEDULED, None, None), Verdict(NOW, False, None, "")),
        (Window(Phase.STARTED, None, None), Verdict(NOW, True, None, "")),
        (Window(Phase.PREEMPTED), Verdict(NOW, True, None, "")),
        # Over: completed, or past its announced end, whatever the last notice said.
        (Window(Phase.OVER), Verdict(None, False, None, "")),
        (Window(Phase.SCHEDULED, NOW - 600, NOW - 60), Verdict(None, False, NOW - 60, "")),
        (Window(Phase.STARTED, NOW - 600, NOW - 60), Verdict(None, False, NOW - 60, "")),
    ],
)
def test_what_a_window_implies_now(window: Window, expected: Verdict) -> None:
    decided = verdict(window, NOW, LEAD)
    assert (decided.drain_at, decided.opened, decided.ends_at) == (expected.drain_at, expected.opened, expected.ends_at)
    assert decided.reason


def test_of_two_notices_issued_at_the_same_time_the_one_further_along_is_newer() -> None:
    intake = NoticeIntake(("worker-0",))
    done = parse_message(
        upcoming(start=NOW, end=NOW + 60, issued=NOW, status_message="Maintenance window has completed"), {}
    )
    ongoing = parse_message(upcoming(start=NOW, end=NOW + 60, issued=NOW, status="ONGOING"), {})
    assert [type(e) for e in intake.admit("1", done)] == [MaintenanceCompleted]
    assert intake.admit("2", ongoing) == []  # the same time, but not as far along: stale
    later = NoticeIntake(("worker-0",))
    assert [type(e) for e in later.admit("1", ongoing)] == [MaintenanceStarted]
    assert [type(e) for e in later.admit("2", done)] == [MaintenanceCompleted]


def test_a_start_issued_within_a_window_that_has_ended_is_old_news() -> None:
    """A backlog after a restart: the window opened ten minutes ago and ended a minute ago."""
    now = [NOW]
    intake = NoticeIntake(("worker-0",), clock=lambda: now[0])
    window = {"start": NOW - 600, "end": NOW - 60}
    assert [type(e) for e in intake.admit("1", parse_message(upcoming(**window, issued=NOW - 900), {}))] == [
        MaintenanceScheduled
    ]
    ongoing = parse_message(upcoming(**window, issued=NOW - 500, status="ONGOING"), {})
    assert intake.admit("2", ongoing) == []
    # A start issued after the end is another maintenance: news.
    later = parse_message(upcoming(**window, issued=NOW - 30, status="ONGOING"), {})
    assert [type(e) for e in intake.admit("3", later)] == [MaintenanceStarted]
    # While the window lasts, a start within it is news too.
    current = NoticeIntake(("worker-0",), clock=lambda: NOW)
    ahead = {"start": NOW - 10, "end": NOW + 600}
    current.admit("1", parse_message(upcoming(**ahead, issued=NOW - 900), {}))
    assert [
        type(e) for e in current.admit("2", parse_message(upcoming(**ahead, issued=NOW - 5, status="ONGOING"), {}))
    ] == [MaintenanceStarted]
