"""A planned drain in the controller's supervisor, driven alone (no processes): the members on a host under
maintenance leave at a planned step, nothing is counted, no worker of the host is seated until it is readmitted."""

from __future__ import annotations

from pathlib import Path

from test_supervisor import TARGET, Run

from runtime.cluster.config import Strategy
from runtime.cluster.controller.supervision import DrainRequested, Readmitted, Start, WorkerChanged
from runtime.cluster.protocol import EXIT_REPLACE, Hello, Stop
from runtime.core.events import GroupFormed


def hello(run: Run, worker: int, instance: str) -> None:
    run.pool[worker].hello = Hello(worker=worker, pid=1, target_steps=TARGET, instance=instance)
    run.monitor.register(worker)
    run.feed(WorkerChanged(worker))


def training(tmp_path: Path, *, spares: int = 0) -> Run:
    """Four members, worker k on host k, trained to step 10 (and ``spares`` ready spares on host 9)."""
    run = Run(tmp_path, nprocs=4, min_nprocs=3, spares=spares)
    run.spawn(4 + spares)
    run.feed(Start())
    for worker in range(4 + spares):
        hello(run, worker, f"host{worker}" if worker < 4 else "host9")
    run.join()
    run.commit(10)
    run.events.clear()
    return run


def test_a_drained_member_leaves_at_a_planned_step_and_the_host_rejoins_only_when_readmitted(tmp_path: Path) -> None:
    run = training(tmp_path)
    run.feed(DrainRequested("host2", "maintenance of host2"))
    form = run.forms[-1]
    assert (form.members, form.strategy, form.at_step) == ((0, 1, 3), Strategy.DRAIN, 13)
    stop = [m for w, m in run.sent if w == 2 and isinstance(m, Stop)]
    assert stop == [Stop(reason=stop[0].reason, exit_code=EXIT_REPLACE, at_step=13)]  # leaves at the same step
    run.commit(13)
    run.join(step=13, tier="ram")
    formed = [e for e in run.events if isinstance(e, GroupFormed)][-1]
    assert (formed.members, formed.restore_step, formed.instances) == ((0, 1, 3), 13, ("host0", "host1", "host3"))
    assert run.supervisor.recovery.failures == 0 and run.kinds().count("RecoveryStarted") == 0
    assert run.result.world_size_history == [4, 3] and run.result.recoveries == []

    run.spawn(1)  # worker 4, started again on host 2 by its scheduler while the maintenance goes on
    hello(run, 4, "host2")
    assert run.forms[-1] is form  # not seated: its host is cordoned
    run.feed(Readmitted("host2"))
    grow = run.forms[-1]
    assert (grow.members, grow.strategy, grow.at_step) == ((0, 1, 3, 4), Strategy.GROW, 16)
    assert run.supervisor.recovery.failures == 0 and run.ended is None


def test_a_ready_spare_takes_the_drained_members_place_at_the_planned_step(tmp_path: Path) -> None:
    run = training(tmp_path, spares=1)
    run.feed(DrainRequested("host1", "maintenance of host1"))
    form = run.forms[-1]
    assert (form.members, form.strategy, form.at_step) == ((0, 4, 2, 3), Strategy.DRAIN, 13)
    assert run.supervisor.recovery.failures == 0


def test_a_drain_that_would_leave_too_few_or_end_after_the_run_does_nothing(tmp_path: Path) -> None:
    run = training(tmp_path)
    run.feed(DrainRequested("host1", "maintenance of host1"))
    run.commit(13)
    run.join(step=13, tier="ram")
    forms = len(run.forms)
    run.feed(DrainRequested("host3", "maintenance of host3"))  # 2 left, min_nprocs is 3
    assert len(run.forms) == forms and run.supervisor.group.members == [0, 2, 3]

    late = training(tmp_path / "late")
    late.commit(TARGET - 3)
    late.feed(DrainRequested("host2", "maintenance of host2"))  # the run ends before a planned step could come
    assert len(late.forms) == 1
