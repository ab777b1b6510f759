"""A clean stop loses nothing (``runtime/cluster/controller/drain.py``): SIGTERM to ``elastic-runtime launch`` with a
durable tier whose cadence is too long to have written anything yet; the group holds, its first slice (both
processes of one slice: each writes its own shards) writes a durable checkpoint of the newest step every member
committed, the controller commits it, the ``/dev/shm`` replicas go only then, and ``--resume`` continues from that
step: no step runs twice, and the final state is bitwise the fault-free run's.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from elastic_runtime.cli.demo_multiprocess import run_group, worker_command
from elastic_runtime.cluster.controller.runfolder import default_replica_dir
from elastic_runtime.core.compare import compare_states
from elastic_runtime.core.eventlog import read_events
from elastic_runtime.core.events import CheckpointCommitted, RunFinished, StepCompleted
from elastic_runtime.storage.disk import DiskTier
from elastic_runtime.testing import launched

STEPS = 24
NPROCS = 2
EVERY = 1000  # no durable step on the cadence: only the drain writes one

pytestmark = pytest.mark.timeout(400)


def final(folder: Path) -> Any:
    return DiskTier(folder).latest(None).tree


def test_sigterm_commits_the_newest_step_durably_and_resume_runs_no_step_again(tmp_path: Path) -> None:
    reference = run_group(processes=NPROCS, slices=1, steps=STEPS, run_dir=tmp_path / "reference", faults=[])
    assert reference.ok
    run_dir, durable = tmp_path / "run", tmp_path / "durable"
    # The grace period only guards against a hang: the machine may be loaded.
    flags = ("--slices", "1", "--durable", str(durable), "--durable-every", str(EVERY), "--grace-s", "120")
    worker = worker_command(STEPS)
    controller = launched.launch(run_dir, worker, *flags, nprocs=NPROCS, step_delay_s=0.2)
    launched.wait_for_step(run_dir, controller, 6)
    controller.send_signal(signal.SIGTERM)
    output, _ = controller.communicate(timeout=180)
    assert controller.returncode == 1, output.decode()[-3000:]
    first = json.loads(output.decode().strip().splitlines()[-1])
    held = first["drain_checkpoint"]
    events = read_events(run_dir / "events.jsonl")
    logged = [e.step for e in events if isinstance(e, StepCompleted)]
    assert held >= max(logged) >= 6, (first["reason"], logged)
    assert f"final durable checkpoint of step {held} committed" in first["reason"], first["reason"]
    assert first["drain_s"] is not None and first["drain_s"] > 0
    print(f"drain: {first['drain_s']} s from SIGTERM to every worker gone; load average {os.getloadavg()}")
    [commit] = [e for e in events if isinstance(e, CheckpointCommitted) and e.tier == "durable"]
    assert commit.step == held
    finished = events[-1]
    assert isinstance(finished, RunFinished) and "SIGTERM" in finished.reason and str(held) in finished.reason
    assert not Path(default_replica_dir(run_dir)).exists()  # removed once the checkpoint was committed

    again = launched.launch(run_dir, worker, *flags, "--resume", nprocs=NPROCS)
    output, _ = again.communicate(timeout=180)
    assert again.returncode == 0, output.decode()[-3000:]
    second = json.loads(output.decode().strip().splitlines()[-1])
    assert second["ok"] and second["step"] == STEPS
    assert second["resumed_from"] == held  # nothing committed before the signal runs again
    steps = [e.step for e in read_events(run_dir / "events.jsonl") if isinstance(e, StepCompleted)]
    assert len(steps) == len(set(steps)) and max(steps) == STEPS
    assert min(s for s in steps if s not in logged) == held + 1
    match = compare_states(final(run_dir / "final"), final(tmp_path / "reference" / "final"), bitwise=True)
    assert match["match"], match
