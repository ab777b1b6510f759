"""The heartbeat monitor's verdicts, with an injected clock: no test waits for real time."""

from __future__ import annotations

import math

import pytest

from elastic_runtime.cluster.controller.heartbeat import (
    HeartbeatMonitor,
    Hung,
    Lost,
    Straggling,
    UnknownWorker,
    verdict_event,
)
from elastic_runtime.core.events import Straggler, WorkerHung, WorkerLost


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def monitor(clock: FakeClock, **kwargs: float) -> HeartbeatMonitor:
    m = HeartbeatMonitor(clock=clock, **kwargs)
    for worker in (0, 1, 2):
        m.register(worker)
    return m


def test_silence_past_the_timeout_is_a_loss_and_not_before(clock: FakeClock) -> None:
    m = monitor(clock, timeout_s=2.0)
    clock.advance(1.9)
    m.observe(0, 1)
    m.observe(1, 1)
    assert m.check() == []
    clock.advance(0.2)  # worker 2 silent for 2.1 s
    [verdict] = m.check()
    assert isinstance(verdict, Lost) and verdict.worker == 2 and verdict.silent_s == pytest.approx(2.1)


def test_the_longest_silence_between_heartbeats_is_kept_and_a_lost_worker_s_silence_is_not(clock: FakeClock) -> None:
    m = monitor(clock, timeout_s=2.0)
    clock.advance(0.5)
    for worker in (0, 1, 2):
        m.observe(worker, 1)
    clock.advance(1.2)
    m.observe(0, 2)  # 1.2 s after its last heartbeat
    clock.advance(0.3)
    m.observe(1, 2)  # 1.5 s
    assert m.longest_gap_s == pytest.approx(1.5)
    clock.advance(1.0)  # worker 2 silent for 2.5 s: lost, and no longer watched
    assert [v.worker for v in m.check()] == [2]
    clock.advance(10.0)
    m.observe(2, 3)  # a late heartbeat of a lost worker is no gap of the run's
    assert m.longest_gap_s == pytest.approx(1.5)


def test_a_worker_that_has_not_stepped_in_its_group_gets_the_start_timeout(clock: FakeClock) -> None:
    m = monitor(clock, timeout_s=1.0, start_timeout_s=2.0)
    clock.advance(1.5)  # starting (no group yet): 1.5 s of silence is no loss
    assert m.check() == []
    for worker in (0, 1, 2):
        m.observe(worker, 5)
        m.expect_progress(worker, from_step=5)  # the group formed and restored step 5
    clock.advance(1.5)
    m.observe(0, 5)  # restored, still compiling its first step: starting
    m.observe(1, 6)  # committed step 6: training
    assert m.check() == []  # worker 2 silent 1.5 s, but starting too
    clock.advance(0.6)
    m.observe(0, 5)
    m.observe(2, 6)
    clock.advance(0.5)  # worker 1 silent 1.1 s while training: lost; worker 0 (0.5 s, starting) is not
    assert [(v.worker, round(v.silent_s, 1)) for v in m.check()] == [(1, 1.1)]  # type: ignore[union-attr]
    clock.advance(1.0)  # worker 2 (training) silent 1.5 s, worker 0 (starting) 1.5 s
    assert [v.worker for v in m.check()] == [2]
    clock.advance(0.6)
    assert [v.worker for v in m.check()] == [0]


def test_a_worker_seated_in_a_new_group_goes_back_to_the_start_timeout(clock: FakeClock) -> None:
    m = monitor(clock, timeout_s=1.0, start_timeout_s=3.0)
    for worker in (0, 1, 2):
        m.expect_progress(worker, from_step=0)
        m.observe(worker, 1)  # training
    clock.advance(0.5)
    for worker in (0, 1, 2):
        m.expect_progress(worker, False)  # the group settles: still the training timeout
    m.observe(2, 1)
    clock.advance(0.6)
    assert [v.worker for v in m.check()] == [0, 1]  # 1.1 s: lost (found in the settling, not after it)
    m.starting(2)  # seated in the new group
    clock.advance(2.0)
    assert m.check() == []  # 2.6 s of silence while joining: within the start timeout
    clock.advance(0.5)
    assert [v.worker for v in m.check()] == [2]  # 3.1 s


def test_the_next_silence_due_is_the_oldest_one_s_timeout(clock: FakeClock) -> None:
    m = monitor(clock, timeout_s=1.0, start_timeout_s=2.0)
    assert m.next_silence_due() == pytest.approx(102.0)  # all three starting since 100.0
    m.expect_progress(0, from_step=0)
    clock.advance(0.5)
    m.observe(0, 1)  # training: due 1 s after this heartbeat, before the starting ones
    assert m.next_silence_due() == pytest.approx(101.5)
    clock.advance(2.0)
    m.check()
    for worker in (1, 2):
        m.forget(worker)
    assert m.next_silence_due() == math.inf  # worker 0 got its verdict; nobody is watched


def test_the_start_timeout_is_never_shorter_than_the_timeout(clock: FakeClock) -> None:
    m = monitor(clock, timeout_s=2.0, start_timeout_s=1.0)
    clock.advance(1.5)
    assert m.check() == [] and m.start_timeout_s == 2.0


def test_the_longest_training_silence_counts_only_training_workers(clock: FakeClock) -> None:
    m = monitor(clock, timeout_s=1.0, start_timeout_s=5.0)
    m.expect_progress(0, from_step=0)
    clock.advance(0.3)
    m.observe(0, 1)  # training from here
    clock.advance(0.4)
    m.observe(0, 2)
    clock.advance(3.0)
    m.observe(1, 0)  # starting: 3.7 s since it was registered
    assert m.longest_training_gap_s == pytest.approx(0.4)
    assert m.longest_gap_s == pytest.approx(3.7)


def test_a_silent_worker_whose_process_runs_is_late_not_lost_until_the_hang_timeout(clock: FakeClock) -> None:
    running = {0, 1, 2}  # the processes the controller sees running (started on its machine)
    m = HeartbeatMonitor(timeout_s=1.0, hang_timeout_s=5.0, alive=running.__contains__, clock=clock)
    for worker in (0, 1, 2):
        m.register(worker)
        m.expect_progress(worker, from_step=0)
        m.observe(worker, 1)  # training
    clock.advance(1.5)
    m.observe(0, 2)
    assert m.check() == []  # 1 and 2 silent 1.5 s, their processes run: late
    clock.advance(0.5)
    m.observe(1, 2)  # heard from after 2.0 s: watched again, and that silence is the run's longest
    assert m.longest_training_gap_s == pytest.approx(2.0)
    running.discard(2)  # worker 2's process exited (or was stopped): its silence is a loss at once
    [lost] = m.check()
    assert isinstance(lost, Lost) and lost.worker == 2 and lost.reason == "no heartbeat for 2.00 s", lost
    m.observe(0, 3)
    clock.advance(1.2)
    m.observe(0, 4)
    assert m.check() == []  # worker 1 late again (1.2 s)
    clock.advance(3.9)
    m.observe(0, 5)
    [lost] = m.check()  # 5.1 s of silence though its process runs: lost
    assert isinstance(lost, Lost) and lost.worker == 1 and lost.reason.endswith("though its process runs"), lost
    running.clear()  # nothing known to run (a worker on another host): silence alone decides
    clock.advance(1.1)
    assert [v.worker for v in m.check()] == [0]


def test_a_verdict_is_given_once_until_the_worker_is_registered_again(clock: FakeClock) -> None:
    m = monitor(clock, timeout_s=1.0)
    clock.advance(1.5)
    assert {v.worker for v in m.check()} == {0, 1, 2}
    clock.advance(5)
    assert m.check() == []
    m.register(1)
    clock.advance(1.5)
    assert [v.worker for v in m.check()] == [1]


def test_mark_gone_is_reported_at_the_next_check_without_waiting(clock: FakeClock) -> None:
    m = monitor(clock, timeout_s=2.0)
    m.mark_gone(1, "connection closed")
    [verdict] = m.check()
    assert verdict == Lost(1, 0.0, "connection closed")


def test_the_first_signal_of_a_loss_wins_and_the_event_names_it(clock: FakeClock) -> None:
    m = monitor(clock, timeout_s=2.0)
    m.mark_gone(1, "Ray: the actor of worker 1 died", detected_by="ray")
    m.mark_gone(1, "connection closed")  # later: ignored
    clock.advance(2.5)  # workers 0 and 2 silent: the heartbeat's verdict
    verdicts = {v.worker: v for v in m.check()}
    assert verdicts[1] == Lost(1, 2.5, "Ray: the actor of worker 1 died", "ray")
    assert verdicts[0].detected_by == "heartbeat"  # type: ignore[union-attr]
    m.mark_gone(0, "Ray: too late", detected_by="ray")  # after the verdict: nothing more
    assert m.check() == []
    event = verdict_event(verdicts[1], step=4)
    assert isinstance(event, WorkerLost) and event.detected_by == "ray" and event.source == "ray"
    assert verdict_event(verdicts[0], step=4).detected_by == "heartbeat"  # type: ignore[union-attr]


def test_no_progress_while_alive_is_a_hang_only_when_progress_is_expected(clock: FakeClock) -> None:
    m = monitor(clock, timeout_s=2.0, hang_timeout_s=3.0)
    for _ in range(10):  # heartbeats keep coming, the step does not move
        clock.advance(0.5)
        for w in (0, 1, 2):
            m.observe(w, 7)
    assert m.check() == []  # progress not expected (the group is forming)
    m.expect_progress(0)
    for _ in range(5):
        clock.advance(0.5)
        for w in (0, 1, 2):
            m.observe(w, 7)
    assert m.check() == []  # 2.5 s without progress: not yet
    clock.advance(0.5)
    for w in (0, 1, 2):
        m.observe(w, 7)
    [verdict] = m.check()
    assert verdict == Hung(0, pytest.approx(3.0), 7)


def test_progress_resets_the_hang_clock(clock: FakeClock) -> None:
    m = monitor(clock, timeout_s=2.0, hang_timeout_s=1.0)
    m.expect_progress(0)
    for step in range(1, 20):
        clock.advance(0.5)
        m.observe(0, step)
        m.observe(1, step)
        m.observe(2, step)
    assert m.check() == []


def test_a_straggler_is_the_worker_the_others_wait_for(clock: FakeClock) -> None:
    # Every member's iteration takes the slowest's 0.3 s; worker 3 spends 0.22 s of it outside the collectives
    # (its own work) where the others spend 0.02 s: without it the group would step in 0.1 s, 3x faster.
    m = monitor(clock, straggler_factor=1.5, straggler_min_s=0.05, straggler_every_s=10.0)
    m.register(3)
    for step in range(1, 6):
        clock.advance(0.3)
        for w, outside in ((0, 0.02), (1, 0.021), (2, 0.019), (3, 0.22)):
            m.observe(w, step, (0.3, outside))
    [verdict] = m.check()
    assert isinstance(verdict, Straggling) and verdict.worker == 3
    assert verdict.slowdown == pytest.approx(3.0, rel=0.05) and verdict.excess_s == pytest.approx(0.2, abs=0.01)
    clock.advance(1)
    for w in (0, 1, 2, 3):
        m.observe(w, 6, (0.3, 0.22 if w == 3 else 0.02))
    assert m.check() == []  # reported at most every straggler_every_s


def test_a_slowdown_that_just_started_is_not_overstated(clock: FakeClock) -> None:
    # Worker 3 slowed down after step 3 (0.1 s iterations, 0.02 s of them outside the collectives, then 0.3 s with
    # 0.22 s outside); the others' iterations grow one step later (they wait in the next step's collectives). Their
    # windows' median iteration was still halfway, which overstated the slowdown 10-30x: 3x it is.
    m = monitor(clock, straggler_factor=1.5, straggler_min_s=0.05)
    m.register(3)
    for step in range(1, 9):
        clock.advance(0.2)
        for w in range(4):
            slowed = step > (3 if w == 3 else 4)
            m.observe(w, step, (0.3, 0.22 if w == 3 else 0.02) if slowed else (0.1, 0.02))
    [verdict] = m.check()
    assert verdict.worker == 3 and verdict.slowdown == pytest.approx(3.0, rel=0.05)


@pytest.mark.parametrize(
    ("outsides", "why"),
    [
        ((0.001, 0.001, 0.01), "10x the median outside, but 9 ms of a 0.1 s step is noise"),
        ((0.02, 0.02, 0.08), "60 ms more of a 0.5 s iteration: 1.14x, below the factor"),
    ],
)
def test_small_or_cheap_differences_are_not_stragglers(clock: FakeClock, outsides: tuple[float, ...], why: str) -> None:
    m = monitor(clock, straggler_factor=1.5, straggler_min_s=0.05)
    iteration = 0.1 if outsides[0] < 0.01 else 0.5
    for step in range(1, 6):
        for w, outside in enumerate(outsides):
            m.observe(w, step, (iteration, outside))
    assert m.check() == [], why


def test_unknown_workers_are_refused(clock: FakeClock) -> None:
    m = monitor(clock)
    with pytest.raises(UnknownWorker):
        m.observe(99, 1)
    m.forget(1)
    with pytest.raises(UnknownWorker):
        m.observe(1, 1)
    m.forget(12345)  # forgetting an unknown id is harmless


@pytest.mark.parametrize("kwargs", [{"timeout_s": 0}, {"hang_timeout_s": -1}, {"straggler_factor": 1.0}])
def test_bad_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        HeartbeatMonitor(**kwargs)


def test_verdicts_become_events() -> None:
    lost = verdict_event(Lost(1, 2.5, "no heartbeat"), step=7)
    assert isinstance(lost, WorkerLost) and lost.worker == 1 and lost.silent_s == 2.5 and lost.step == 7
    hung = verdict_event(Hung(2, 3.0, 6), step=7)
    assert isinstance(hung, WorkerHung) and hung.stalled_s == 3.0 and "step 6" in hung.message
    slow = verdict_event(Straggling(3, 3.0, 0.2, 0.3), step=7)
    assert isinstance(slow, Straggler) and (slow.slowdown, slow.excess_s, slow.iteration_s) == (3.0, 0.2, 0.3)


def test_more_losses_may_come_while_one_is_long_silent_or_a_lost_one_is_not_forgotten(clock: FakeClock) -> None:
    m = monitor(clock, timeout_s=2.0)
    clock.advance(1.0)
    m.observe(0, 1)
    m.observe(1, 1)
    assert m.losing(1.0) and not m.losing(1.1)  # worker 2, silent since it was registered
    m.observe(2, 1)
    assert not m.losing(0.1)
    clock.advance(2.5)
    assert len(m.check()) == 3
    assert m.losing(10.0)  # found lost; the supervisor has not taken them out yet
    for worker in (0, 1, 2):
        m.forget(worker)
    assert not m.losing(0.1)
