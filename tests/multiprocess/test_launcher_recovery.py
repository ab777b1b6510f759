"""Kill real worker processes (kill -9, SIGSTOP) at chosen points and check the run ends where a fault-free
run ends, bitwise, with no committed step lost and the controller never restarted.

Each run: 3 worker processes x 2 CPU devices, gloo collectives on loopback, one warm spare, 30 steps of the
demo model. Every recovery here keeps the group at full size, so the final state must be bitwise equal.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from launch_support import NPROCS, STEPS  # as the fault-free `reference` run (conftest.py) has

from elastic_runtime.cli.demo_multiprocess import run_group
from elastic_runtime.cli.launch import DEFAULTS
from elastic_runtime.compat.xla import ENV_COLLECTIVE_TIMEOUT
from elastic_runtime.core.eventlog import read_events
from elastic_runtime.core.events import (
    GroupFormed,
    RecoveryCompleted,
    StateRestored,
    StepCompleted,
    WorkerHung,
    WorkerKilled,
    WorkerLost,
)
from elastic_runtime.faults.grammar import Fault, parse_faults
from elastic_runtime.storage.disk import DiskTier

pytestmark = pytest.mark.timeout(120)


def run(tmp_path: Path, **kwargs: Any) -> tuple[Any, list[Any]]:
    result = run_group(processes=NPROCS, steps=STEPS, run_dir=tmp_path, **kwargs)
    # Every member of the final group holds the same state: one digest, reported by each of them.
    assert len(result.digests) >= NPROCS and len(set(result.digests.values())) == 1, result.digests
    return result, read_events(tmp_path / "events.jsonl")


def assert_same_final_state(tmp_path: Path, reference: Path) -> None:
    got, want = final_state(tmp_path / "final"), final_state(reference)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert np.array_equal(a, b), f"leaf {i} differs from the fault-free run"


def final_state(folder: Path) -> list[np.ndarray]:
    """The leaves of the final state process 0 committed to ``folder`` (read back verified)."""
    return [np.asarray(leaf) for leaf in jax.tree.leaves(DiskTier(folder).latest(None).tree)]


def assert_no_committed_step_lost(events: list[Any]) -> None:
    """Every restore starts at or after the newest step the whole group had committed before it."""
    committed = 0
    restores = 0
    for event in events:
        if isinstance(event, StepCompleted):
            assert event.step == committed + 1 or event.step <= committed, f"step {event.step} after {committed}"
            committed = max(committed, event.step)
        elif isinstance(event, StateRestored):
            restores += 1
            assert event.step >= committed, f"restored step {event.step} < committed step {committed}"
            assert event.lost_steps == 0
            committed = event.step
    assert committed == STEPS
    for event in events:
        if isinstance(event, RecoveryCompleted):
            assert event.lost_steps == 0
    assert restores >= 1


def test_kill_9_a_worker_mid_run_reforms_in_process(tmp_path: Path, reference: Path) -> None:
    result, events = run(tmp_path, faults=[Fault("kill", 1, step=10)])
    assert result.ok and result.step == STEPS
    assert result.strategies == ["start", "reform"]
    assert result.survivor_restarts == 0
    assert result.world_size_history == [3, 3]
    [recovery] = result.recoveries
    assert recovery["lost_steps"] == 0 and recovery["restored_from"].startswith("ram")
    [detected] = result.detected_after_s
    assert detected < 2.5
    assert any(isinstance(e, WorkerLost) for e in events)
    assert_no_committed_step_lost(events)
    assert_same_final_state(tmp_path, reference)


def test_a_step_abandoned_in_a_collective_with_a_lost_peer_ends(tmp_path: Path) -> None:
    """A survivor's step blocked in a collective with the lost peer is abandoned when the group re-forms, and must
    then end: gloo fails it at the collective timeout the controller puts in the workers' XLA flags. One that
    never ended (XLA's own timeout is 30 minutes) kept the old group's backend alive, its gloo thread polling: a
    survivor carried one more after each loss, and steps slowed by half (docs/benchmarks.md)."""
    # Four processes: in gloo's ring the survivors next to the killed one fail at once, the one across waits on
    # them. A collective timeout of 5 s, past the loss's detection, and 20 steps of 0.4 s after it: the abandoned
    # step ends inside the run. (No fault-free reference of 4 processes here: the other tests compare bitwise.)
    result = run_group(
        processes=4,
        steps=STEPS,
        run_dir=tmp_path,
        faults=[Fault("kill", 1, step=10)],
        extra_env={ENV_COLLECTIVE_TIMEOUT: "5", "ELASTIC_STEP_DELAY_S": "0.4"},
    )
    assert result.ok and result.strategies == ["start", "reform"] and result.survivor_restarts == 0
    logs = "".join(path.read_text() for path in (tmp_path / "workers").glob("worker-*.log"))
    abandoned = re.findall(r"abandoning (step \d+), blocked in a collective", logs)
    ended = re.findall(r"the abandoned (step \d+) ended: JaxRuntimeError: (.*)", logs)
    assert abandoned, "no survivor's step was blocked in a collective with the lost peer"
    assert sorted(step for step, _ in ended) == sorted(abandoned), (abandoned, ended)
    assert all("Gloo" in why for _, why in ended), ended
    assert_no_committed_step_lost(read_events(tmp_path / "events.jsonl"))


def test_kill_9_process_0_which_would_host_the_coordination_service(tmp_path: Path, reference: Path) -> None:
    result, events = run(tmp_path, faults=[Fault("kill", 0, step=10)])
    assert result.ok and result.strategies == ["start", "reform"] and result.survivor_restarts == 0
    assert_no_committed_step_lost(events)
    assert_same_final_state(tmp_path, reference)


def test_kill_mid_step_after_compute_before_commit(tmp_path: Path, reference: Path) -> None:
    # Process 2 computes step 12 and is killed -9 before committing it: that step must run again.
    result, events = run(tmp_path, faults=parse_faults("die-midstep:2@12"))
    assert result.ok and result.strategies == ["start", "reform"]
    [restored] = [e for e in events if isinstance(e, StateRestored)]
    assert restored.step >= 11
    assert_no_committed_step_lost(events)
    assert_same_final_state(tmp_path, reference)


def test_kill_mid_replica_file_write(tmp_path: Path, reference: Path) -> None:
    # Process 1 is killed -9 half-way through writing its /dev/shm replica file of step 8.
    result, events = run(tmp_path, faults=parse_faults("die-writing-replica:1@8"))
    assert result.ok and result.strategies == ["start", "reform"]
    assert_no_committed_step_lost(events)
    assert_same_final_state(tmp_path, reference)


def test_kill_during_recovery_drops_out_of_the_forming_and_no_survivor_is_replaced(
    tmp_path: Path, reference: Path
) -> None:
    # A second worker dies while the group re-forms: it drops out of that forming (a spare takes its seat, or
    # the rest re-form without it); the members waiting for it are not replaced.
    result, events = run(tmp_path, faults=parse_faults("kill:1@10,kill:2@forming"))
    assert result.ok and result.step == STEPS
    assert result.strategies == ["start", "reform"] and result.survivor_restarts == 0
    assert sum(1 for e in events if isinstance(e, WorkerKilled) and "fault injection" in e.reason) == 2
    assert_no_committed_step_lost(events)
    assert_same_final_state(tmp_path, reference)


def test_two_failures_in_a_row(tmp_path: Path, reference: Path) -> None:
    result, events = run(tmp_path, faults=[Fault("kill", 1, step=8), Fault("kill", 2, step=16)])
    assert result.ok and result.step == STEPS
    assert len(result.recoveries) == 2 and result.survivor_restarts == 0
    assert [e.generation for e in events if isinstance(e, GroupFormed)] == [1, 2, 3]
    assert_no_committed_step_lost(events)
    assert_same_final_state(tmp_path, reference)


def test_sigstop_hang_is_detected_and_the_worker_replaced(tmp_path: Path, reference: Path) -> None:
    result, events = run(tmp_path, faults=[Fault("stop", 1, step=10)])
    assert result.ok and result.step == STEPS
    [hung] = [e for e in events if isinstance(e, WorkerHung)]
    assert "stopped" in hung.message
    [detected] = result.detected_after_s
    timeout = DEFAULTS["heartbeat_timeout_s"]  # of a training worker: less a beat interval, or more (under load)
    assert timeout - 0.25 <= detected < 2.0
    assert_no_committed_step_lost(events)
    assert_same_final_state(tmp_path, reference)


def test_forced_restart_strategy_restores_from_shm(tmp_path: Path, reference: Path) -> None:
    result, events = run(tmp_path, faults=[Fault("kill", 1, step=10)], strategy="restart")
    assert result.ok and result.strategies == ["start", "restart"]
    assert result.survivor_restarts == NPROCS - 1
    [recovery] = result.recoveries
    assert recovery["restored_from"].startswith("shm")
    assert_no_committed_step_lost(events)
    assert_same_final_state(tmp_path, reference)


def test_shrink_to_min_nprocs_then_grow_back_at_a_step_boundary(tmp_path: Path, reference: Path) -> None:
    # No warm spare, and too little time to start one: the group goes on with 2 workers (min_nprocs), and
    # grows back to 3 at a planned step boundary once the new process is up.
    # Steps slowed to 0.25 s so that the new process (2-5 s to import JAX here) is up before the run ends; a
    # new process, not forked (a fork is up within the spawn timeout, and the group would not shrink).
    result, events = run(
        tmp_path,
        faults=[Fault("kill", 1, step=5)],
        spares=0,
        min_nprocs=2,
        spawn_timeout_s=0.3,
        fork_spares=False,
        extra_env={"ELASTIC_STEP_DELAY_S": "0.25"},
    )
    assert result.ok and result.step == STEPS
    assert result.world_size_history == [3, 2, 3]
    assert result.strategies == ["start", "reform", "grow"]
    assert_no_committed_step_lost(events)
    # Some steps ran with the batch split 2 ways instead of 3: equal up to float reassociation.
    for i, (got, want) in enumerate(zip(final_state(tmp_path / "final"), final_state(reference), strict=True)):
        scale = float(np.max(np.abs(want))) or 1.0
        assert float(np.max(np.abs(got - want))) / scale <= 1e-5, f"leaf {i}"


def test_a_deadlocked_step_is_detected_as_a_hang(tmp_path: Path, reference: Path) -> None:
    # Process 1's step 12 blocks forever while its heartbeat thread goes on: no progress. Its peers
    # wait in the collective and stop progressing too, so any of them may be judged hung first; whoever is
    # replaced, the group recovers with no committed step lost.
    result, events = run(tmp_path, faults=parse_faults("hang:1@12"), hang_timeout_s=2.0)
    assert result.ok and result.step == STEPS
    hung = [e for e in events if isinstance(e, WorkerHung)]
    # The hung worker stopped after computing step 12 (not committed: 11); its peers committed 12 and wait.
    assert hung and all(e.message.startswith(("no progress past step 11", "no progress past step 12")) for e in hung)
    assert all(e.stalled_s >= 2.0 for e in hung)
    assert_no_committed_step_lost(events)
    assert_same_final_state(tmp_path, reference)


def test_every_member_hung_restores_the_newest_committed_step_from_sparse_replica_files(
    tmp_path: Path, reference: Path
) -> None:
    # Every member's step 12 blocks: each is judged hung and replaced, and the new group can only restore from the
    # replica files, which the default cadence writes every 10th step. A step running half the hang timeout got
    # the step before it (11) written: the group goes on from 11, not from 10. (The every-member deadlock that
    # test_a_deadlocked_step_is_detected_as_a_hang may or may not reach, made certain.)
    faults = ",".join(f"hang:{process}@12" for process in range(NPROCS))
    result, events = run(tmp_path, faults=parse_faults(faults), hang_timeout_s=2.0)
    assert result.ok and result.step == STEPS
    hung = {e.worker for e in events if isinstance(e, WorkerHung)}  # worker ids, not process ids
    restored = [e for e in events if isinstance(e, StateRestored)]
    # Their last progress was the same step: all are judged hung together, and the new group has only the files
    # (with the write switched off it restored 10 from them). On a loaded machine one might be re-formed first
    # instead, holding step 11 in memory. Either way: 11.
    assert restored and restored[0].step == 11, (hung, restored)
    assert_no_committed_step_lost(events)
    assert_same_final_state(tmp_path, reference)


def test_an_ordinary_elastic_runtime_script_runs_under_the_launcher(tmp_path: Path, reference: Path) -> None:
    # examples/multiprocess_train.py is a single-process ElasticRuntime script; launched, each process is a
    # worker. Same model and data as the reference, so the result is bitwise the same, kill included.
    script = Path(__file__).parents[2] / "examples" / "multiprocess_train.py"
    command = [sys.executable, str(script), "--steps", str(STEPS)]
    result, events = run(tmp_path, faults=[Fault("kill", 2, step=10)], command=command)
    assert result.ok and result.strategies == ["start", "reform"]
    assert_no_committed_step_lost(events)
    assert_same_final_state(tmp_path, reference)
