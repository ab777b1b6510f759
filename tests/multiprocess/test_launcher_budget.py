"""A run that cannot go on ends, and says why; a run that was cut off goes on. Real worker processes, real
signals, no mocks.

- an error in the user's data ends the run at once (StepError), with the worker's traceback;
- a crash at the same step in every attempt ends within the retry budget (RecoveryError), backing off;
- a state sharded across processes is refused before step 1 (JobUnsupported);
- a replica folder holding another run's files is skipped with an event, never restored;
- ``kill -9`` of the controller (with a SIGSTOPped worker), then ``launch --resume``: no worker left behind,
  the run continues from the newest replicated step, and ends bitwise equal to a fault-free run;
- SIGTERM or SIGINT to the controller: ``RunFinished``, ``summary.json``, no /dev/shm folder, no process left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from elastic_runtime.cli.demo_multiprocess import run_group, worker_command
from elastic_runtime.cluster.controller.runfolder import default_replica_dir
from elastic_runtime.core.errors import JobUnsupported, RecoveryError, StepError
from elastic_runtime.core.eventlog import read_events
from elastic_runtime.core.events import (
    GroupFormed,
    ReplicaSkipped,
    RunFinished,
    StepCompleted,
    StepFailed,
    WorkerHung,
)
from elastic_runtime.faults.grammar import parse_faults
from elastic_runtime.storage.disk import DiskTier
from elastic_runtime.testing import launched
from elastic_runtime.testing.launched import alive, events_so_far, wait_for_step, wait_until_gone, worker_pids

STEPS = 30
NPROCS = 2
SCRIPT = Path(__file__).with_name("faulty_train.py")

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fault-free run; its replica folder is kept (an explicit one is not removed) for the skip test."""
    run_dir = tmp_path_factory.mktemp("reference")
    result = run_group(processes=NPROCS, steps=STEPS, run_dir=run_dir, faults=[], replica_dir=str(run_dir / "replicas"))
    assert result.ok and result.step == STEPS
    return run_dir


def leaves(folder: Path) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(DiskTier(folder).latest(None).tree)]


def assert_bitwise_equal(got: Path, want: Path) -> None:
    for i, (a, b) in enumerate(zip(leaves(got), leaves(want), strict=True)):
        assert np.array_equal(a, b), f"leaf {i} differs from the fault-free run"


def summary(run_dir: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    return data


def faulty(tmp_path: Path, *flags: str, **extra: Any) -> Any:
    command = [sys.executable, str(SCRIPT), "--steps", str(STEPS), *flags]
    return run_group(processes=NPROCS, steps=STEPS, run_dir=tmp_path, faults=[], command=command, **extra)


def test_an_error_in_the_users_data_ends_the_run_at_once(tmp_path: Path) -> None:
    with pytest.raises(StepError, match="step 12 failed in worker") as caught:
        faulty(tmp_path, "--raise-at", "12")
    assert caught.value.step == 12
    message = str(caught.value)
    assert "ValueError: corrupt record at data position 11" in message and "Traceback" in message
    events = read_events(tmp_path / "events.jsonl")
    assert any(isinstance(e, StepFailed) and e.step == 12 for e in events)
    # The worker's own event, as it classified the error, published as from that worker.
    failed = [e for e in events if isinstance(e, StepFailed)]
    assert all(e.source.startswith("worker-") and e.error_type == "ValueError" for e in failed), failed
    assert not any(isinstance(e, WorkerHung) for e in events)  # reported, not waited out as a hang
    assert [e.generation for e in events if isinstance(e, GroupFormed)] == [1]  # nothing re-formed
    [finished] = [e for e in events if isinstance(e, RunFinished)]
    assert not finished.ok and "StepError" in finished.reason
    got = summary(tmp_path)
    assert got["ok"] is False and "corrupt record" in got["reason"]


def test_a_crash_at_the_same_step_every_attempt_ends_within_the_budget(tmp_path: Path) -> None:
    # Every worker's process dies at step 12, in every group: re-forming cannot fix it. The step is tried
    # again at once, then after 0.5 s, and the third failure ends the run with the workers' own traceback.
    with pytest.raises(RecoveryError, match="step 12 failed 3 times") as caught:
        faulty(tmp_path, "--crash-at", "12")
    message = str(caught.value)
    assert "ValueError: corrupt record at data position 11" in message and "worker log" in message
    assert caught.value.last_committed_step == 11
    events = read_events(tmp_path / "events.jsonl")
    assert len([e for e in events if isinstance(e, GroupFormed)]) == 3  # the start and two retries
    got = summary(tmp_path)
    assert got["ok"] is False and "step 12 failed 3 times" in got["reason"]


def test_a_failure_during_a_recovery_counts_against_the_budget(tmp_path: Path) -> None:
    # Two failures: a kill at step 5, and a second kill while the group re-forms. With a budget of one, the
    # second ends the run, although no step failed twice and the first recovery had not ended.
    with pytest.raises(RecoveryError, match="2 failures exceed max_failures=1"):
        run_group(
            processes=NPROCS,
            steps=STEPS,
            run_dir=tmp_path,
            faults=parse_faults("kill:1@5,kill:0@forming"),
            max_failures=1,
        )
    assert summary(tmp_path)["ok"] is False


def test_a_state_sharded_across_processes_is_refused_before_step_1(tmp_path: Path) -> None:
    with pytest.raises(JobUnsupported, match="sharded across processes") as caught:
        faulty(tmp_path, "--sharded")
    assert "before step 1" in str(caught.value) and "'model'" in str(caught.value)
    events = read_events(tmp_path / "events.jsonl")
    assert not any(isinstance(e, StepCompleted) for e in events)
    assert summary(tmp_path)["ok"] is False


def test_a_replica_folder_of_another_run_is_skipped_and_never_restored(tmp_path: Path, reference: Path) -> None:
    # The reference run left its replicas of steps 29 and 30 in this folder; this run is another run.
    shared = reference / "replicas"
    assert any(shared.rglob("manifest.json"))
    result = run_group(processes=NPROCS, steps=STEPS, run_dir=tmp_path, faults=[], replica_dir=str(shared))
    assert result.ok and result.step == STEPS and result.resumed_from == -1
    events = read_events(tmp_path / "events.jsonl")
    skipped = [e for e in events if isinstance(e, ReplicaSkipped)]
    assert skipped and all("another run's replica" in e.reason for e in skipped)
    assert len({e.path for e in skipped}) == len(skipped)  # one event per replica, however many workers read it
    [formed] = [e for e in events if isinstance(e, GroupFormed)]
    assert formed.restore_step == 0
    assert len({e.step for e in events if isinstance(e, StepCompleted)}) == STEPS  # every step trained here
    assert_bitwise_equal(tmp_path / "final", reference / "final")


def launch(run_dir: Path, *extra: str, step_delay_s: float = 0.0) -> subprocess.Popen[bytes]:
    return launched.launch(run_dir, worker_command(STEPS), *extra, nprocs=NPROCS, step_delay_s=step_delay_s)


@pytest.mark.parametrize("every", [1, 10], ids=["file-every-step", "file-every-10"])
def test_kill_9_of_the_controller_then_resume_continues_bitwise(tmp_path: Path, reference: Path, every: int) -> None:
    # Every worker is lost with its controller: the run resumes from their replica files, of every step or of
    # every 10th (``--replica-file-every 10``, the default).
    controller = launch(tmp_path, "--replica-file-every", str(every), step_delay_s=0.15)
    wait_for_step(tmp_path, controller, 10 if every == 1 else 13)  # 13: the file of step 10 is surely written
    pids = worker_pids(tmp_path)
    os.kill(pids[0], signal.SIGSTOP)  # stopped: it cannot notice its controller go
    controller.kill()
    controller.communicate()
    assert wait_until_gone(pids) == []  # every worker dies with its controller, the stopped one too
    committed = max(e.step or 0 for e in events_so_far(tmp_path) if isinstance(e, StepCompleted))
    assert Path(default_replica_dir(tmp_path)).is_dir()  # the replicas survived the controller
    again = launch(tmp_path, "--resume")
    output, _ = again.communicate(timeout=150)
    assert again.returncode == 0, output.decode()
    result = json.loads(output.decode().strip().splitlines()[-1])
    assert result["ok"] and result["step"] == STEPS
    # From the newest replicated step: at most the replica still being written when the controller died.
    newest_file = committed // every * every
    assert newest_file - every <= result["resumed_from"] <= committed + 1, (committed, result["resumed_from"])
    assert result["resumed_from"] % every == 0
    assert_bitwise_equal(tmp_path / "final", reference / "final")
    assert not Path(default_replica_dir(tmp_path)).exists()
    # The log of both controllers reads back whole, and the second continued where the first stopped.
    steps = [e.step for e in read_events(tmp_path / "events.jsonl") if isinstance(e, StepCompleted)]
    assert max(steps) == STEPS and set(steps) == set(range(1, STEPS + 1))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_drains_the_run(tmp_path: Path, sig: signal.Signals) -> None:
    controller = launch(tmp_path, step_delay_s=0.15)
    wait_for_step(tmp_path, controller, 5)
    pids = worker_pids(tmp_path)
    controller.send_signal(sig)
    output, _ = controller.communicate(timeout=60)
    assert controller.returncode == 1, output.decode()
    events = read_events(tmp_path / "events.jsonl")
    finished = events[-1]
    assert isinstance(finished, RunFinished) and not finished.ok and sig.name in finished.reason
    got = summary(tmp_path)
    assert got["ok"] is False and sig.name in got["reason"] and got["step"] >= 5
    assert not Path(default_replica_dir(tmp_path)).exists()
    assert not [pid for pid in pids if alive(pid)]
    # An unfinished run: the same folder resumes it (here from step 0: the /dev/shm replicas went with it).
    assert json.loads((tmp_path / "run.json").read_text())["finished"] is False


def test_a_worker_command_that_disagrees_with_launch_steps_ends_the_run_at_once(tmp_path: Path) -> None:
    # The workers prove the secret and are the controller's own: every replacement would disagree too, so the
    # run ends with the reason instead of replacing workers until the spawn deadline.
    controller = launch(tmp_path, "--steps", str(STEPS + 5))
    output, _ = controller.communicate(timeout=60)
    assert controller.returncode == 1
    assert f"asks for {STEPS} steps; this run's target is {STEPS + 5}" in output.decode()
    assert "must agree" in output.decode()
    logs = list((tmp_path / "workers").glob("worker-*.log"))
    assert len(logs) <= NPROCS + 1, logs  # the group and its spare, nobody more
