"""A planned drain in the controller's supervisor, driven alone (no processes): the members on a host under
maintenance leave at a planned step, nothing is counted, no worker of the host is seated until it is readmitted;
a worker that asked to leave (SIGTERM) goes the same way and is told to exit 0 (under ``launch``)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

import anyio
from test_supervisor import TARGET, Run

from elastic_runtime.cluster.config import LaunchConfig, Strategy
from elastic_runtime.cluster.controller.actions import file_cadence
from elastic_runtime.cluster.controller.processes import WorkerProcess
from elastic_runtime.cluster.controller.supervision import (
    DrainRequested,
    LeaveRequested,
    Readmitted,
    Start,
    Status,
    TopUpSpares,
    WorkerChanged,
)
from elastic_runtime.cluster.controller.workers import renew_leases
from elastic_runtime.cluster.protocol import EXIT_REPLACE, Hello, Joined, Lease, Message, Stop
from elastic_runtime.core.events import GroupFormed, GroupForming

if TYPE_CHECKING:
    from elastic_runtime.cluster.controller.connection import Connection
    from elastic_runtime.cluster.controller.shell import Controller


def hello(run: Run, worker: int, instance: str) -> None:
    run.pool[worker].hello = Hello(worker=worker, pid=1, target_steps=TARGET, instance=instance)
    run.monitor.register(worker)
    run.feed(WorkerChanged(worker))


def training(tmp_path: Path, *, spares: int = 0, min_nprocs: int = 3) -> Run:
    """Four members, worker k on host k, trained to step 10 (and ``spares`` ready spares on host 9)."""
    run = Run(tmp_path, nprocs=4, min_nprocs=min_nprocs, spares=spares)
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
    [forming] = [e.reason for e in run.events if isinstance(e, GroupForming)]
    assert forming == (
        "drain: maintenance of host2; going on with 3 of 4 workers (no ready spare for its seat; at least 3), "
        "growing back once a replacement joins"
    )
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


def stops(run: Run, worker: int) -> list[Stop]:
    return [m for w, m in run.sent if w == worker and isinstance(m, Stop)]


def test_a_member_that_asks_to_leave_goes_at_a_planned_step_a_spare_takes_its_seat_and_it_exits_0(
    tmp_path: Path,
) -> None:
    run = training(tmp_path, spares=1, min_nprocs=4)
    run.feed(LeaveRequested(1, "it got SIGTERM"))
    form = run.forms[-1]
    assert (form.members, form.strategy, form.at_step) == ((0, 4, 2, 3), Strategy.DRAIN, 13)
    [stop] = stops(run, 1)
    assert (stop.exit_code, stop.at_step) == (0, 13) and "SIGTERM" in stop.reason
    run.commit(13)
    run.join(step=13, tier="ram")
    assert run.supervisor.recovery.failures == 0 and run.kinds().count("RecoveryStarted") == 0
    assert run.result.recoveries == [] and run.supervisor.departures == {}


def test_a_member_that_asks_to_leave_with_no_spare_ready_waits_for_one_started_for_it(tmp_path: Path) -> None:
    run = training(tmp_path, min_nprocs=4)
    forms = len(run.forms)
    run.feed(LeaveRequested(2, "it got SIGTERM"))
    assert len(run.forms) == forms and stops(run, 2) == []  # not without a seat filled
    assert run.next_worker == 5  # a spare was started for it, once
    run.commit(11)
    assert run.next_worker == 5
    hello(run, 4, "host9")
    form = run.forms[-1]
    assert (form.members, form.strategy, form.at_step) == ((0, 1, 4, 3), Strategy.DRAIN, 14)
    assert stops(run, 2)[0].exit_code == 0 and run.supervisor.recovery.failures == 0


def test_a_spare_that_asks_to_leave_is_told_to_exit_0_at_once(tmp_path: Path) -> None:
    run = training(tmp_path, spares=1)
    forms = len(run.forms)
    actions = run.feed(LeaveRequested(4, "it got SIGTERM"))
    [stop] = stops(run, 4)
    assert (stop.exit_code, stop.at_step) == (0, -1)
    assert len(run.forms) == forms and run.supervisor.recovery.failures == 0
    assert TopUpSpares() in actions  # its successor is started


def test_a_worker_a_cluster_started_that_asks_to_leave_is_told_to_exit_for_a_replacement(tmp_path: Path) -> None:
    run = training(tmp_path)
    run.service_mode()  # the service mode now: a Kubernetes Job takes a pod that exits 0 for done
    run.feed(LeaveRequested(1, "it got SIGTERM"))
    form = run.forms[-1]
    assert (form.members, form.strategy, form.at_step) == ((0, 2, 3), Strategy.DRAIN, 13)
    assert stops(run, 1)[0].exit_code == EXIT_REPLACE and run.supervisor.recovery.failures == 0


def test_a_member_that_ends_before_its_planned_step_is_a_loss_and_the_planned_group_forms_at_once(
    tmp_path: Path,
) -> None:
    # Worker 1 asked to leave at step 13 and was killed at step 11: the others' next collective waits for it in
    # vain, so step 13 never comes. Its end is a counted loss, and the members still stepping with the old group
    # (not spare 4, seated already) are told to join the planned generation now.
    run = training(tmp_path, spares=1, min_nprocs=4)
    run.feed(LeaveRequested(1, "it got SIGTERM"))
    planned = run.forms[-1]
    run.commit(11)
    run.pool[1].place(Status.LOST)  # its process ended (the shell marks it gone, then says so)
    run.feed(WorkerChanged(1))
    now = run.forms[-1]
    assert (now.generation, now.members, now.at_step, now.seats) == (planned.generation, (0, 4, 2, 3), -1, (0, 2, 3))
    assert run.supervisor.recovery.failures == 1 and run.kinds()[-2:] == ["WorkerLost", "RecoveryStarted"]
    run.join(step=11, tier="ram")
    formed = [e for e in run.events if isinstance(e, GroupFormed)][-1]
    assert (formed.members, formed.restore_step) == ((0, 4, 2, 3), 11) and run.ended is None


def test_a_member_that_leaves_at_its_planned_step_is_no_loss(tmp_path: Path) -> None:
    run = training(tmp_path, spares=1, min_nprocs=4)
    run.feed(LeaveRequested(1, "it got SIGTERM"))
    assert [e.reason for e in run.events if isinstance(e, GroupForming)] == ["drain: worker 1 leaves: it got SIGTERM"]
    forms = len(run.forms)
    run.commit(13)
    run.pool[1].step = 13  # its heartbeat at that step came before its connection closed
    run.feed(WorkerChanged(1))
    assert len(run.forms) == forms and run.supervisor.recovery.failures == 0 and "WorkerLost" not in run.kinds()


def test_a_member_whose_last_heartbeat_was_lost_with_it_left_at_its_step_if_another_member_got_there(
    tmp_path: Path,
) -> None:
    # Worker 1 ends at its planned step 13 killed (-9), its heartbeat of step 13 lost with it (it said 12). The
    # others committed step 13, whose collectives needed it, and one joined the planned generation already: told
    # to join again it would join the same coordination service twice and end (soak seed 6800249). So: no loss,
    # no Form again, whichever of the others' reports came first.
    for first in ("step", "joined"):
        run = training(tmp_path / first, spares=1, min_nprocs=4)
        run.feed(LeaveRequested(1, "it got SIGTERM"))
        forms = len(run.forms)
        run.commit(12)
        if first == "step":
            run.pool[2].step = 13
        else:
            run.pool[3].joined = Joined(
                worker=3, generation=run.forms[-1].generation, best_step=13, tier="ram", join_s=0.1
            )
        run.pool[1].place(Status.LOST)
        run.feed(WorkerChanged(1))
        assert len(run.forms) == forms and run.supervisor.recovery.failures == 0, first
        assert "WorkerLost" not in run.kinds(), first


def test_a_replica_file_of_every_step_only_where_a_lost_process_state_may_be_nowhere_else() -> None:
    def config(**overrides: Any) -> LaunchConfig:
        return LaunchConfig(command=["python", "train.py"], nprocs=4, **overrides)

    assert file_cadence(config(), members=4) == 10  # the default: every 10th step
    assert file_cadence(config(slices=2), members=4) == 1
    # Every process holds the whole state, re-formed in place: the cadence asked for.
    assert file_cadence(config(replica_file_every=10), members=4) == 10
    assert file_cadence(config(replica_file_every=10, slices=2), members=4) == 1  # sharded over a slice of 2
    assert file_cadence(config(replica_file_every=10), members=1) == 1  # a group of one
    # Every process restarted; a loss that ends the run (a rerun reads the files).
    assert file_cadence(config(replica_file_every=10, strategy=Strategy.RESTART), members=4) == 1
    assert file_cadence(config(replica_file_every=10, max_failures=0), members=4) == 1


def leases_sent(run: Run) -> list[int]:
    """The workers one round of the controller's ``renew_leases`` sends a lease to (each that said hello is
    connected)."""
    sent: list[int] = []

    class Server:
        async def send(self, proc: WorkerProcess, message: Message) -> None:
            assert isinstance(message, Lease) and message.seconds == run.supervisor.config.heartbeat_timeout_s * 0.75
            sent.append(proc.worker)

    for proc in run.pool:
        if proc.hello is not None:
            proc.stream = proc.stream or cast("Connection", object())
    controller = SimpleNamespace(config=run.supervisor.config, supervisor=run.supervisor, pool=run.pool)
    controller.server, controller.stopping = Server(), False

    async def one_round() -> None:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(renew_leases, cast("Controller", controller))
            await anyio.wait_all_tasks_blocked()  # sent to each, now asleep for the heartbeat interval
            tasks.cancel_scope.cancel()

    anyio.run(one_round)
    return sorted(sent)


def test_a_drained_member_keeps_its_lease_until_it_leaves_at_its_planned_step(tmp_path: Path) -> None:
    # Judged gone at the Form, it still steps with the old group to step 13: a lease that ran out before would
    # stop it short, and its peers would wait for it in that step's collectives.
    run = training(tmp_path)
    run.feed(DrainRequested("host2", "maintenance of host2"))
    assert run.pool[2].gone and 2 in run.supervisor.departing
    assert leases_sent(run) == [0, 1, 2, 3]
    run.commit(13)
    run.pool[2].step = 13
    run.feed(WorkerChanged(2))  # it left at its planned step
    assert 2 not in run.supervisor.departing and leases_sent(run) == [0, 1, 3]
