"""The recovery tracker shared by the executor and the controller: budget, joins, and when a recovery ends."""

from elastic_runtime.core.recovery import RecoveryTracker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_recovery_ends_at_the_first_commit_past_its_restore_point() -> None:
    clock = Clock()
    tracker = RecoveryTracker("executor", max_failures=3, clock=clock)
    started = tracker.fail("SliceLost", failed_step=11, last_committed_step=10)
    assert started.step == 11 and started.last_committed_step == 10 and tracker.current is not None
    assert tracker.committed(11, {"data": 2}) is None  # the old mesh's step: not before the restore
    tracker.restored(9, restored_from="ram", lost_steps=2)
    assert tracker.committed(9, {"data": 2}) is None
    clock.now = 101.5
    done = tracker.committed(10, {"data": 3})
    assert done is not None and done.recovery_s == 1.5 and done.lost_steps == 2 and done.restored_from == "ram"
    assert done.cause == "SliceLost" and done.failed_step == 11 and done.mesh_shape == {"data": 3}
    assert tracker.current is None and tracker.committed(11, {"data": 3}) is None


def test_a_failure_during_a_recovery_joins_it_and_counts_against_the_budget() -> None:
    clock = Clock()
    tracker = RecoveryTracker("controller", max_failures=2, clock=clock)
    tracker.fail("WorkerLost", failed_step=5, last_committed_step=4)
    tracker.restored(4, restored_from="ram", lost_steps=0)
    clock.now = 102.0
    again = tracker.fail("WorkerHung", failed_step=5, last_committed_step=4)
    assert again.cause == "WorkerHung"  # each failure is announced
    assert tracker.committed(5, {}) is None  # its restore starts over
    assert not tracker.over_budget
    tracker.fail("WorkerLost", failed_step=5, last_committed_step=4)
    assert tracker.failures == 3 and tracker.over_budget
    tracker.restored(4, restored_from="file", lost_steps=1)
    clock.now = 103.0
    done = tracker.committed(5, {})
    assert done is not None and done.cause == "WorkerLost" and done.recovery_s == 3.0  # timed from the first
