"""A straggler acted on under launch: process 2 of 4 (and a warm spare) becomes 3x slower from step 20 (the ``slow``
worker fault: it sleeps twice its own work after each step, outside the collectives, so the others wait for it).
The heartbeat monitor finds it from the time each worker spends outside the step's collectives; the controller
replaces it with the spare at a planned step, since its cost over the remaining steps exceeds a re-forming's; the
others keep their state, nothing is lost or counted as a failure, and the final state is bitwise the fault-free
run's. The step times before, during and after are a benchmark's figures (``demo --slow-worker``), not asserted.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_runtime.cli.demo_multiprocess import run_group
from elastic_runtime.cluster.protocol import ENV_STEP_DELAY_S
from elastic_runtime.core.compare import compare_states
from elastic_runtime.core.eventlog import read_events
from elastic_runtime.core.events import GroupFormed, RecoveryStarted, Straggler, WorkerLost
from elastic_runtime.faults.grammar import Fault
from elastic_runtime.storage.disk import DiskTier

STEPS = 80

# Two launched runs of 80 steps at 0.1 s or more each: in `make test-heavy`.
pytestmark = [pytest.mark.timeout(400), pytest.mark.heavy]


def test_a_worker_3x_slower_is_replaced_by_the_spare_and_nothing_is_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_STEP_DELAY_S, "0.1")  # every worker: a step long enough to see the slowdown in
    slow = Fault("slow", 2, step=20, factor=3.0)
    result = run_group(processes=4, steps=STEPS, run_dir=tmp_path / "run", faults=[slow], max_failures=0)
    assert result.ok and result.step == STEPS, result.reason
    events = read_events(tmp_path / "run" / "events.jsonl")
    first, *later = [e for e in events if isinstance(e, GroupFormed)]
    straggler = first.members[2]
    [found] = [e for e in events if isinstance(e, Straggler)]
    assert found.worker == straggler and found.action == "replace", found
    assert found.slowdown >= 1.5 and "replaced by a ready spare" in found.reason
    [drained] = later
    assert drained.strategy == "drain" and straggler not in drained.members and len(drained.members) == 4
    assert not [e for e in events if isinstance(e, WorkerLost | RecoveryStarted)]  # no failure, no recovery
    assert result.recoveries == []

    reference = run_group(processes=4, steps=STEPS, run_dir=tmp_path / "reference", faults=[])
    assert reference.ok
    got, want = (DiskTier(tmp_path / name / "final").latest(None).tree for name in ("run", "reference"))
    assert compare_states(got, want, bitwise=True)["match"]
