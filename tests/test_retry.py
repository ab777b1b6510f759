"""The retry policy of a step that keeps failing: immediate first retry, backoff, then give up."""

from elastic_runtime.core.recovery import RecoveryTracker
from elastic_runtime.core.retry import Backoff, RetryState


def test_backoff_retries_at_once_then_waits_longer_then_gives_up() -> None:
    policy = Backoff(attempts=4, base_s=0.5, max_s=0.8)
    waits = [policy(RetryState(step=12, attempts=n, failures=n)) for n in (1, 2, 3, 4)]
    assert waits == [0.0, 0.5, 0.8, None]  # capped at max_s; the fourth failure ends the run


def test_attempts_are_counted_per_step_not_per_lost_member() -> None:
    tracker = RecoveryTracker("controller", max_failures=10)
    for _ in range(3):  # one re-forming that lost three members
        tracker.fail("WorkerLost", failed_step=12, last_committed_step=11)
    first = tracker.attempt_failed(12)
    assert (first.step, first.attempts, first.failures) == (12, 1, 3)
    assert tracker.attempt_failed(12).attempts == 2
    assert tracker.attempt_failed(13).attempts == 1  # a later step starts its own count
