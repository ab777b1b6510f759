"""A worker told to go by its host leaves cleanly (``runtime/cluster/worker/leaving.py``): SIGTERM to one worker
process of ``elastic-runtime launch`` (4 workers and a warm spare; process 0, which writes the result) mid-run.
It says so to the controller, which plans its departure like a drained host's (``planned.py``): the spare takes
its seat at a planned step, the others keep their state in memory, nothing is counted against ``--max-failures 0``
(a single failure would end the run), no step runs twice, the signalled worker exits 0, and the final state is
bitwise the fault-free run's.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from runtime.cli.demo_multiprocess import run_group, worker_command
from runtime.cluster.protocol import ENV_GRACE_S
from runtime.core.eventlog import read_events
from runtime.core.events import (
    GroupFormed,
    GroupForming,
    RecoveryStarted,
    StepCompleted,
    WorkerExited,
    WorkerHung,
    WorkerLost,
    WorkerSignalled,
    WorkerStarted,
)
from runtime.testing import launched
from runtime.testing.compare import compare_states
from storage.disk import DiskTier

STEPS = 30
NPROCS = 4

# A minute or more (a reference run, then the run with the departure): in `make test-heavy`.
pytestmark = [pytest.mark.timeout(400), pytest.mark.heavy]


def final(folder: Path) -> Any:
    return DiskTier(folder).latest(None).tree


def test_sigterm_to_a_worker_is_a_planned_departure_that_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = run_group(processes=NPROCS, steps=STEPS, run_dir=tmp_path / "reference", faults=[])
    assert reference.ok
    # The workers' grace period only guards against a hang here: the machine may be loaded.
    monkeypatch.setenv(ENV_GRACE_S, "300")
    run_dir = tmp_path / "run"
    flags = ("--spares", "1", "--max-failures", "0")
    controller = launched.launch(run_dir, worker_command(STEPS), *flags, nprocs=NPROCS, step_delay_s=0.25)
    launched.wait_for_step(run_dir, controller, 6)
    events = launched.events_so_far(run_dir)
    leaver = next(e for e in events if isinstance(e, GroupFormed)).members[0]  # process 0: it writes the result
    pid = next(e.pid for e in events if isinstance(e, WorkerStarted) and e.worker == leaver)
    os.kill(pid, signal.SIGTERM)
    output, _ = controller.communicate(timeout=300)
    assert controller.returncode == 0, output.decode()[-3000:]
    summary = json.loads(output.decode().strip().splitlines()[-1])
    assert summary["ok"] and summary["step"] == STEPS, summary["reason"]

    events = read_events(run_dir / "events.jsonl")
    [signalled] = [e for e in events if isinstance(e, WorkerSignalled)]
    assert (signalled.worker, signalled.signal) == (leaver, "SIGTERM")
    forming = [e for e in events if isinstance(e, GroupForming) and e.mono_time > signalled.mono_time]
    assert [e.strategy for e in forming] == ["drain"], forming
    assert leaver not in forming[0].members and len(forming[0].members) == NPROCS  # the spare took its seat
    assert not [e for e in events if isinstance(e, WorkerLost | WorkerHung | RecoveryStarted)]
    assert summary["recoveries"] == [] and summary["survivor_restarts"] == 0
    [exited] = [e for e in events if isinstance(e, WorkerExited) and e.worker == leaver]
    assert exited.returncode == 0
    steps = [e.step for e in events if isinstance(e, StepCompleted)]
    assert sorted(steps) == list(range(1, STEPS + 1)), steps  # every step committed once: none lost, none again
    match = compare_states(final(run_dir / "final"), final(tmp_path / "reference" / "final"), bitwise=True)
    assert match["match"], match
    print(f"drained at step {forming[0].step}; load average {os.getloadavg()}")
