"""A tier's lane: one save at a time; a save due while busy waits (the newest one), a requested one is kept."""

import threading

import pytest

from elastic_runtime.storage.lane import Lane


def test_a_due_save_waits_while_busy_and_a_newer_one_replaces_it() -> None:
    release = threading.Event()
    done: list[int] = []
    skipped: list[tuple[int, str]] = []
    waited: list[tuple[int, int]] = []

    def work(step: int) -> None:
        if step == 1:
            release.wait(10)
        done.append(step)

    lane: Lane[int] = Lane(
        "test",
        work,
        step_of=lambda s: s,
        on_skip=lambda s, why: skipped.append((s, why)),
        on_wait=lambda s, running: waited.append((s, running)),
    )
    try:
        assert lane.submit(1)
        assert lane.submit(2) and lane.submit(3)  # due while step 1 is written: each waits, 3 replaces 2
        assert lane.busy()
        with pytest.raises(TimeoutError, match="save of step 1"):
            lane.wait(0.05)
        release.set()
        lane.wait(10)
        assert done == [1, 3] and not lane.busy()  # the tier one write behind, not every save due during it lost
        assert waited == [(2, 1), (3, 1)]
        assert skipped == [(2, "replaced by step 3 while the save of step 1 ran")]
    finally:
        release.set()
        lane.close()


def test_a_requested_save_is_kept_over_due_ones_and_replaced_only_by_a_newer_request() -> None:
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
        assert lane.submit(2)  # due: waits
        assert lane.submit(3, forced=True)  # a request replaces the waiting due save (skipped)
        assert not lane.submit(4)  # due: a request waits already, it is skipped
        assert lane.submit(5, forced=True)  # a newer request replaces the waiting one (not a skip: it is served)
        release.set()
        lane.wait(10)
        assert done == [1, 5]
        assert skipped == [
            (2, "replaced by step 3 while the save of step 1 ran"),
            (4, "a requested save of step 3 waits already"),
        ]
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
