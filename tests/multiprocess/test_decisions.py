"""The supervisor's decisions, each from a state written down (issue 61): the group, the workers' records and the
phase are literals, one input goes in, and the test reads the actions and the reason that come out. No processes,
sockets or clocks: the state is not reached by replaying a run's history (``test_supervisor.py`` does that)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from test_supervisor import TARGET, Run

from elastic_runtime.cluster.config import Strategy
from elastic_runtime.cluster.controller.supervision import (
    Action,
    DrainRequested,
    EndRun,
    Forming,
    Idle,
    Input,
    Joining,
    Kill,
    LeaveRequested,
    Phase,
    Place,
    Publish,
    Send,
    SendForm,
    Settling,
    Status,
    Tick,
    WorkerFailed,
)
from elastic_runtime.cluster.protocol import Hello, Joined, Stop
from elastic_runtime.core.errors import RecoveryError
from elastic_runtime.core.events import GroupForming, RecoveryStarted


def at(
    tmp_path: Path,
    phase: Phase,
    *,
    members: tuple[int, ...] = (0, 1, 2),
    spares: tuple[int, ...] = (3,),
    step: int = 10,
    generation: int = 1,
    failures: int = 0,
    now: float = 100.0,
    **config: Any,
) -> Run:
    """A supervisor at ``phase`` whose generation ``generation`` of ``members`` joined and committed ``step``
    (restored unless it is ``Joining``), with ``spares`` ready, worker k on host k, and ``failures`` counted."""
    run = Run(tmp_path, nprocs=len(members), spares=len(spares), **config)
    run.now = now
    sup = run.supervisor
    for worker in (*members, *spares):
        proc = run.pool.admit(worker)
        proc.hello = Hello(worker=worker, pid=100 + worker, target_steps=TARGET, instance=f"host{worker}")
        run.monitor.register(worker)
    for worker in members:
        sup.places[worker] = Status.MEMBER
        proc = run.pool[worker]
        proc.place(Status.MEMBER)
        proc.joined = Joined(worker=worker, generation=generation, best_step=step, tier="ram", join_s=0.1)
        proc.step, proc.generation = step, generation
    sup.group.generation = generation - 1
    sup.group.new_generation(members)
    sup.group.restore(step)
    sup.restored = not isinstance(phase, Joining)
    sup.recovery.failures = failures
    sup.phase = phase
    run.next_worker = max((*members, *spares)) + 1
    return run


def decide(run: Run, event: Input, *, after_s: float = 0.0) -> list[Action]:
    """The actions for ``event``, ``after_s`` seconds on, carried out on the test's records."""
    run.now += after_s
    return run.feed(event)


def forming_reason(actions: list[Action]) -> str:
    [reason] = [a.event.reason for a in actions if isinstance(a, Publish) and isinstance(a.event, GroupForming)]
    return reason


def test_a_loss_kills_and_unseats_the_worker_settles_then_re_forms_with_a_spare_and_says_why(tmp_path: Path) -> None:
    run = at(tmp_path, Idle())
    lost = decide(run, WorkerFailed(1, "WorkerLost", "process exited with -9"))
    assert lost[0] == Kill(1, "WorkerLost: process exited with -9")
    assert Place(1, Status.LOST) in lost
    [started] = [a.event for a in lost if isinstance(a, Publish)]
    assert isinstance(started, RecoveryStarted) and started.cause == "WorkerLost"
    assert isinstance(run.supervisor.phase, Settling)  # one re-forming for the losses that come with it
    formed = decide(run, Tick(), after_s=0.1)
    [form] = [a for a in formed if isinstance(a, SendForm)]
    assert (form.members, form.strategy, form.at_step) == ((0, 3, 2), Strategy.REFORM, -1)  # in the lost seat
    assert Place(3, Status.MEMBER) in formed
    assert forming_reason(formed) == "worker 1: WorkerLost (process exited with -9)"


def test_a_hang_is_a_loss_whose_reason_says_hung(tmp_path: Path) -> None:
    run = at(tmp_path, Idle())
    hung = decide(run, WorkerFailed(2, "WorkerHung", "no step committed for 5.0 s"))
    assert hung[0] == Kill(2, "WorkerHung: no step committed for 5.0 s")
    formed = decide(run, Tick(), after_s=0.1)
    assert forming_reason(formed) == "worker 2: WorkerHung (no step committed for 5.0 s)"


def test_two_losses_at_once_are_one_re_forming_that_names_both(tmp_path: Path) -> None:
    run = at(tmp_path, Idle(), spares=(3, 4))
    decide(run, WorkerFailed(0, "WorkerLost", "process exited with -9"))
    assert not [a for a in decide(run, WorkerFailed(2, "WorkerLost", "silent for 0.8 s")) if isinstance(a, SendForm)]
    formed = decide(run, Tick(), after_s=0.1)
    [form] = [a for a in formed if isinstance(a, SendForm)]
    assert form.members == (3, 1, 4)  # the spares take the lost seats
    assert forming_reason(formed) == (
        "worker 0: WorkerLost (process exited with -9); worker 2: WorkerLost (silent for 0.8 s)"
    )


def test_a_loss_while_the_group_forms_after_the_others_got_past_jaxs_start_re_forms_without_it(tmp_path: Path) -> None:
    forming = Forming(Strategy.REFORM, "worker 5: WorkerLost at step 11", started=99.0, survivors=(0, 1))
    run = at(tmp_path, Joining(forming, deadline=120.0), generation=2)
    run.pool[2].joined = None  # 0 and 1 joined generation 2: every member got past JAX's start
    actions = decide(run, WorkerFailed(2, "WorkerLost", "process exited with -9"))
    [form] = [a for a in actions if isinstance(a, SendForm)]
    assert (form.generation, form.members) == (3, (0, 1, 3))
    assert forming_reason(actions) == "worker 2: WorkerLost (process exited with -9), while generation 2 formed"


def test_a_loss_during_the_restore_is_a_failed_attempt_at_the_next_step(tmp_path: Path) -> None:
    run = at(tmp_path, Idle(), generation=2, failures=1)  # restored step 10, nothing committed since
    decide(run, WorkerFailed(1, "WorkerLost", "process exited with 1"))
    formed = decide(run, Tick(), after_s=0.1)
    assert [a.members for a in formed if isinstance(a, SendForm)] == [(0, 3, 2)]
    assert forming_reason(formed) == "worker 1: WorkerLost (process exited with 1)"
    assert run.supervisor.recovery.failures == 2 and run.ended is None


def test_a_loss_past_the_budget_ends_the_run_with_why_and_the_lost_workers_log(tmp_path: Path) -> None:
    run = at(tmp_path, Idle(), failures=2, max_failures=2)
    (run.pool.logs / "worker-1.log").write_text("Traceback (most recent call last):\nMemoryError\n")
    actions = decide(run, WorkerFailed(1, "WorkerLost", "process exited with -9"))
    [ended] = [a.error for a in actions if isinstance(a, EndRun)]
    assert isinstance(ended, RecoveryError) and ended.last_committed_step == 10
    assert str(ended).startswith(
        "3 failures exceed max_failures=2 (the last: worker 1: WorkerLost (process exited with -9) at step 11)"
    )
    assert "MemoryError" in str(ended) and run.supervisor.done
    assert not [a for a in actions if isinstance(a, SendForm)]


def test_a_maintenance_drain_takes_the_hosts_worker_out_at_a_planned_step(tmp_path: Path) -> None:
    run = at(tmp_path, Idle())
    actions = decide(run, DrainRequested("host1", "maintenance of host1 from 12:00"))
    [form] = [a for a in actions if isinstance(a, SendForm)]
    assert (form.members, form.strategy, form.at_step) == ((0, 3, 2), Strategy.DRAIN, 13)
    [(worker, stop)] = [(a.worker, a.message) for a in actions if isinstance(a, Send)]
    assert worker == 1 and isinstance(stop, Stop) and stop.at_step == 13
    assert Place(1, Status.STOPPED) in actions and not [a for a in actions if isinstance(a, Kill)]
    assert forming_reason(actions) == "drain: maintenance of host1 from 12:00"
    assert run.supervisor.recovery.failures == 0  # planned: no failure


def test_a_straggler_let_go_leaves_at_a_planned_step_and_a_spare_takes_its_seat(tmp_path: Path) -> None:
    run = at(tmp_path, Idle())
    why = "straggler: 1.80x slower, 0.040 s a step; replaced by a ready spare"
    actions = decide(run, LeaveRequested(2, why))
    [form] = [a for a in actions if isinstance(a, SendForm)]
    assert (form.members, form.strategy, form.at_step) == ((0, 1, 3), Strategy.DRAIN, 13)
    [stop] = [a.message for a in actions if isinstance(a, Send) and a.worker == 2]
    assert isinstance(stop, Stop) and stop.exit_code == 0  # it leaves; the controller starts its own spares
    assert forming_reason(actions) == f"drain: worker 2 leaves: {why}"
    assert run.supervisor.recovery.failures == 0
