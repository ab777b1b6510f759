"""The controller's supervisor driven alone: worker records and a clock of the test's, no processes or sockets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from elastic_runtime.cluster.config import LaunchConfig, LaunchError, LaunchResult, Strategy
from elastic_runtime.cluster.controller.heartbeat import HeartbeatMonitor, Hung
from elastic_runtime.cluster.controller.membership import Membership
from elastic_runtime.cluster.controller.outcome import Outcome
from elastic_runtime.cluster.controller.processes import ProcessPool, log_tail
from elastic_runtime.cluster.controller.supervision import (
    Action,
    EndRun,
    FillSeats,
    Finish,
    Input,
    Kill,
    MemberFinished,
    MemberJoined,
    Place,
    Progress,
    Publish,
    RegroupRequested,
    RestoreFailed,
    Send,
    SendForm,
    Spawn,
    Start,
    Status,
    Tick,
    Watch,
    WorkerChanged,
    WorkerFailed,
)
from elastic_runtime.cluster.controller.supervisor import Supervisor
from elastic_runtime.cluster.protocol import Finished, Hello, Joined, Message, RestoreStep, Stop
from elastic_runtime.cluster.tiers import Tier
from elastic_runtime.core.errors import RecoveryError
from elastic_runtime.core.events import (
    Event,
    GroupFormed,
    GroupForming,
    RecoveryCompleted,
    StateRestored,
    StepCompleted,
)
from elastic_runtime.core.recovery import RecoveryTracker

TARGET = 100


class Run:
    """A supervisor and what its actions did: the records it starts, the messages and events it sends."""

    def __init__(self, tmp_path: Path, **overrides: Any) -> None:
        self.now = 0.0
        values: dict[str, Any] = {"nprocs": 2, "spares": 1, "hang_timeout_s": 5.0, "form_timeout_s": 30.0}
        config = LaunchConfig(command=["worker"], run_dir=str(tmp_path), **(values | overrides))
        self.pool = ProcessPool(config, tmp_path, str(tmp_path), "secret")
        self.monitor = HeartbeatMonitor(timeout_s=2.0, hang_timeout_s=config.hang_timeout_s, clock=self.clock)
        self.result = LaunchResult(False, 0, TARGET, {}, [], [], [], [], 0, "", str(tmp_path))
        self.outcome = Outcome(self.result)  # the result's figures, from the events published
        self.supervisor = Supervisor(
            config,
            self.pool,
            Membership(config.nprocs, config.slice_size),
            self.monitor,
            RecoveryTracker("controller", config.max_failures, clock=self.clock),
            target_steps=TARGET,
        )
        self.sent: list[tuple[int, Message]] = []
        self.forms: list[SendForm] = []
        self.events: list[Event] = []
        self.killed: list[int] = []
        self.filled: list[FillSeats] = []
        self.ended: BaseException | None = None
        self.finished = False
        self.next_worker = 0

    def clock(self) -> float:
        return self.now

    def service_mode(self) -> None:
        """From now on the controller starts no worker (``command=[]``): a new config for the supervisor and the
        pool, which share it (a LaunchConfig is frozen)."""
        config = msgspec.structs.replace(self.supervisor.config, command=[])
        self.supervisor.config = self.pool.config = config

    @property
    def members(self) -> list[int]:
        return self.supervisor.group.members

    def feed(self, event: Input) -> list[Action]:
        actions = self.supervisor.handle(event, self.now)
        for action in actions:
            match action:
                case Watch(worker=worker, how=how, from_step=from_step):
                    self.monitor.watch(worker, how, from_step)
                case Place(worker=worker, status=status):
                    self.pool[worker].place(status)
                case Spawn(count=count):
                    self.spawn(count)
                case Kill(worker=worker):
                    self.killed.append(worker)
                case Send(worker=worker, message=message):
                    if isinstance(message, RestoreStep):  # as the shell does: its step from now
                        self.pool[worker].step = message.step
                    self.sent.append((worker, message))
                case SendForm():
                    self.forms.append(action)
                    self.supervisor.hosted(action.generation, f"127.0.0.1:{1000 + action.generation}")
                case FillSeats():
                    self.filled.append(action)
                case Publish(event=published):
                    self.events.append(published)
                    self.outcome.take(published)
                case EndRun(error=error):
                    self.ended = error
                case Finish():
                    self.finished = True
        return actions

    def spawn(self, count: int) -> list[int]:
        started = []
        for _ in range(count):
            self.pool.admit(self.next_worker)  # a spare starting, not said hello yet
            started.append(self.next_worker)
            self.next_worker += 1
        return started

    def hello(self, *workers: int) -> None:
        for worker in workers:
            self.pool[worker].hello = Hello(worker=worker, pid=1, target_steps=TARGET)
            self.monitor.register(worker)
            self.feed(WorkerChanged(worker))

    def join(self, step: int = 0, tier: str = "none", join_s: float = 0.1) -> None:
        generation = self.supervisor.group.generation
        for worker in list(self.members):
            joined = Joined(worker=worker, generation=generation, best_step=step, tier=tier, join_s=join_s)
            self.pool[worker].joined = joined
            self.feed(MemberJoined(worker))

    def commit(self, step: int) -> None:
        for worker in self.members:
            self.pool[worker].step = step
            self.monitor.observe(worker, step, (0.1, 0.0))  # a 0.1 s iteration, all of it in the step
            self.feed(Progress(worker, step, 0.1))

    def lose(self, worker: int, reason: str = "WorkerLost") -> None:
        self.feed(RegroupRequested(frozenset({worker}), reason))

    def wait(self, seconds: float) -> None:
        self.now += seconds
        self.feed(Tick())

    def kinds(self) -> list[str]:
        return [type(e).__name__ for e in self.events]

    def restores(self) -> list[tuple[int, RestoreStep]]:
        return [(w, m) for w, m in self.sent if isinstance(m, RestoreStep)]


def started(tmp_path: Path, **overrides: Any) -> Run:
    """A run whose first group (workers 0 and 1; spare 2 ready, if any) trained to step 10."""
    run = Run(tmp_path, **overrides)
    run.spawn(run.supervisor.config.nprocs + run.supervisor.config.spares)
    run.feed(Start())
    run.hello(0, 1)
    assert [f.members for f in run.forms] == [(0, 1)]
    run.join()
    if run.supervisor.config.spares:
        run.hello(2)
    run.commit(10)
    assert run.result.strategies == [Strategy.START] and run.supervisor.group.step == 10
    run.events.clear()
    return run


def test_a_hello_recorded_before_the_supervisor_reads_it_is_not_a_missing_worker(tmp_path: Path) -> None:
    # The shell records a hello at once and feeds the supervisor through a queue: behind it (a loaded machine),
    # the supervisor handles worker 0's hello with worker 1's already recorded. Worker 1 is on its way to its seat;
    # starting a worker for it left an extra one beside the group (seen in test_forkserver, loaded).
    run = Run(tmp_path, spares=0)
    run.spawn(2)
    run.feed(Start())
    for worker in (0, 1):
        run.pool[worker].hello = Hello(worker=worker, pid=1, target_steps=TARGET)
        run.monitor.register(worker)
    run.feed(WorkerChanged(0))
    assert run.next_worker == 2  # none started
    run.feed(WorkerChanged(1))
    assert [f.members for f in run.forms] == [(0, 1)] and run.next_worker == 2


def test_a_lost_member_is_replaced_by_the_spare_and_the_group_reforms_from_the_survivors_step(tmp_path: Path) -> None:
    run = started(tmp_path)
    run.lose(1)
    assert run.kinds() == ["RecoveryStarted"] and len(run.forms) == 1  # settling: one re-forming for all
    run.wait(0.1)
    form = run.forms[-1]
    assert (form.generation, form.members, form.strategy, form.at_step) == (2, (0, 2), Strategy.REFORM, -1)
    run.join(step=10, tier="ram")
    assert {w: m.step for w, m in run.restores()[-2:]} == {0: 10, 2: 10}
    run.commit(11)
    recovery = ["RecoveryStarted", "GroupForming", "GroupFormed", "StateRestored"]
    assert run.kinds() == [*recovery, "StepCompleted", "RecoveryCompleted"]
    completed = run.events[-1]
    assert isinstance(completed, RecoveryCompleted) and completed.cause == "WorkerLost"
    assert run.result.strategies == [Strategy.START, Strategy.REFORM] and run.result.world_size_history == [2, 2]
    assert run.ended is None and run.killed == []


def test_the_supervisor_moves_workers_by_place_actions_and_leaves_the_pools_records_alone(tmp_path: Path) -> None:
    run = started(tmp_path)
    before = {p.worker: p.status for p in run.pool}
    lost = run.supervisor.handle(RegroupRequested(frozenset({1}), "WorkerLost"), run.now)
    run.now += 0.1
    formed = run.supervisor.handle(Tick(), run.now)
    assert {p.worker: p.status for p in run.pool} == before  # decided, not carried out yet
    assert [a for a in lost if isinstance(a, Place)] == [Place(1, Status.LOST)]
    assert [a for a in formed if isinstance(a, Place)] == [Place(0, Status.MEMBER), Place(2, Status.MEMBER)]
    assert [run.supervisor.status(w) for w in (0, 1, 2)] == [Status.MEMBER, Status.LOST, Status.MEMBER]
    run.pool[0].place(Status.LOST)  # the shell saw worker 0's process exit: the supervisor reads that
    assert run.supervisor.gone(0)


def test_a_verdict_kills_and_replaces_the_worker_once_and_a_handlers_request_only_changes_the_strategy(
    tmp_path: Path,
) -> None:
    # The monitor's verdict is the one decision: kill, count, re-form. A handler that saw the event first and asks
    # for the same worker with another strategy changes how the group re-forms, not how many failures there were.
    run = started(tmp_path)
    run.feed(WorkerFailed(1, "WorkerHung", "no progress past step 10 for 5.00 s"))
    assert run.killed == [1] and run.kinds() == ["RecoveryStarted"]
    run.feed(RegroupRequested(frozenset({1}), "WorkerHung", Strategy.RESTART))
    assert run.kinds() == ["RecoveryStarted"] and run.supervisor.recovery.failures == 1
    run.wait(0.1)
    assert run.killed == [1, 0]  # the survivor replaced too: a second worker started for its seat
    run.hello(3)
    assert (run.forms[-1].members, run.forms[-1].strategy) == ((2, 3), Strategy.RESTART)
    forming = [e for e in run.events if isinstance(e, GroupForming)]
    assert [e.reason for e in forming] == ["worker 1: WorkerHung (no progress past step 10 for 5.00 s)"]

    # Two verdicts settled together: one re-forming, whose reason names both.
    two = started(tmp_path / "two", spares=2)
    two.hello(3)
    two.feed(WorkerFailed(0, "WorkerLost", "process exited with -9"))
    two.feed(WorkerFailed(1, "WorkerLost", "silent for 2.10 s"))
    two.wait(0.1)
    assert [f.members for f in two.forms] == [(0, 1), (2, 3)] and two.killed == [0, 1]
    forming = [e for e in two.events if isinstance(e, GroupForming)]
    assert [e.reason for e in forming] == [
        "worker 0: WorkerLost (process exited with -9); worker 1: WorkerLost (silent for 2.10 s)"
    ]


def test_a_spare_takes_the_seat_of_a_member_lost_before_the_others_got_past_jaxs_start(tmp_path: Path) -> None:
    run = started(tmp_path)
    run.lose(1)
    run.wait(0.1)
    assert run.forms[-1].members == (0, 2)
    run.lose(2)  # the spare, seated, dies before anyone is in generation 2: worker 0 waits in JAX's start for seat 1
    assert run.killed == [] and run.supervisor.survivor_restarts == 0  # nobody else is replaced
    spawned = sorted(p.worker for p in run.pool if p.hello is None and not p.gone)
    assert spawned == [3]  # one spare for the one seat
    run.now += 25.0  # a slow cold start
    run.hello(3)
    form = run.forms[-1]
    assert (form.generation, form.members, form.strategy, form.seats) == (2, (0, 3), Strategy.REFORM, (3,))
    assert run.supervisor.group.has(3) and not run.supervisor.group.has(2)  # its heartbeats count (the shell asks)
    run.wait(10.0)  # past form_timeout_s from the first Form, not from the substitute's
    assert run.killed == []
    run.join(step=10, tier="ram")
    assert {w: m.step for w, m in run.restores()[-2:]} == {0: 10, 3: 10}
    run.commit(11)
    assert run.supervisor.recovery.failures == 2  # the two real losses, nothing else
    run.commit(12)
    run.wait(1.0)
    assert run.result.strategies == [Strategy.START, Strategy.REFORM] and run.ended is None and run.killed == []
    assert len([e for e in run.events if isinstance(e, GroupFormed)]) == 1 and len(run.forms) == 3  # no more

    # No spare comes for the seat before form_timeout_s: then (only then) every worker is replaced.
    late = started(tmp_path / "late", form_timeout_s=30.0)
    late.lose(1)
    late.wait(0.1)
    late.lose(2)
    late.wait(31.0)
    assert late.killed == [0] and late.supervisor.survivor_restarts == 1
    assert late.supervisor.recovery.failures == 2  # the restart is no failure of its own


def test_two_members_lost_apart_re_form_once_with_the_spares_and_no_survivor_killed(tmp_path: Path) -> None:
    # Issue 30: 4 workers, one warm spare; workers 2 and 3 die together, but 3's loss is reported after the
    # re-forming began (seated with the spare): it drops out of that forming, a second spare takes its seat.
    run = Run(tmp_path, nprocs=4, spares=1)
    run.spawn(5)
    run.feed(Start())
    run.hello(0, 1, 2, 3)
    run.join()
    run.hello(4)
    run.commit(10)
    run.events.clear()
    run.lose(2)
    run.wait(0.1)
    assert run.forms[-1].members == (0, 1, 4, 3)
    run.lose(3)
    run.hello(5)  # started for seat 3
    assert run.forms[-1].members == (0, 1, 4, 5) and run.forms[-1].generation == 2
    run.join(step=10, tier="ram")
    run.commit(11)
    assert run.killed == [] and run.supervisor.survivor_restarts == 0
    assert [e.members for e in run.events if isinstance(e, GroupFormed)] == [(0, 1, 4, 5)]  # one re-form
    assert run.supervisor.recovery.failures == 2
    assert run.result.strategies == [Strategy.START, Strategy.REFORM]


def test_a_member_lost_after_the_others_got_past_jaxs_start_drops_out_and_the_rest_re_form(tmp_path: Path) -> None:
    run = started(tmp_path, spares=2)
    run.hello(3)
    run.lose(1)
    run.wait(0.1)
    assert run.forms[-1].members == (0, 2)
    run.pool[0].generation = 2  # worker 0's heartbeat names generation 2: everyone got past JAX's start
    run.feed(Progress(0, run.pool[0].step))
    run.lose(2)
    form = run.forms[-1]
    assert (form.generation, form.members, form.strategy, form.seats) == (3, (0, 3), Strategy.REFORM, ())
    run.join(step=10, tier="ram")
    run.commit(11)
    assert run.killed == [] and run.supervisor.recovery.failures == 2 and run.ended is None


def serving_four(tmp_path: Path, min_nprocs: int) -> Run:
    """A run of 4 workers, no spare, trained to step 10, its controller in service mode from then on."""
    run = Run(tmp_path, nprocs=4, spares=0, min_nprocs=min_nprocs)
    run.spawn(4)
    run.feed(Start())
    run.hello(0, 1, 2, 3)
    run.join()
    run.commit(10)
    run.service_mode()
    return run


def test_in_service_mode_a_member_lost_before_anyone_got_past_jaxs_start_drops_out_at_once(tmp_path: Path) -> None:
    # No spare of the controller's and none ready: the others would wait in JAX's start for the lost seat until
    # the form timeout, and then be told to exit, which in service mode nobody replaces (a rack lost over half a
    # second, test_hosts_rack.py). They re-form without it at once; stand-ins fill its seat once they all went on.
    run = serving_four(tmp_path, min_nprocs=2)
    run.lose(1)
    run.wait(0.1)
    assert (run.forms[-1].generation, run.forms[-1].members) == (2, (0, 2, 3))
    run.lose(2)  # before anyone is in generation 2
    form = run.forms[-1]
    assert (form.generation, form.members, form.strategy, form.seats) == (3, (0, 3), Strategy.REFORM, ())
    assert run.killed == [] and not [m for _, m in run.sent if isinstance(m, Stop)]
    for worker in (0, 3):
        assert run.filled == []  # worker 3 may still wait in generation 2's start: its connect must not return
        run.pool[worker].generation = 3  # its heartbeat names generation 3: it left generation 2's start
        run.feed(Progress(worker, run.pool[worker].step))
    assert run.filled == [FillSeats(2, "127.0.0.1:1002", (1,))]  # worker 2's seat in (0, 2, 3)
    run.join(step=10, tier="ram")
    run.commit(11)
    assert run.supervisor.recovery.failures == 2 and run.supervisor.survivor_restarts == 0 and run.ended is None
    assert run.result.strategies == [Strategy.START, Strategy.REFORM] and run.filled == [run.filled[0]]

    # Too few to go on (min_nprocs 3): the seat waits for a replacement, as when the controller starts spares.
    short = serving_four(tmp_path / "short", min_nprocs=3)
    short.lose(1)
    short.wait(0.1)
    short.lose(2)
    assert [f.generation for f in short.forms] == [1, 2] and short.filled == [] and short.killed == []


def test_a_failed_restore_reforms_the_same_members_once_and_a_step_read_from_the_next_tier_does_not(
    tmp_path: Path,
) -> None:
    run = started(tmp_path)
    run.lose(1)
    run.wait(0.1)
    run.join(step=10, tier="ram")
    assert len(run.forms) == 2
    run.feed(RestoreFailed(generation=2, step=10, reason="ram step 10 unreadable", recovered_from=Tier.DURABLE))
    assert len(run.forms) == 2  # the member read it from the durable tier instead
    run.feed(RestoreFailed(generation=2, step=10, reason="ram step 10 unreadable: bad checksum"))
    run.feed(RestoreFailed(generation=2, step=10, reason="file step 10 unreadable: bad checksum"))
    run.wait(0.5)  # the second attempt at step 11: after the retry policy's backoff
    form = run.forms[-1]
    assert len(run.forms) == 3 and (form.generation, form.members, form.strategy) == (3, (0, 2), Strategy.REFORM)
    run.join(step=9, tier="shm")
    assert [m.step for _, m in run.restores()[-2:]] == [9, 9]
    state = [e for e in run.events if isinstance(e, StateRestored)][-1]
    assert (state.step, state.lost_steps) == (9, 1)
    assert run.supervisor.recovery.failures == 1 and run.ended is None  # a damaged step is not a lost worker


def test_a_failure_past_the_budget_ends_the_run_and_so_does_a_group_that_never_forms(tmp_path: Path) -> None:
    run = started(tmp_path, max_failures=1)
    run.lose(1)
    run.wait(0.1)
    run.join(step=10, tier="ram")
    run.commit(12)
    run.lose(0)
    assert isinstance(run.ended, RecoveryError) and run.supervisor.done
    assert "2 failures exceed max_failures=1 (the last: worker 0: WorkerLost at step 13)" in str(run.ended)
    assert run.feed(Tick()) == [] and run.feed(WorkerChanged(2)) == []  # ended: nothing more is done

    both = started(tmp_path / "both", max_failures=1)
    both.feed(RegroupRequested(frozenset({0, 1}), "WorkerLost"))  # lost together: each counted, then one check
    assert both.kinds() == ["RecoveryStarted", "RecoveryStarted"] and "2 failures exceed" in str(both.ended)

    stalled = started(tmp_path / "stalled", max_failures=1, form_timeout_s=30.0)
    stalled.lose(1)
    stalled.wait(0.1)
    stalled.wait(29.0)
    assert stalled.ended is None  # not yet due
    stalled.wait(2.0)  # the new group never joins: counted as the second failure
    assert isinstance(stalled.ended, RecoveryError)
    why = (
        "2 failures exceed max_failures=1 (the last: not joined within 30.0 s (the slowest join so far took 0.1 s; "
        "raise --form-timeout or --start-timeout if joining compiles longer) in generation 2)"
    )
    assert why in str(stalled.ended), stalled.ended


def test_a_step_that_keeps_failing_is_retried_after_a_backoff_then_given_up(tmp_path: Path) -> None:
    run = started(tmp_path, spares=3, max_failures=10)
    run.hello(3, 4)  # the other spares ready too
    run.lose(1)
    run.wait(0.1)
    run.join(step=10, tier="ram")  # attempt 1 at step 11: retried at once
    assert run.forms[-1].members == (0, 2)
    run.lose(2)
    run.wait(0.1)
    assert len(run.forms) == 2  # attempt 2: after the policy's backoff of 0.5 s, no clock read but the test's
    run.wait(0.5)
    assert run.forms[-1].members == (0, 3)
    run.join(step=10, tier="ram")
    run.lose(3)
    run.wait(0.1)
    assert isinstance(run.ended, RecoveryError)
    assert "step 11 failed 3 times (worker 3: WorkerLost); giving up" in str(run.ended)


def test_survivors_waiting_for_a_replacement_are_not_judged_hung(tmp_path: Path) -> None:
    # Issue 30: no spare ready, so the re-forming waits for one to start; the survivor's committed step does not
    # move meanwhile, and it must not be taken for hung and killed.
    run = started(tmp_path, spares=0)
    run.lose(1)
    run.wait(0.1)
    assert len(run.forms) == 1 and run.supervisor.deadline is not None  # recruiting: a replacement starting
    for _ in range(12):
        run.now += 1.0
        run.monitor.observe(0, 10, (0.1, 0.0))  # heartbeats, no progress
        assert not [v for v in run.monitor.check() if isinstance(v, Hung)]
        run.feed(Tick())
    run.hello(2)
    assert run.forms[-1].members == (0, 2)


def test_spares_that_never_say_hello_end_the_run_at_the_spawn_timeout(tmp_path: Path) -> None:
    run = started(tmp_path, spares=0, spawn_timeout_s=20.0, min_nprocs=2)
    run.lose(1)
    run.wait(0.1)
    run.wait(21.0)
    assert isinstance(run.ended, LaunchError)
    assert "a replacement did not come together: 1 of 2 workers connected within 20.0 s (--spawn-timeout" in str(
        run.ended
    )


def test_a_restarting_worker_the_controller_did_not_start_is_told_to_exit(tmp_path: Path) -> None:
    run = started(tmp_path, strategy="restart")
    run.lose(1)
    run.wait(0.1)
    assert run.killed == [0]
    stops = [m for w, m in run.sent if w == 0 and isinstance(m, Stop)]
    assert stops and stops[0].exit_code != 0  # not ours to kill (a record without a process): asked to exit


def test_the_run_finishes_once_every_member_finished(tmp_path: Path) -> None:
    run = started(tmp_path)
    run.commit(TARGET)
    for worker in run.members:
        run.pool[worker].finished = Finished(worker=worker, generation=1, step=TARGET, digest="d")
        run.feed(MemberFinished(worker))
    assert run.finished and run.supervisor.done and run.supervisor.stopped


def test_joining_may_take_as_long_as_a_real_compile_and_a_stall_says_how_long_joins_took(tmp_path: Path) -> None:
    run = Run(tmp_path, start_timeout_s=300.0, form_timeout_s=20.0, max_failures=1)
    run.spawn(3)
    run.feed(Start())
    run.hello(0, 1)
    run.wait(200.0)  # the first group compiles for minutes (a real model): within the start-up time
    assert run.ended is None and len(run.forms) == 1
    run.join(join_s=200.0)
    run.hello(2)
    run.commit(10)
    run.lose(1)
    run.wait(0.1)
    assert run.forms[-1].members == (0, 2)
    run.wait(300.0)  # a re-formed group gets twice the slowest join seen: 400 s, not 20
    assert run.ended is None
    run.wait(101.0)  # then it is a stall, which names the times (with no budget left, it ends the run)
    assert isinstance(run.ended, RecoveryError)
    assert "not joined within 400.0 s (the slowest join so far took 200.0 s" in str(run.ended), run.ended


def test_each_step_gets_the_loss_of_the_heartbeat_that_reported_it_even_when_read_late(tmp_path: Path) -> None:
    # The shell records a heartbeat's step in the worker's record at once and feeds the supervisor through a
    # queue: behind it, the supervisor finds the record at a newer step than the heartbeat it handles.
    run = started(tmp_path)
    for worker in run.members:
        run.pool[worker].step = 12
    for step in (11, 12):
        for worker in run.members:
            run.feed(Progress(worker, step, 0.1, loss=step / 100))
    completed = {e.step: e.loss for e in run.events if isinstance(e, StepCompleted)}
    assert completed == {11: 0.11, 12: 0.12}


def test_a_failed_workers_log_is_quoted_from_its_last_traceback_or_else_by_its_last_20_lines(tmp_path: Path) -> None:
    log = tmp_path / "worker-2.log"
    lines = [f"line {i}" for i in range(30)]
    # A C++ abort leaves no traceback: the 20 lines before it say which generation the worker was in.
    abort = "terminate called after throwing an instance of 'gloo::EnforceNotMet'"
    log.write_text("\n".join([*lines, abort]))
    assert log_tail(log).splitlines() == [*lines[-19:], abort]
    log.write_text("\n".join([*lines, "Traceback (most recent call last):", '  File "x.py"', "ValueError: bad"]))
    assert log_tail(log) == 'Traceback (most recent call last):\n  File "x.py"\nValueError: bad'
    assert log_tail(tmp_path / "missing.log").startswith("(no log:")


def test_with_no_ready_spare_the_group_goes_on_smaller_at_once_and_grows_back_when_one_joins(tmp_path: Path) -> None:
    """Issue 61: a lost worker whose replacement is still starting (a cold start) is not waited for where
    min_nprocs allows: the survivors form the next generation at once, the reason says why, and the group grows
    back once the replacement has said hello (before: it waited up to --spawn-timeout, idle)."""
    run = Run(tmp_path, nprocs=3, spares=0, min_nprocs=2, spawn_timeout_s=60.0)
    run.spawn(3)
    run.feed(Start())
    run.hello(0, 1, 2)
    run.join()
    run.commit(10)
    run.lose(1)
    run.wait(0.1)  # settling after the loss; no time passes beyond it
    assert [f.members for f in run.forms] == [(0, 1, 2), (0, 2)]
    assert run.now < 1.0  # not the spawn timeout's 60 s
    assert "going on with 2 of 3 workers (no ready spare for its seat; at least 2)" in reasons(run)[-1]
    run.join(step=10, tier="ram")
    run.commit(12)
    replacement = max(run.pool.procs)
    run.hello(replacement)  # the replacement, up at last: the group grows back at a planned step
    assert run.forms[-1].members == (0, 2, replacement) and run.forms[-1].strategy == Strategy.GROW


def reasons(run: Run) -> list[str]:
    return [e.reason for e in run.events if isinstance(e, GroupForming)]


def test_every_re_forming_says_why_in_its_event(tmp_path: Path) -> None:
    """Issue 61: each decision's reason is in the event log (``GroupForming.reason``, the ending's error): a loss,
    a hang, a loss while the next group forms, a loss during its restore, a group that never forms, a spent
    budget."""
    lost = "process 7 exited with -9"
    run = started(tmp_path / "loss", spares=3)
    run.hello(3, 4)
    run.feed(WorkerFailed(1, "WorkerLost", lost))
    run.wait(0.1)
    assert reasons(run) == [f"worker 1: WorkerLost ({lost})"]
    # While generation 2 forms (worker 0 in it already): the rest re-form, the reason says which and when.
    run.pool[0].generation = 2
    run.feed(Progress(0, run.pool[0].step))
    run.feed(WorkerFailed(2, "WorkerHung", "no progress past step 10 for 5.00 s"))
    assert reasons(run)[-1] == "worker 2: WorkerHung (no progress past step 10 for 5.00 s), while generation 2 formed"
    # During the restore (every member joined, RestoreStep sent, nothing committed yet).
    run.join(step=10, tier="ram")
    run.feed(WorkerFailed(3, "WorkerLost", "silent for 2.10 s"))
    run.wait(0.1)
    run.wait(0.5)  # step 11 failed twice: the retry policy's backoff first
    assert reasons(run)[-1] == "worker 3: WorkerLost (silent for 2.10 s)"
    assert run.killed == [1, 2, 3]

    # A group that never forms: restarted, and why.
    stalled = started(tmp_path / "stalled", form_timeout_s=30.0)
    stalled.lose(1)
    stalled.wait(0.1)
    stalled.wait(31.0)
    stalled.hello(*[p.worker for p in stalled.pool if p.hello is None and not p.gone])  # started for it
    assert stalled.forms[-1].strategy == Strategy.RESTART
    assert reasons(stalled)[-1].startswith("generation 2 did not form (not joined within 30.0 s")
    assert reasons(stalled)[-1].endswith("every worker replaced")

    # A spent budget: the run's error names the last loss and what was seen.
    spent = started(tmp_path / "spent", max_failures=1)
    spent.lose(1)
    spent.wait(0.1)
    spent.join(step=10, tier="ram")
    spent.feed(WorkerFailed(0, "WorkerLost", lost))
    assert isinstance(spent.ended, RecoveryError)
    assert f"(the last: worker 0: WorkerLost ({lost}) at step 11)" in str(spent.ended)
