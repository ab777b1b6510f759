"""A tier's lane: one save at a time, a due save skipped while busy, a requested one run next."""

import threading

import pytest

from elastic_runtime.storage.lane import Lane


def test_a_due_save_is_skipped_while_busy_and_a_requested_one_runs_next() -> None:
    release = threading.Event()
    done: list[int] = []
    skipped: list[tuple[int, str]] = []

    def work(step: int) -> None:
        if step == 1:
            release.wait(10)
        done.append(step)

    lane: Lane[int] = Lane("test", work, step_of=lambda s: s, on_skip=lambda s, why: skipped.append((s, why)))
    try:
        assert lane.submit(1)
        assert not lane.submit(2)  # due, but the lane is busy: skipped
        assert lane.submit(3, forced=True) and lane.submit(4, forced=True)  # 4 replaces 3 while both wait
        assert lane.busy()
        with pytest.raises(TimeoutError, match="save of step 1"):
            lane.wait(0.05)
        release.set()
        lane.wait(10)
        assert done == [1, 4] and not lane.busy()
        assert skipped == [(2, "the save of step 1 is still running")]
    finally:
        release.set()
        lane.close()


def test_a_failing_save_leaves_the_lane_usable() -> None:
    calls: list[int] = []

    def work(step: int) -> None:
        calls.append(step)
        raise OSError("disk full")

    lane: Lane[int] = Lane("test", work, step_of=lambda s: s, on_skip=lambda s, why: None)
    try:
        lane.submit(1)
        lane.wait(10)  # the failure is the work's own to report; waiting does not raise it
        assert lane.submit(2)
        lane.wait(10)
        assert calls == [1, 2]
    finally:
        lane.close()
