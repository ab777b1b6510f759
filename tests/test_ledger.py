"""The step ledger without processes or waiting: commits, save decisions, failures, restores and the budget."""

from __future__ import annotations

import math

import pytest
from jax.errors import JaxRuntimeError

from elastic_runtime.core.cadence import EveryN, EveryStep, SnapshotCadence
from elastic_runtime.core.events import DeviceLost, RecoveryCompleted, SliceLost, StepFailed
from elastic_runtime.core.ledger import StepLedger


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


LOST = JaxRuntimeError("DATA_LOSS: a device went away")


def run_to(ledger: StepLedger, last: int) -> list[tuple[int, tuple[str, ...]]]:
    """Commit the steps after the ledger's up to ``last``, one batch each; the tiers due at each."""
    due = []
    for step in range(ledger.step + 1, last + 1):
        committed = ledger.commit(step, data_position=ledger.data_position + 1)
        assert committed.events == ()
        due.append((step, committed.due))
    return due


def test_a_failure_keeps_the_committed_step_and_the_first_commit_past_the_restore_ends_it() -> None:
    clock = Clock()
    ledger = StepLedger("worker", max_failures=3, policies={"durable": EveryN(5)}, clock=clock)
    assert [step for step, due in run_to(ledger, 10) if due] == [5, 10]
    noted = ledger.fail(LOST, step=11, lost_devices=(3,))
    assert isinstance(noted.event, DeviceLost) and noted.event.devices == (3,) and noted.event.step == 11
    assert noted.started is not None and noted.started.cause == "DeviceLost"
    assert noted.started.last_committed_step == 10 and noted.started.source == "worker"
    assert (ledger.step, ledger.data_position, ledger.recovering, ledger.over_budget) == (10, 10, True, False)
    restored = ledger.restored(8, data_position=8, restored_from="ram", seconds=0.25)
    assert (restored.step, restored.restored_from, restored.lost_steps, restored.seconds) == (8, "ram", 2, 0.25)
    assert (ledger.step, ledger.data_position, ledger.high_water) == (8, 8, 10)
    clock.now = 101.5
    committed = ledger.commit(9, data_position=9, mesh_shape={"data": 3})
    [done] = committed.events
    assert isinstance(done, RecoveryCompleted) and done.step == 9 and done.failed_step == 11
    assert (done.recovery_s, done.lost_steps, done.restored_from, done.mesh_shape) == (1.5, 2, "ram", {"data": 3})
    assert not ledger.recovering
    # The cadence counts from the restored step: step 10 is a multiple again, and it is saved again.
    assert run_to(ledger, 11) == [(10, ("durable",)), (11, ())]


def test_a_failure_during_a_recovery_joins_it_and_its_restore_starts_over() -> None:
    clock = Clock()
    ledger = StepLedger("executor", max_failures=3, clock=clock)
    run_to(ledger, 6)
    first = ledger.fail(LOST, step=7)
    assert first.started is not None and first.started.last_committed_step == 6
    ledger.restored(6, data_position=6, restored_from="ram", seconds=0.1)
    clock.now = 102.0
    # Lost again before any step past the restore committed: the same recovery, announced again, counted.
    again = ledger.fail(
        JaxRuntimeError("DATA_LOSS: slice gone"), step=7, lost_devices=(4, 5), slices=(2,), slice_size=2
    )
    assert isinstance(again.event, SliceLost) and again.event.slices == (2,)
    assert again.started is not None and again.started.cause == "SliceLost"
    assert ledger.recovery.failures == 2 and not ledger.over_budget
    # A step the lost mesh still committed meanwhile ends nothing: the second restore is not done.
    assert ledger.commit(7, data_position=7).events == ()
    clock.now = 103.0
    ledger.restored(5, data_position=5, restored_from="disk", seconds=0.2)
    [done] = ledger.commit(6, data_position=6).events
    assert isinstance(done, RecoveryCompleted)
    assert (done.cause, done.failed_step, done.recovery_s) == ("DeviceLost", 7, 3.0)  # from the first failure
    assert (done.restored_from, done.lost_steps) == ("disk", 2)  # the high water was 7


def test_a_failed_restore_moves_nothing_and_the_recovery_gives_up_at_the_committed_step() -> None:
    clock = Clock()
    ledger = StepLedger("executor", max_failures=3, policies={"ram": EveryStep()}, clock=clock)
    run_to(ledger, 5)
    ledger.fail(LOST, step=6)
    # The restore read nothing: the books are as the failure left them, and no commit ends the recovery.
    retry = ledger.recovery.attempt_failed(6)
    assert (retry.step, retry.attempts, retry.failures) == (6, 1, 1)
    assert (ledger.step, ledger.data_position, ledger.high_water, ledger.recovering) == (5, 5, 5, True)
    assert ledger.due(6) == ("ram",)  # the cadence was not restarted either
    failed = ledger.give_up("no tier of ['ram'] holds a snapshot to restore step 6 from")
    assert (failed.step, failed.source) == (5, "executor")
    assert failed.reason == failed.message == "no tier of ['ram'] holds a snapshot to restore step 6 from"


def test_with_nothing_to_restore_from_the_run_starts_again_from_the_initial_state_and_counts_the_loss() -> None:
    ledger = StepLedger("executor", max_failures=1, policies={"ram": SnapshotCadence(3)}, clock=Clock())
    run_to(ledger, 4)
    ledger.fail(LOST, step=5)
    restored = ledger.restored(0, data_position=0, restored_from="init", seconds=0.0)
    assert (restored.step, restored.lost_steps, ledger.step, ledger.data_position) == (0, 4, 0, 0)
    [done] = ledger.commit(1, data_position=1).events
    assert isinstance(done, RecoveryCompleted) and done.restored_from == "init" and done.lost_steps == 4


def test_the_budget_counts_every_failure_and_the_one_past_it_ends_the_run() -> None:
    clock = Clock()
    ledger = StepLedger("executor", max_failures=1, clock=clock)
    run_to(ledger, 3)
    ledger.fail(LOST, step=4)
    ledger.restored(3, data_position=3, restored_from="ram", seconds=0.0)
    assert not ledger.over_budget and len(ledger.commit(4, data_position=4).events) == 1
    second = ledger.fail(LOST, step=5)
    assert second.started is not None and ledger.over_budget and ledger.recovery.failures == 2
    failed = ledger.give_up(f"{ledger.recovery.failures} failures exceed max_failures=1")
    assert failed.step == 4 and failed.reason == "2 failures exceed max_failures=1"


def test_an_error_in_the_users_step_is_classified_once_and_counts_against_nothing() -> None:
    ledger = StepLedger("executor", max_failures=0, clock=Clock())
    run_to(ledger, 2)
    noted = ledger.fail(ZeroDivisionError("division by zero"), step=3)
    assert isinstance(noted.event, StepFailed) and noted.started is None
    assert noted.event.error_type == "ZeroDivisionError" and noted.event.step == 3
    assert not ledger.recovering and not ledger.over_budget and ledger.step == 2


def test_every_step_every_n_and_young_daly_decide_the_tiers_due_at_each_commit() -> None:
    cadence = SnapshotCadence(1, mtbf_s=60.0)
    ledger = StepLedger("worker", policies={"shm": EveryStep(), "durable": EveryN(4), "ram": cadence}, clock=Clock())
    due = dict(run_to(ledger, 4))
    assert due == {1: ("shm", "ram"), 2: ("shm", "ram"), 3: ("shm", "ram"), 4: ("shm", "durable", "ram")}
    # Young-Daly: a step of 10 ms and a copy of 2 ms with failures every minute: one copy per 49 steps.
    cadence.stepped(0.01)
    cadence.copied(0.002)
    assert cadence.every == round(math.sqrt(2 * 0.002 * 60.0) / 0.01) == 49
    ram = [step for step, tiers in run_to(ledger, 60) if "ram" in tiers]
    assert ram == [53]  # 49 steps after the last copy, at step 4


def test_a_due_save_skipped_counts_as_taken_and_tiers_decided_at_dispatch_wait_for_taken() -> None:
    ledger = StepLedger("executor", policies={"ram": SnapshotCadence(3), "disk": EveryN(5)}, at_dispatch=("ram",))
    # Each step is asked about as it is dispatched; a copy that could not be queued is not taken.
    for step in range(1, 8):
        if "ram" in ledger.due(step) and step != 3:
            ledger.taken("ram", step)
        committed = ledger.commit(step, data_position=step)
        assert committed.due == (("disk",) if step == 5 else ())  # the RAM tier is no commit's to decide
    assert ledger.due(8) == ()  # the copy not queued at step 3 was taken at 4, the next one at 7
    assert ledger.due(10) == ("ram", "disk")


def test_a_restore_restarts_every_cadence_from_the_restored_step() -> None:
    ledger = StepLedger("worker", policies={"durable": EveryN(10), "ram": SnapshotCadence(3)})
    run_to(ledger, 12)
    ledger.restored(7, data_position=7, restored_from="durable", seconds=0.0)
    assert [(step, due) for step, due in run_to(ledger, 12) if due] == [(10, ("durable", "ram"))]


@pytest.mark.parametrize("n", [0, -3])
def test_an_impossible_every_n_is_refused(n: int) -> None:
    with pytest.raises(ValueError, match="must be >= 1 step"):
        EveryN(n)


def test_every_n_saves_once_per_multiple_crossed_even_when_offered_only_some_steps() -> None:
    policy = EveryN(4)
    assert [step for step in range(1, 13) if policy.should_save(step, step - 1)] == [4, 8, 12]
    assert policy.should_save(9, 7) and not policy.should_save(11, 9)  # offered steps 3, 5, 7, 9, 11
